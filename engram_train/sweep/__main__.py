from engram_train.sweep.sweep_cli import main

main()

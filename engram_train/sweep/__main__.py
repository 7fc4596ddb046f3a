from engram_train.sweep.cli import main

main()

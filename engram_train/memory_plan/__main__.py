from engram_train.memory_plan.cli import main

main()

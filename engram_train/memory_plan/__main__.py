from engram_train.memory_plan.plan_cli import main

main()

"""python -m engram_train.export: same as the engram-export console script."""

from engram_train.export.export_cli import main

main()

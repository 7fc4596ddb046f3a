"""A host table update that fails on one rank while a checkpoint is due (2 processes, the
trainer's own entry point, host-resident tables with the overlapped update).

Rank 1's table optimizer raises while updating its rows of step 2; iteration 2 saves a
checkpoint. The run must stop (non-zero exit, rank 1's one-line message, no checkpoint written)
instead of leaving rank 0 waiting in the save's collectives. No rank writes a result: the test
reads the launch's failure."""

import argparse
import os
import sys

from engram_train.training.rowwise_adam import RowwiseAdam
from engram_train.training.sparse_adam import RowSparseAdam

FAIL_RANK, FAIL_STEP = 1, 2


def inject_fault() -> None:
    for cls in (RowSparseAdam, RowwiseAdam):
        original = cls.update_rows

        def update_rows(self, param, rows, values, plan, _original=original):
            if plan["step"] == FAIL_STEP:
                raise RuntimeError("injected host update fault")
            _original(self, param, rows, values, plan)

        cls.update_rows = update_rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = parser.parse_args().out
    if int(os.environ["RANK"]) == FAIL_RANK:
        inject_fault()
    sys.argv = ["engram_train.train", f"experiment.exp_dir={out}/exp", f"checkpoint.save={out}/ckpt",
                "checkpoint.save_interval=2", "train.train_iters=4", "train.log_interval=1",
                "train.eval_interval=null", "model.engram_table_placement=host"]
    from engram_train.train import main as train_main

    train_main()


if __name__ == "__main__":
    main()

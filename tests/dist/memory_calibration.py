"""Peak RSS of trainer ranks, for the memory plan's calibration (tests/test_memory_plan.py).

    torchrun --nproc-per-node N tests/dist/memory_calibration.py --out DIR [--baseline] OVERRIDES...

Without ``--baseline``: runs the trainer (``engram_train.train.run``) with the Hydra overrides
and writes this rank's peak RSS (``getrusage``), its pipeline stage and its rank. With
``--baseline``: the fixed cost the plan adds to every rank, measured rather than guessed: the
same process up to the model - the trainer's modules imported (torch, megatron-core, the data,
metrics and checkpoint code), the config checked, its memory plan made (the trainer's start-up
check), the process groups built, the tokenizer loaded, the metrics writer and the plot
imported - and no model, optimizer or batch.
"""

import os
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from common import parse_args, write_result  # noqa: E402


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def main() -> None:
    args = parse_args({"--baseline": dict(action="store_true"),
                       "overrides": dict(nargs="*", default=[])})
    from engram_train.logs import quiet_known_warnings

    quiet_known_warnings()
    from engram_train.training.param_count import compose_config

    cfg = compose_config(args.overrides)
    if args.baseline:
        import engram_train.training.job  # noqa: F401  (the trainer's imports)
        import engram_train.training.loop  # noqa: F401
        import engram_train.training.resume  # noqa: F401
        import matplotlib.pyplot  # noqa: F401  (the loss plot at the end)
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401  (the metrics writer)
        from engram_train.memory_plan.start_check import check_memory
        from engram_train.runtime import initialize_distributed
        from engram_train.training.plan import check
        from engram_train.training.run_config import parallel_sizes

        check_memory(cfg, check(cfg).tokenizer.vocab_size)  # the trainer's start-up memory check
        initialize_distributed(parallel_sizes(cfg), seed=int(cfg.train.seed))
    else:
        from engram_train.train import run

        run(cfg)
    # megatron's rank order puts the pipeline outermost (the trainer has destroyed its groups)
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    stage = rank // (world // int(cfg.system.pipeline_model_parallel_size))
    write_result(args.out, {"peak_rss": peak_rss_bytes(), "pipeline_rank": stage})


if __name__ == "__main__":
    main()

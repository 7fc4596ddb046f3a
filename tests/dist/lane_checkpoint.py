"""Checkpoints across megatron-core lanes: every lane loads the checkpoints written by every lane.

``save DIR`` (one process, run once per lane to refresh the fixtures):
    .venv/bin/python tests/dist/lane_checkpoint.py save tests/data/lane_checkpoints/mcore0.16.1
    .venv-mcore0.19/bin/python tests/dist/lane_checkpoint.py save tests/data/lane_checkpoints/mcore0.19.2
trains a small Engram model (MLA + MoE, Engram on layer 1) with the distributed optimizer for
two steps, saves model + optimizer, and records the losses of the next two steps in
``DIR/expected.json`` with the versions that wrote it (the second one depends on the restored
Adam moments and step counts).

``--out OUT`` (under torchrun, 2 processes = data parallel 2): loads each fixture under
tests/data/lane_checkpoints into a fresh model and optimizer and reports the iteration, the
extra state and the losses of the next two steps, which must match the recorded ones.
"""

import json
import sys
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from common import SEQ, VOCAB, parse_args, repeated_batches, write_result
from engram_integration import SMALL, engram_config

FIXTURES = Path(__file__).resolve().parents[1] / "data" / "lane_checkpoints"
GLOBAL_BATCH = 4
SAVED_AT = 2
RESUMED_STEPS = 2


def build():
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from engram_train.models.builder import build_model
    from engram_train.runtime import ParallelSizes
    from engram_train.training.optimizer import build_optimizer

    config = engram_config(ParallelSizes(), [1], **SMALL)
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    model = build_model(config, VOCAB, SEQ, ddp)
    opt = OptimizerConfig(optimizer="adam", lr=3e-3, clip_grad=1.0, weight_decay=0.0,
                          use_distributed_optimizer=True)
    return model, build_optimizer(opt, model, config)


def step(model, optimizer) -> float:
    from megatron.core import parallel_state

    from engram_train.training.step import train_step

    batches = repeated_batches(GLOBAL_BATCH, 1, seed=3)
    dp, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    share = GLOBAL_BATCH // dp
    return train_step(model, optimizer, batches[rank * share : (rank + 1) * share], SEQ, 1).lm_loss


def save(directory: Path) -> None:
    from engram_train.checkpoint import save_checkpoint
    from engram_train.runtime import ParallelSizes, initialize_distributed

    initialize_distributed(ParallelSizes(), seed=5)
    model, optimizer = build()
    for _ in range(SAVED_AT):
        step(model, optimizer)
    save_checkpoint(directory, SAVED_AT, model, optimizer, extra={"written_by": "lane"})
    versions = {d: metadata.version(d) for d in ("megatron-core", "torch")}
    versions["python"] = ".".join(map(str, sys.version_info[:3]))
    next_losses = [step(model, optimizer) for _ in range(RESUMED_STEPS)]
    expected = dict(next_losses=next_losses, iteration=SAVED_AT, versions=versions)
    (directory / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")


def load_all(out: str) -> None:
    from engram_train.checkpoint import load_checkpoint
    from engram_train.runtime import ParallelSizes, initialize_distributed

    initialize_distributed(ParallelSizes(), seed=77)
    result = {}
    for fixture in sorted(p for p in FIXTURES.iterdir() if p.is_dir()):
        model, optimizer = build()
        iteration, extra = load_checkpoint(fixture, model, optimizer)
        next_losses = [step(model, optimizer) for _ in range(RESUMED_STEPS)]
        result[fixture.name] = dict(iteration=iteration, extra=extra, next_losses=next_losses)
    write_result(out, result)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "save":
        save(Path(sys.argv[2]))
    else:
        load_all(parse_args().out)

"""Next-layer lookup prefetch (``engram_prefetch``) on 4 processes, one launch.

For each layout the tiny DeepSeek-V3 Engram model (Engram on layers 1 and 3) is loaded from
the same checkpoint and trained with prefetch off and on, a different global batch every step
(new rows touched each step, so a stale or mixed-up row would change the losses): losses, grad
norms, the reassembled tables and the lookup timers are recorded. Layouts: PP2 with eps 2 and
4 micro-batches per rank in flight (1F1B), PP2 x VPP2, PP2 with full recompute, eps 4 (TP1),
eps 2 with TP2 + sequence parallel, and the allreduce method under TP2. The eps 2 / PP2 layout
runs longer (the "long" run)."""

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch
import torch.distributed as dist
from common import SEQ, VOCAB, parse_args, write_result
from embedding_parallel_training import reassemble
from engram_integration import build_engram_training, dp_share_of_step, engram_config

from engram_train.runtime import ParallelSizes, initialize_distributed

from megatron.core import parallel_state

from engram_train.checkpoint import save_checkpoint
from engram_train.models.builder import build_model
from engram_train.parallel.lookup import LOOKUP_TIMES
from engram_train.training.step import train_step

LAYER_IDS = [1, 3]
GLOBAL_BATCH = 8
FULL_RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform",
                      recompute_num_layers=1)
LAYOUTS = [  # name, method, sizes, sequence parallel, overrides, steps
    ("pp2_eps2_long", "alltoall", ParallelSizes(pipeline=2, engram_embedding=2), False, {}, 10),
    ("vpp2_eps2", "alltoall", ParallelSizes(pipeline=2, virtual_pipeline=2, engram_embedding=2),
     False, {}, 3),
    ("pp2_eps2_recompute", "alltoall", ParallelSizes(pipeline=2, engram_embedding=2), False,
     FULL_RECOMPUTE, 3),
    ("eps4", "alltoall", ParallelSizes(engram_embedding=4), False, {}, 3),
    ("tp2_eps2", "alltoall", ParallelSizes(tensor=2, engram_embedding=2), True, {}, 3),
    ("allreduce_tp2", "allreduce", ParallelSizes(tensor=2), True, {}, 3),
]


def batches_of_step(step: int):
    """This data-parallel rank's micro-batches (1 sequence each) of a step-specific batch."""
    return dp_share_of_step(500 + step, LAYER_IDS, GLOBAL_BATCH)


def run(root, method, sizes, sp, overrides, steps, prefetch):
    _, model, optimizer = build_engram_training(
        sizes, LAYER_IDS, method=method, sp=sp, seed=3, load=root, engram_prefetch=prefetch,
        **overrides)
    LOOKUP_TIMES.reset()
    losses, norms = [], []
    for step in range(steps):
        result = train_step(model, optimizer, batches_of_step(step), SEQ, 1)
        losses.append(result.lm_loss)
        norms.append(result.grad_norm)
    times = dict(issue_s=LOOKUP_TIMES.issue_s, wait_s=LOOKUP_TIMES.wait_s,
                 lookups=LOOKUP_TIMES.lookups)
    return dict(losses=losses, grad_norms=norms, times=times), reassemble(model, lambda p: p)


def main():
    args = parse_args()
    parallel_state.destroy_model_parallel()
    initialize_distributed(ParallelSizes(), seed=1)
    holder = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    root = Path(holder[0])
    base = engram_config(ParallelSizes(), LAYER_IDS)
    save_checkpoint(root, 0, build_model(base, VOCAB, SEQ))
    result = {}
    for name, method, sizes, sp, overrides, steps in LAYOUTS:
        off, tables_off = run(root, method, sizes, sp, overrides, steps, prefetch=False)
        on, tables_on = run(root, method, sizes, sp, overrides, steps, prefetch=True)
        result[name] = dict(
            off=off, on=on, steps=steps,
            tables_bitwise=sorted(tables_off) == sorted(tables_on) and all(
                torch.equal(tables_off[k], tables_on[k]) for k in tables_off),
        )
    write_result(args.out, result)


if __name__ == "__main__":
    main()

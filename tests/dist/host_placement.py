"""Host-resident Engram tables (``engram_table_placement: host``) on 4 processes, one launch.

For each layout the tiny DeepSeek-V3 Engram model (Engram on layers 1 and 3) is loaded from the
same checkpoint and trained with ``device`` and with ``host`` placement, a different global batch
every step: losses, grad norms, the reassembled tables and their Adam moments are recorded, with
evidence that the host path ran (tables marked host-resident, rows gathered through the host
staging path, the table optimizer's update timed on the host). Layouts: eps 1 (DP4 replicas),
eps 2, eps 2 with TP2 + sequence parallel, PP2 with eps 2, the allreduce method under TP2, and
bf16 tables (float32 masters on the host).

Resume across placements: 2 steps with ``device`` placement, a checkpoint with the optimizer,
then 2 more steps with ``host`` placement from it (and the reverse) must equal 4 uninterrupted
steps."""

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch
import torch.distributed as dist
from common import SEQ, VOCAB, parse_args, write_result
from embedding_parallel_training import reassemble
from engram_integration import build_engram_training, dp_share_of_step, engram_config, table_optimizer

from engram_train.runtime import ParallelSizes, initialize_distributed

from megatron.core import parallel_state

from engram_train.checkpoint import load_checkpoint, save_checkpoint
from engram_train.engram.host_table import HOST_TABLE_TIMES, is_host_resident
from engram_train.models.builder import build_model
from engram_train.training.step import train_step

LAYER_IDS = [1, 3]
GLOBAL_BATCH = 8
MICRO_BATCH = 2  # fewer micro-batches: fewer TP collectives per step on gloo
STEPS = 4
LAYOUTS = [  # name, method, sizes, sequence parallel, overrides
    ("eps1", "alltoall", ParallelSizes(), False, {}),
    ("eps2", "alltoall", ParallelSizes(engram_embedding=2), False, {}),
    ("tp2_eps2", "alltoall", ParallelSizes(tensor=2, engram_embedding=2), True, {}),
    ("pp2_eps2", "alltoall", ParallelSizes(pipeline=2, engram_embedding=2), False, {}),
    ("allreduce_tp2", "allreduce", ParallelSizes(tensor=2), True, {}),
    ("eps2_bf16_tables", "alltoall", ParallelSizes(engram_embedding=2), False,
     dict(engram_table_dtype="bf16")),
]
RESUME_SIZES = ParallelSizes(engram_embedding=2)


def batches_of_step(step: int):
    """This data-parallel rank's micro-batches of a step-specific batch."""
    return dp_share_of_step(700 + step, LAYER_IDS, GLOBAL_BATCH, MICRO_BATCH)


def setup(root, method, sizes, sp, overrides, placement):
    _, model, optimizer = build_engram_training(
        sizes, LAYER_IDS, method=method, sp=sp, seed=3, load=root,
        engram_table_placement=placement, **overrides)
    return model, optimizer


def train(model, optimizer, steps):
    losses, norms = [], []
    for step in steps:
        result = train_step(model, optimizer, batches_of_step(step), SEQ, MICRO_BATCH)
        losses.append(result.lm_loss)
        norms.append(result.grad_norm)
    return losses, norms


def snapshot(model, optimizer):
    """Tables and first moments, reassembled to full tables (every rank)."""
    tables = reassemble(model, lambda p: p)
    engram = table_optimizer(optimizer)
    moments = {id(p): engram.optimizer.state[m]["exp_avg"]
               for p, m in zip(engram.model_params, engram.main_params)}
    return tables, reassemble(model, lambda p: moments[id(p)])


def bitwise(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def run_layout(root, method, sizes, sp, overrides):
    out, states = {}, {}
    for placement in ("device", "host"):
        model, optimizer = setup(root, method, sizes, sp, overrides, placement)
        tables = [p for p in table_optimizer(optimizer).model_params]
        HOST_TABLE_TIMES.reset()
        losses, norms = train(model, optimizer, range(STEPS))
        out[placement] = dict(
            losses=losses, grad_norms=norms,
            host_resident=[is_host_resident(p) for p in tables],
            table_devices=sorted({p.device.type for p in tables}),
            host_rows=HOST_TABLE_TIMES.rows,
            host_update_s=HOST_TABLE_TIMES.update_s,
        )
        states[placement] = snapshot(model, optimizer)
    out["tables_bitwise"] = bitwise(states["device"][0], states["host"][0])
    out["moments_bitwise"] = bitwise(states["device"][1], states["host"][1])
    return out


def resume_across(root, ckpt_root, first, second):
    """2 steps with placement ``first``, checkpoint, 2 more with ``second``."""
    model, optimizer = setup(root, "alltoall", RESUME_SIZES, False, {}, first)
    losses, _ = train(model, optimizer, range(2))
    save_checkpoint(ckpt_root, 2, model, optimizer)
    model, optimizer = setup(root, "alltoall", RESUME_SIZES, False, {}, second)
    load_checkpoint(ckpt_root, model, optimizer)
    more, _ = train(model, optimizer, range(2, STEPS))
    tables, moments = snapshot(model, optimizer)
    return losses + more, tables, moments


def main():
    args = parse_args()
    parallel_state.destroy_model_parallel()
    initialize_distributed(ParallelSizes(), seed=1)
    holder = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    base_root = Path(holder[0])
    base = engram_config(ParallelSizes(), LAYER_IDS)
    save_checkpoint(base_root / "init", 0, build_model(base, VOCAB, SEQ))
    result = {}
    for name, method, sizes, sp, overrides in LAYOUTS:
        result[name] = run_layout(base_root / "init", method, sizes, sp, overrides)

    model, optimizer = setup(base_root / "init", "alltoall", RESUME_SIZES, False, {}, "device")
    straight, _ = train(model, optimizer, range(STEPS))
    tables, moments = snapshot(model, optimizer)
    for first, second in (("device", "host"), ("host", "device")):
        losses, got_tables, got_moments = resume_across(
            base_root / "init", base_root / f"{first}_to_{second}", first, second)
        result[f"resume_{first}_to_{second}"] = dict(
            losses=losses, straight=straight,
            tables_bitwise=bitwise(tables, got_tables),
            moments_bitwise=bitwise(moments, got_moments),
        )
    write_result(args.out, result)


if __name__ == "__main__":
    main()

"""Host-resident Engram tables (``engram_table_placement: host``) on 4 processes, one launch.

For each layout the tiny DeepSeek-V3 Engram model (Engram on layers 1 and 3) is loaded from the
same checkpoint and trained with ``device`` and with ``host`` placement, a different global batch
every step: losses, grad norms, the reassembled tables and their Adam moments are recorded, with
evidence that the host path ran (tables marked host-resident, rows gathered through the host
staging path, the table optimizer's update timed on the host). Layouts: eps 1 (DP4 replicas),
eps 2, eps 2 with TP2 + sequence parallel, PP2 with eps 2, the allreduce method under TP2,
bf16 tables (float32 masters on the host), and the 4-byte configuration under eps 2 and TP2 x eps 2 (``rowwise_adam``,
bf16 tables without master, stochastic rounding, bf16 first moment). ``host`` placement updates the
tables on a host thread overlapped with the next step (``engram_overlap_host_update``, the
default), ``device`` placement synchronously: equal bits mean the overlap is exact.

Overlap against the synchronous host update: 20 steps of the 4-byte configuration under eps 2
with ``engram_overlap_host_update`` on (each step naming the next step's batches, so their rows
are updated first) and off, losses and tables compared bitwise.

Resume across placements: 2 steps with ``device`` placement, a checkpoint with the optimizer,
then 2 more steps with ``host`` placement from it (and the reverse) must equal 4 uninterrupted
steps; the same in the 4-byte configuration, whose checkpoint also reloads under eps 1 (the
row moment reshards with its table)."""

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
FOUR_BYTE = dict(engram_table_dtype="bf16", engram_optimizer="rowwise_adam",
                 engram_master_weights=False, engram_optimizer_state_dtype="bf16")
LAYOUTS = [  # name, method, sizes, sequence parallel, overrides
    ("eps1", "alltoall", ParallelSizes(), False, {}),
    ("eps2", "alltoall", ParallelSizes(engram_embedding=2), False, {}),
    ("tp2_eps2", "alltoall", ParallelSizes(tensor=2, engram_embedding=2), True, {}),
    ("pp2_eps2", "alltoall", ParallelSizes(pipeline=2, engram_embedding=2), False, {}),
    ("allreduce_tp2", "allreduce", ParallelSizes(tensor=2), True, {}),
    ("eps2_bf16_tables", "alltoall", ParallelSizes(engram_embedding=2), False,
     dict(engram_table_dtype="bf16")),
    ("eps2_4byte", "alltoall", ParallelSizes(engram_embedding=2), False, FOUR_BYTE),
    ("tp2_eps2_4byte", "alltoall", ParallelSizes(tensor=2, engram_embedding=2), True, FOUR_BYTE),
]
OVERLAP_STEPS = 20
RESUME_SIZES = ParallelSizes(engram_embedding=2)


def batches_of_step(step: int):
    """This data-parallel rank's micro-batches of a step-specific batch."""
    return dp_share_of_step(700 + step, LAYER_IDS, GLOBAL_BATCH, MICRO_BATCH)


def setup(root, method, sizes, sp, overrides, placement):
    _, model, optimizer = build_engram_training(
        sizes, LAYER_IDS, method=method, sp=sp, seed=3, load=root,
        engram_table_placement=placement, **overrides)
    return model, optimizer


def train(model, optimizer, steps, lookahead=False):
    """``lookahead``: each step names the next step's batches (the overlapped host update
    changes the rows they read first)."""
    losses, norms = [], []
    for step in steps:
        result = train_step(model, optimizer, batches_of_step(step), SEQ, MICRO_BATCH,
                            next_microbatches=batches_of_step(step + 1) if lookahead else None)
        losses.append(result.lm_loss)
        norms.append(result.grad_norm)
    return losses, norms


def snapshot(model, optimizer):
    """Tables and moments (first; the row moment of rowwise_adam too), reassembled to full
    tables (every rank), once the update in flight is done."""
    engram = table_optimizer(optimizer)
    engram.finish_update()
    tables = reassemble(model, lambda p: p)
    states = {id(p): engram.optimizer.state[m]
              for p, m in zip(engram.model_params, engram.main_params)}
    moments = reassemble(model, lambda p: states[id(p)]["exp_avg"])
    if "exp_avg_sq_row" in next(iter(states.values()), {}):
        rows = reassemble(model, lambda p: states[id(p)]["exp_avg_sq_row"].view(-1, 1))
        moments.update({-1 - k: v for k, v in rows.items()})
    return tables, moments


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


def resume_across(root, ckpt_root, first, second, overrides=None):
    """2 steps with placement ``first``, checkpoint, 2 more with ``second``."""
    overrides = overrides or {}
    model, optimizer = setup(root, "alltoall", RESUME_SIZES, False, overrides, first)
    losses, _ = train(model, optimizer, range(2))
    save_checkpoint(ckpt_root, 2, model, optimizer)
    model, optimizer = setup(root, "alltoall", RESUME_SIZES, False, overrides, second)
    load_checkpoint(ckpt_root, model, optimizer)
    more, _ = train(model, optimizer, range(2, STEPS))
    tables, moments = snapshot(model, optimizer)
    return losses + more, tables, moments


def overlap_against_sync(root):
    """20 steps of the 4-byte configuration on host tables, overlapped and synchronous."""
    out = {}
    for overlap in (True, False):
        model, optimizer = setup(root, "alltoall", RESUME_SIZES, False,
                                 dict(FOUR_BYTE, engram_overlap_host_update=overlap), "host")
        HOST_TABLE_TIMES.reset()
        losses, norms = train(model, optimizer, range(OVERLAP_STEPS), lookahead=overlap)
        tables, moments = snapshot(model, optimizer)
        out[overlap] = dict(losses=losses, norms=norms, tables=tables, moments=moments,
                            overlapped=table_optimizer(optimizer).overlap,
                            update_s=HOST_TABLE_TIMES.update_s, wait_s=HOST_TABLE_TIMES.wait_s)
    return dict(
        losses=out[True]["losses"], sync_losses=out[False]["losses"],
        norms_equal=out[True]["norms"] == out[False]["norms"],
        tables_bitwise=bitwise(out[True]["tables"], out[False]["tables"]),
        moments_bitwise=bitwise(out[True]["moments"], out[False]["moments"]),
        overlapped=[out[True]["overlapped"], out[False]["overlapped"]],
        update_s=out[True]["update_s"], wait_s=out[True]["wait_s"],
        sync_update_s=out[False]["update_s"], sync_wait_s=out[False]["wait_s"],
    )


def reshard_four_byte(root, ckpt_root):
    """The 4-byte checkpoint of ``resume_across`` (saved under eps 2) loads under eps 1: the
    tables and both moments equal the saved ones."""
    model, optimizer = setup(root, "alltoall", RESUME_SIZES, False, FOUR_BYTE, "host")
    load_checkpoint(ckpt_root, model, optimizer)
    saved = snapshot(model, optimizer)
    model, optimizer = setup(root, "alltoall", ParallelSizes(), False, FOUR_BYTE, "host")
    load_checkpoint(ckpt_root, model, optimizer)
    loaded = snapshot(model, optimizer)
    return dict(tables_bitwise=bitwise(saved[0], loaded[0]),
                moments_bitwise=bitwise(saved[1], loaded[1]),
                row_moment_saved=any(k < 0 for k in saved[1]))


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
    losses, got_tables, got_moments = resume_across(
        base_root / "init", base_root / "four_byte", "device", "host", FOUR_BYTE)
    model, optimizer = setup(base_root / "init", "alltoall", RESUME_SIZES, False, FOUR_BYTE,
                             "device")
    straight, _ = train(model, optimizer, range(STEPS))
    tables, moments = snapshot(model, optimizer)
    result["resume_four_byte"] = dict(
        losses=losses, straight=straight, tables_bitwise=bitwise(tables, got_tables),
        moments_bitwise=bitwise(moments, got_moments))
    result["reshard_four_byte"] = reshard_four_byte(base_root / "init", base_root / "four_byte")
    result["overlap"] = overlap_against_sync(base_root / "init")
    write_result(args.out, result)


if __name__ == "__main__":
    main()

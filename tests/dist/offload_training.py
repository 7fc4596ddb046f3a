"""Engram optimizer-state offload on 2 processes (alltoall, eps 2), one launch.

- Tiny DeepSeek-V3 Engram model (Engram on layers 1 and 3), the same 5 training steps with
  ``engram_offload_embedding_optimizer_states`` off and on, clip_grad small enough to clip
  every step, for ``sparse_adam`` and for dense ``adam``: losses, grad norms and the
  reassembled tables are recorded for both.
- With offload on: where the table states live (host masters and moments, distinct from the
  tables; nothing of the tables in megatron's optimizer).
- Checkpoints: the offload run saves model + optimizer after its 5 steps; a fresh model with
  offload on and one with offload off load it (tables, moments, masters, next loss). The run
  without offload also saves, and a fresh offload run loads that.
- bf16 table (module level, standalone ``EngramTableOptimizer.step``): offload on vs off after
  3 clipped steps of row-sparse gradients (a few rows per step), for both table optimizers.
"""

import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).parent))

import torch
import torch.distributed as dist
from common import forget_graphs
from common import parse_args, write_result
from embedding_parallel_training import (
    STEPS,
    max_diff,
    moments,
    reassemble,
    setup,
    table_optimizer,
    train,
)

from engram_train.runtime import ParallelSizes, initialize_distributed

from megatron.core import parallel_state
from megatron.core.optimizer import OptimizerConfig

from engram_train.checkpoint import load_checkpoint, save_checkpoint
from engram_train.parallel import groups
from engram_train.models.table_params import engram_table_params
from engram_train.training.engram_optimizer import EngramTableOptimizer, engram_table_param_group

LAYOUT = ParallelSizes(engram_embedding=2)
CLIP = 0.05  # setup()'s clip_grad


def offload_setup(offload: bool, seed: int = 1, table_optimizer: str = "sparse_adam"):
    return setup(LAYOUT, seed=seed, engram_offload_embedding_optimizer_states=offload,
                 engram_optimizer=table_optimizer)


def masters(model, optimizer):
    opt = table_optimizer(optimizer)
    by_param = {id(p): main for p, main in zip(opt.model_params, opt.main_params)}
    return reassemble(model, lambda p: by_param[id(p)])


def placement(model, optimizer) -> dict:
    opt = table_optimizer(optimizer)
    tables = engram_table_params(model)
    table_ids = {id(p) for p in tables}
    megatron_params, megatron_state_keys = set(), set()
    for other in optimizer.chained_optimizers[:-1]:
        megatron_params |= {id(p) for p in other.get_parameters()}
        megatron_state_keys |= {id(k) for k in other.optimizer.state}
    entries = []
    for param, main, carrier in zip(opt.model_params, opt.main_params, opt.get_parameters()):
        state = opt.optimizer.state[main]
        entries.append(dict(
            main_device=main.device.type,
            main_dtype=str(main.dtype),
            main_is_table=main is param,
            main_shares_storage=main.data_ptr() == param.data_ptr(),
            main_pinned=main.is_pinned(),
            state_devices=[state[k].device.type for k in ("exp_avg", "exp_avg_sq")],
            state_shares_storage=any(state[k].data_ptr() in (param.data_ptr(), main.data_ptr())
                                     for k in ("exp_avg", "exp_avg_sq")),
            carrier_on_table_device=carrier.device == param.device,
            carrier_stride=list(carrier.stride()),
            carrier_grad_rows=carrier.grad.shape[0] if carrier.grad is not None else None,
            table_rows=param.shape[0],
        ))
    return dict(
        offload=opt.offload,
        num_tables=len(tables),
        table_optimizer_params=[id(p) for p in opt.model_params] == [id(p) for p in tables],
        tables_in_megatron_optimizer=len(table_ids & megatron_params),
        tables_in_megatron_state=len(table_ids & megatron_state_keys),
        masters_in_megatron_state=len({id(m) for m in opt.main_params} & megatron_state_keys),
        entries=entries,
        cuda=torch.cuda.is_available(),
    )


def restored(model, optimizer, saved) -> dict:
    now = moments(model, optimizer)
    opt = table_optimizer(optimizer)
    entry = dict(
        offload=opt.offload,
        num_steps=opt.num_steps,
        table_max_diff=max_diff(reassemble(model, lambda p: p), saved["tables"]),
        exp_avg_max_diff=max_diff(now["exp_avg"], saved["moments"]["exp_avg"]),
        exp_avg_sq_max_diff=max_diff(now["exp_avg_sq"], saved["moments"]["exp_avg_sq"]),
    )
    if opt.offload:
        entry["master_max_diff"] = max_diff(masters(model, optimizer), saved["tables"])
    entry["next_loss"] = train(model, optimizer, 1)[0][0]
    return entry


def check_dense_adam(result):
    """Dense adam with offload on and off: same losses, norms and tables."""
    tables = {}
    for name, offload in (("off_adam", False), ("on_adam", True)):
        _, model, optimizer = offload_setup(offload, table_optimizer="adam")
        losses, norms = train(model, optimizer, STEPS)
        result[name] = dict(losses=losses, grad_norms=norms)
        tables[name] = reassemble(model, lambda p: p)
    result["adam_table_max_diff"] = max_diff(tables["off_adam"], tables["on_adam"])


def check_training(result, root: Path):
    saved = {}
    for name, offload in (("off", False), ("on", True)):
        _, model, optimizer = offload_setup(offload)
        initial = reassemble(model, lambda p: p)
        losses, norms = train(model, optimizer, STEPS)
        entry = dict(losses=losses, grad_norms=norms, initial=initial)
        entry["tables"] = reassemble(model, lambda p: p)
        if offload:
            entry["placement"] = placement(model, optimizer)
            entry["master_max_diff"] = max_diff(masters(model, optimizer), entry["tables"])
        save_checkpoint(root / name, STEPS, model, optimizer)
        saved[name] = dict(tables=entry["tables"], moments=moments(model, optimizer))
        entry["next_loss"] = train(model, optimizer, 1)[0][0]
        result[name] = entry
    off, on = result["off"], result["on"]
    result["initial_max_diff"] = max_diff(off.pop("initial"), on.pop("initial"))
    result["table_max_diff"] = max_diff(off.pop("tables"), on.pop("tables"))
    result["tables_bitwise"] = result["table_max_diff"] == 0.0
    result["moment_max_diff"] = max(
        max_diff(saved["off"]["moments"][k], saved["on"]["moments"][k])
        for k in ("exp_avg", "exp_avg_sq")
    )

    for name, source, offload in (("resume_on_from_on", "on", True),
                                  ("resume_off_from_on", "on", False),
                                  ("resume_on_from_off", "off", True)):
        _, model, optimizer = offload_setup(offload, seed=77)
        iteration, _ = load_checkpoint(root / source, model, optimizer)
        result[name] = dict(restored(model, optimizer, saved[source]), iteration=iteration)


def check_bf16(result):
    """A bf16 table shard with row-sparse gradients (a few rows per micro-batch), stepped 3
    times with clipping, offload on and off, for both table optimizers."""
    from engram_train.engram.row_grad import gather_rows

    parallel_state.destroy_model_parallel()
    forget_graphs()  # the previous layout's model can be freed
    initialize_distributed(LAYOUT, seed=5)
    rank = dist.get_rank()
    model_config = SimpleNamespace(engram_lr_multiplier=5.0, engram_weight_decay=0.1)
    opt_config = OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=0.05, bf16=True,
                                 weight_decay=0.1)
    result["bf16"] = {}
    for table_optimizer in ("sparse_adam", "adam"):
        runs = {}
        for offload in (False, True):
            g = torch.Generator().manual_seed(100 + rank)
            table = torch.nn.Parameter((torch.randn(24, 8, generator=g) * 0.02).bfloat16())
            initial = table.detach().clone()
            optimizer = EngramTableOptimizer(
                opt_config, [table], engram_table_param_group(opt_config, model_config),
                groups.get_engram_data_parallel_group(), groups.get_engram_model_parallel_group(),
                offload_states=offload, table_optimizer=table_optimizer,
            )
            norms, touched = [], set()
            for _ in range(3):
                optimizer.zero_grad()
                for _ in range(2):  # two micro-batches accumulate in float32 rows
                    rows = torch.randint(0, 24, (6,), generator=g)
                    touched.update(rows.tolist())
                    weight = torch.randn(6, 8, generator=g)
                    (gather_rows(table, rows).float() * weight).sum().backward()
                _, norm, _ = optimizer.step()
                norms.append(norm)
            main = optimizer.main_params[0]
            state = optimizer.optimizer.state[main]
            runs[offload] = dict(table=table.detach().clone(), main=main.detach().clone(),
                                 exp_avg=state["exp_avg"].clone(), norms=norms,
                                 moved=(table.float() - initial.float()).abs().max().item())
            if offload:
                carrier = optimizer.get_parameters()[0]
                result["bf16_carrier"] = dict(
                    stride=list(carrier.stride()), dtype=str(carrier.dtype),
                    shape=list(carrier.shape), device=carrier.device.type,
                    main_device=main.device.type, main_is_table=main is table,
                    table_equals_main=bool(torch.equal(table.data, main.data.bfloat16())),
                )
        off, on = runs[False], runs[True]
        result["bf16"][table_optimizer] = dict(
            norms_off=off["norms"], norms_on=on["norms"],
            table_bitwise=bool(torch.equal(off["table"], on["table"])),
            main_bitwise=bool(torch.equal(off["main"], on["main"])),
            exp_avg_bitwise=bool(torch.equal(off["exp_avg"], on["exp_avg"])),
            moved=on["moved"],
        )


def main():
    args = parse_args()
    result = dict(clip=CLIP)
    parallel_state.destroy_model_parallel()
    forget_graphs()  # the previous layout's model can be freed
    initialize_distributed(LAYOUT, seed=1)
    holder = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    check_training(result, Path(holder[0]))
    check_dense_adam(result)
    check_bf16(result)
    result["eps"] = groups.get_engram_embedding_parallel_world_size()
    write_result(args.out, result)


if __name__ == "__main__":
    main()

"""GPU check of the Engram optimizer-state offload (a CUDA machine, well under 2 minutes).

    python benchmarks/gpu_offload_check.py                          # 1 GPU (eps 1)
    torchrun --nproc-per-node=2 benchmarks/gpu_offload_check.py     # 2 GPUs (eps 2)

What the CPU tests cannot see:

1. Placement (module level, float32 and bf16 table shards of 256Ki x 64 on the GPU): with
   offload the masters, the host grad buffers and the bf16 upload staging are pinned host
   tensors, the Adam moments are host tensors, the grad carriers clipping sees are CUDA float32
   tensors, the tables stay on the GPU, and building + stepping the optimizer adds (almost) no
   GPU memory beyond the float32 gradients; without offload it adds at least the moments.
2. Equality (same tables, same synthetic gradients, 5 clipped steps): offload vs no offload.
   The host Adam is not guaranteed to give the CUDA kernels' bits (fused multiply-adds may
   round differently), so masters/moments must agree to 1e-6 and bf16 tables to one bf16 ulp;
   whether they are bitwise equal is printed.
3. The tiny Engram model (tests/dist helpers, Engram on layers 1 and 3, alltoall eps = world,
   clip_grad 0.05): 5 training steps with and without offload, losses within 1e-5 relative,
   reassembled tables within 1e-6; step times printed.
4. Host-resident tables (``engram_table_placement: host``, docs/host-tables.md), same model at
   the default tables and at tables of 2M rows per head: the tables stay in (pinned) host
   memory, the GPU memory the run allocates does not grow with the tables (within 64 MiB),
   losses match ``device`` placement within 1e-5 relative; step times of both placements at
   both sizes printed (the overhead of host placement).

Exits non-zero on the first failed check; prints one JSON line per rank at the end.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "dist"))

from megatron.core import parallel_state  # noqa: E402
from megatron.core.optimizer import OptimizerConfig  # noqa: E402

from engram_train.parallel import groups  # noqa: E402
from engram_train.runtime import ParallelSizes, initialize_distributed  # noqa: E402
from engram_train.training.engram_optimizer import (  # noqa: E402
    EngramTableOptimizer,
    engram_table_param_group,
)

ROWS, DIM, STEPS = 256 * 1024, 64, 5
MIB = 2**20


def check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(f"rank {dist.get_rank()}: {message}")


def table_optimizer_run(dtype: torch.dtype, offload: bool, out: dict) -> dict:
    """Build tables + optimizer, 5 clipped steps on fixed synthetic gradients."""
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator().manual_seed(1000 + rank)
    tables = [
        torch.nn.Parameter((torch.randn(ROWS, DIM, generator=g) * 0.02).to(device, dtype))
        for _ in range(2)
    ]
    model_config = SimpleNamespace(engram_lr_multiplier=5.0, engram_weight_decay=0.0)
    opt_config = OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=0.05,
                                 bf16=dtype == torch.bfloat16)
    weights = [torch.randn(ROWS, DIM, generator=g).to(device) for _ in range(STEPS)]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    optimizer = EngramTableOptimizer(
        opt_config, tables, engram_table_param_group(opt_config, model_config),
        groups.get_engram_data_parallel_group(), groups.get_engram_model_parallel_group(),
        offload_states=offload, table_optimizer=model_config.engram_optimizer,
    )
    norms = []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = sum((t.float() * weights[step]).sum() for t in tables)
        loss.backward()
        _, norm, _ = optimizer.step()
        norms.append(norm)
    torch.cuda.synchronize()
    # Gradients are allocated by the first backward in both modes: float32 .grad / main_grad.
    grad_bytes = sum(t.numel() * 4 for t in tables)
    growth = torch.cuda.memory_allocated() - before - grad_bytes
    if offload:
        check(optimizer.offload, "optimizer not in offload mode")
        for table, main, host_grad, staged, carrier in zip(
            tables, optimizer.main_params, optimizer._host_grads, optimizer._upload_buffers,
            optimizer.get_parameters(),
        ):
            state = optimizer.optimizer.state[main]
            check(table.is_cuda, "table left the GPU")
            check(main.device.type == "cpu" and main.dtype == torch.float32, "master not host fp32")
            check(main.is_pinned() and host_grad.is_pinned() and staged.is_pinned(),
                  "host master / grad buffer / staging not pinned")
            check(all(state[k].device.type == "cpu" for k in ("exp_avg", "exp_avg_sq")),
                  "Adam moments not on the host")
            check(carrier.is_cuda and carrier.grad is not None and carrier.grad.is_cuda
                  and carrier.grad.dtype == torch.float32, "grad carrier not a CUDA fp32 .grad")
            check(torch.equal(table.detach(), main.detach().to(device, dtype)),
                  "table is not its master cast to the table dtype")
        # _scale, the 1-element carriers, norm scratch: well under 1 MiB
        check(growth < MIB, f"offload grew GPU memory by {growth / MIB:.2f} MiB")
    else:
        moments_bytes = 2 * 2 * ROWS * DIM * 4
        check(growth >= moments_bytes, f"no-offload growth {growth} < moments {moments_bytes}")
    name = f"{str(dtype).removeprefix('torch.')}_{'on' if offload else 'off'}"
    out[f"{name}_gpu_growth_mib"] = round(growth / MIB, 3)
    return dict(
        norms=norms,
        tables=[t.detach().clone() for t in tables],
        mains=[m.detach().float().cpu() for m in optimizer.main_params],
        exp_avg=[optimizer.optimizer.state[m]["exp_avg"].cpu() for m in optimizer.main_params],
        exp_avg_sq=[optimizer.optimizer.state[m]["exp_avg_sq"].cpu()
                    for m in optimizer.main_params],
    )


def max_abs(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x.float().cpu() - y.float().cpu()).abs().max().item() for x, y in zip(a, b))


def check_module(out: dict) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        off = table_optimizer_run(dtype, False, out)
        on = table_optimizer_run(dtype, True, out)
        name = str(dtype).removeprefix("torch.")
        diffs = {k: max_abs(off[k], on[k]) for k in ("mains", "exp_avg", "exp_avg_sq", "tables")}
        out[f"{name}_max_abs_diff"] = diffs
        out[f"{name}_bitwise"] = all(v == 0.0 for v in diffs.values())
        same_norms = all(abs(a - b) <= 1e-6 * max(1.0, abs(a))
                         for a, b in zip(off["norms"], on["norms"]))
        check(same_norms, f"{name}: grad norms differ {off['norms']} vs {on['norms']}")
        check(off["norms"][0] > 0.05, f"{name}: clip_grad did not clip")
        for key in ("mains", "exp_avg", "exp_avg_sq"):
            check(diffs[key] <= 1e-6, f"{name}: {key} differ by {diffs[key]}")
        for a, b in zip(off["tables"], on["tables"]):  # one bf16 ulp (or fp32 1e-6)
            tol = a.float().abs() * (2**-7 if dtype == torch.bfloat16 else 0) + 1e-6
            check(bool(((a.float() - b.float()).abs() <= tol).all()), f"{name}: tables differ")


def timed_steps(model, optimizer) -> tuple[list, list[float]]:
    """One warm-up step, then STEPS timed training steps: (losses, seconds per step)."""
    from embedding_parallel_training import train

    train(model, optimizer, 1)
    times, losses = [], []
    for _ in range(STEPS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step_losses, _ = train(model, optimizer, 1)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(step_losses[0])
    return losses, times


def check_model(out: dict) -> None:
    from embedding_parallel_training import max_diff, reassemble, setup

    world = dist.get_world_size()
    layout = ParallelSizes(engram_embedding=world)
    runs = {}
    for offload in (False, True):
        _, model, optimizer = setup(layout, seed=1,
                                    engram_offload_embedding_optimizer_states=offload)
        losses, times = timed_steps(model, optimizer)
        runs[offload] = dict(losses=losses, tables=reassemble(model, lambda p: p),
                             step_ms=1000 * statistics.median(times))
        for p in runs[offload]["tables"].values():
            check(torch.isfinite(p).all().item(), "non-finite table")
    off, on = runs[False], runs[True]
    out["model_losses_off"], out["model_losses_on"] = off["losses"], on["losses"]
    out["model_step_ms_off"], out["model_step_ms_on"] = off["step_ms"], on["step_ms"]
    out["model_table_max_diff"] = max_diff(off["tables"], on["tables"])
    if off["losses"][0] is not None:  # last pipeline stage reports losses (PP 1 here: all)
        for a, b in zip(off["losses"], on["losses"]):
            check(abs(a - b) <= 1e-5 * abs(a), f"model losses differ: {a} vs {b}")
    check(out["model_table_max_diff"] <= 1e-6,
          f"model tables differ by {out['model_table_max_diff']}")


def check_host_placement(out: dict) -> None:
    from embedding_parallel_training import setup

    world = dist.get_world_size()
    layout = ParallelSizes(engram_embedding=world)
    runs = {}
    for size in ("default", "large"):
        extra = {} if size == "default" else dict(engram_vocab_size=[2_000_003, 2_000_029])
        for placement in ("device", "host"):
            parallel_state.destroy_model_parallel()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            _, model, optimizer = setup(layout, seed=1, engram_table_placement=placement, **extra)
            losses, times = timed_steps(model, optimizer)
            tables = [p for p in model[0].parameters() if getattr(p, "is_engram_table", False)]
            if placement == "host":
                check(all(t.device.type == "cpu" and t.is_pinned() for t in tables),
                      "host tables are not in pinned host memory")
            runs[size, placement] = dict(
                losses=losses, step_ms=1000 * statistics.median(times),
                peak_mib=(torch.cuda.max_memory_allocated() - base) / MIB)
            del model, optimizer
    for size in ("default", "large"):
        device, host = runs[size, "device"], runs[size, "host"]
        out[f"host_{size}"] = dict(step_ms_device=device["step_ms"], step_ms_host=host["step_ms"],
                                   peak_mib_device=device["peak_mib"],
                                   peak_mib_host=host["peak_mib"])
        if device["losses"][0] is not None:
            for a, b in zip(device["losses"], host["losses"]):
                check(abs(a - b) <= 1e-5 * abs(a), f"{size}: host vs device losses {a} vs {b}")
    growth = runs["large", "host"]["peak_mib"] - runs["default", "host"]["peak_mib"]
    out["host_gpu_growth_mib"] = growth
    check(growth <= 64, f"host placement: GPU memory grew {growth:.0f} MiB with the tables")


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("gpu_offload_check.py needs CUDA (tests/test_offload.py covers the CPU path)")
    started = time.perf_counter()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    initialize_distributed(ParallelSizes(engram_embedding=world), seed=1)
    out: dict = dict(world=world, device=torch.cuda.get_device_name())
    check_module(out)
    parallel_state.destroy_model_parallel()
    check_model(out)
    check_host_placement(out)
    out["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(dict(rank=dist.get_rank(), ok=True, **out)), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

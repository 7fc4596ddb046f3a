"""The fixed bytes of a rank: what a process costs before it holds any of the model.

CPU (device and host are one memory): a trainer process that has imported torch, megatron-core
and the trainer's modules, checked its config, loaded the tokenizer and built its process
groups. Measured, not guessed: ``tests/dist/memory_calibration.py --baseline`` prints it (peak
RSS), and the calibration test measures it again on the lane it runs on; the value here is
that measurement for torch 2.13 (CPU) and megatron-core 0.16.1 / 0.19.2 on Linux (400-410 MB
on both lanes, the same for 1 and 2 ranks). ``--cpu-baseline`` replaces it.

GPU: assumptions, stated rather than measured here (the GPU check compares the plan with
``torch.cuda.max_memory_allocated``, which excludes the first two):

- device: the CUDA context and kernels (~0.6 GiB), NCCL's communicator buffers (~0.25 GiB per
  communicator, a handful per rank: ~1 GiB), and the caching allocator's fragmentation, taken
  as 10% of what the plan allocates;
- host: a CUDA process (torch + CUDA libraries + megatron) ~3 GiB, plus the pinned and
  pageable copies that a checkpoint save makes of the rank's state (report.py).
"""

from __future__ import annotations

MIB, GIB = 1 << 20, 1 << 30

CPU_PROCESS_BYTES = 402 * MIB  # measured: memory_calibration.py --baseline (peak RSS)
CUDA_CONTEXT_BYTES = int(0.6 * GIB)
NCCL_BUFFER_BYTES = 1 * GIB
ALLOCATOR_FRAGMENTATION = 0.10
CUDA_HOST_PROCESS_BYTES = 3 * GIB


# What torch.cuda.max_memory_allocated does not see (benchmarks/gpu_check.py compares the rest).
NOT_ALLOCATED = ("cuda_context", "nccl_buffers", "allocator_fragmentation")


def device_fixed_items(device: str, allocated: int) -> list[tuple[str, int]]:
    """Fixed device items for ``allocated`` planned bytes (none on the CPU: see host)."""
    if device == "cpu":
        return []
    return [("cuda_context", CUDA_CONTEXT_BYTES), ("nccl_buffers", NCCL_BUFFER_BYTES),
            ("allocator_fragmentation", int(ALLOCATOR_FRAGMENTATION * allocated))]


def host_fixed_items(device: str, cpu_baseline: int | None) -> list[tuple[str, int]]:
    if device == "cpu":
        return [("process_baseline", cpu_baseline if cpu_baseline is not None else CPU_PROCESS_BYTES)]
    return [("process_baseline", CUDA_HOST_PROCESS_BYTES)]


# CPU runs: what torch's CPU backend keeps beyond the tensors (measured on deepseek_v3_tiny with
# an RSS probe around every module's forward and backward, benchmarks/measure_memory_plan.py
# --set calibration; docs/memory.md 'What the plan missed').
CPU_BF16_MOE_KERNEL_CACHE_BYTES = 640 * MIB
"""bf16 matmuls on the CPU run through oneDNN, which keeps a primitive with its JIT-compiled
kernels for every problem shape it has seen (up to ONEDNN_PRIMITIVE_CACHE_CAPACITY, 1024, and
its kernel caches). An MoE's experts see another token count in every micro-batch, so a bf16
MoE run makes new shapes until the caches are full: +570 MiB at hidden 64, about +650 MiB at
hidden 512 (deepseek_v3_tiny: 4 experts, 3 MoE layers), flat after 20-28 micro-batches (0.29
GiB of it goes with ONEDNN_PRIMITIVE_CACHE_CAPACITY=0). A dense bf16 model (fixed shapes) and
fp32 (no oneDNN matmul) add nothing."""
CPU_KERNEL_CACHE_FILL_EXPERT_BATCHES = 240
"""Expert batches (micro-batches x the rank's experts x MoE layers) that fill it: every
expert batch of a token count not seen before is a new shape; measured full after 20
micro-batches of 4 experts on 3 MoE layers. Early batches bring the most new counts, so a run
(or a rank) with fewer batches holds the square root of their share (measured: a third after
48 batches, 0.6 after 96 on one MoE layer, 0.9 after 192; a linear share undercounted a PP2
stage of one MoE layer by 22%)."""
CPU_HEAP_TOP_BYTES = 64 * MIB
"""glibc malloc raises its mmap threshold to the size of a freed block (up to 32 MiB), so
activation tensors come from the heap, and keeps up to its trim threshold (twice that: 64 MiB)
of freed heap resident: a CPU run's RSS stays up to 64 MiB above its live tensors (measured
+120 MiB at 1024 tokens per micro-batch against a fixed mmap threshold, the rest holes in the
heap)."""


def cpu_runtime_items(device: str, precision: str, expert_batches: int | None,
                      moe_on_stage: bool) -> list[tuple[str, int]]:
    """What the CPU backend keeps beyond the planned tensors (none on the GPU);
    ``expert_batches``: of the whole run on this rank (None: a long run)."""
    if device != "cpu":
        return []
    items = [("cpu_heap_top", CPU_HEAP_TOP_BYTES)]
    if precision in ("bf16", "fp16") and moe_on_stage:
        fill = CPU_KERNEL_CACHE_FILL_EXPERT_BATCHES
        share = min(1.0, (expert_batches if expert_batches is not None else fill) / fill) ** 0.5
        items.append(("cpu_bf16_moe_kernel_cache", int(CPU_BF16_MOE_KERNEL_CACHE_BYTES * share)))
    return items

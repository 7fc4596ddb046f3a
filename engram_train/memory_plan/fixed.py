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

import math

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
CPU_BF16_MOE_KERNEL_CACHE_BYTES = 860 * MIB
"""bf16 matmuls on the CPU run through oneDNN's brgemm matmul, which JIT-compiles kernels for
every problem shape it meets and keeps them: measured 2.0 MiB of RSS per new row count of one
bf16 linear (forward, input gradient, weight gradient), 1.3 MiB with the primitive cache off
(ONEDNN_PRIMITIVE_CACHE_CAPACITY=0), so the primitive cache's capacity does not bound it; a
repeated shape adds nothing, and fp32 (no oneDNN matmul) 0.04 MiB. An MoE's experts get
another token count in almost every micro-batch, so a bf16 MoE run makes new shapes for as
long as routing draws counts it has not drawn before. The asymptote and the rate
(`CPU_KERNEL_CACHE_FILL_EXPERT_BATCHES`) are the least-squares fit of a * (1 - exp(-n / n0))
to 21 fills measured on ranks of 48 to 768 expert batches (deepseek_v3_tiny and wider: hidden
64-192, 256-2048 tokens per micro-batch, 1-3 MoE layers per rank); they scatter by up to
120 MiB around it (fewer tokens per micro-batch draw fewer distinct counts: 734 MiB after 768
batches at 256 tokens, 923 at 1024). Runs longer than 768 batches were not measured. A dense
bf16 model (fixed shapes) and fp32 add nothing."""
CPU_KERNEL_CACHE_FILL_EXPERT_BATCHES = 200
"""The fill's scale n0, in expert batches (micro-batches x the rank's experts x MoE layers):
1 - exp(-n / 200) of the asymptote after n batches (0.21 after one step of the default run's
48, 0.70 after 240, 0.98 after 768). Early batches bring the most new token counts."""
CPU_KERNEL_CACHE_FULL_TOKENS = 512
"""Tokens per micro-batch from which the asymptote holds: fewer tokens spread the experts'
counts over fewer values, so fewer distinct counts are drawn. Measured after 768 expert
batches: 734 MiB at 256 tokens, 886-923 at 512-2048 (0.83 of it); the plan scales the
asymptote by (tokens / 512) ** 0.25 below 512 (0.84 at 256; runs below 256 tokens per
micro-batch were not measured)."""


def cpu_runtime_items(device: str, precision: str, expert_batches: int | None,
                      moe_on_stage: bool, tokens_per_micro_batch: int | None = None) -> list[tuple[str, int]]:
    """What the CPU backend keeps beyond the planned tensors (none on the GPU; glibc's heap
    holes, which follow the step's activations, are cpu_heap.py's); ``expert_batches``: of
    the whole run on this rank (None: a long run)."""
    if device != "cpu":
        return []
    items = []
    if precision in ("bf16", "fp16") and moe_on_stage:
        share = 1.0 if expert_batches is None else -math.expm1(-expert_batches / CPU_KERNEL_CACHE_FILL_EXPERT_BATCHES)
        if tokens_per_micro_batch is not None and tokens_per_micro_batch < CPU_KERNEL_CACHE_FULL_TOKENS:
            share *= (tokens_per_micro_batch / CPU_KERNEL_CACHE_FULL_TOKENS) ** 0.25
        items.append(("cpu_bf16_moe_kernel_cache", int(CPU_BF16_MOE_KERNEL_CACHE_BYTES * share)))
    return items

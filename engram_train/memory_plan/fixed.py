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

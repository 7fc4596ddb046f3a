"""glibc's heap on CPU runs: the holes a training step leaves in it.

torch's CPU tensors come from glibc malloc. glibc serves a block below its mmap threshold from
the heap and raises that threshold to the size of every mmapped block freed, up to
``GLIBC_MMAP_THRESHOLD_MAX`` (32 MiB on 64-bit Linux). After the first step, then, every
activation smaller than the step's largest freed tensor (and below 32 MiB) lives in the heap,
and a freed heap block stays resident unless it borders the heap's top. A step that saves
activations above temporaries of other sizes leaves holes below them that the next tensors
do not fit, and the heap grows past the live bytes: measured per event of a step (mallinfo2
around every module's forward and backward), 757 MiB of heap for 490 live at hidden 384 and
sequence 768, against 830 MiB peak RSS with a fixed 64 KiB threshold (every block back to
the kernel at free) and 1181-1204 with glibc's default.

Tensors of 32 MiB and more are always mmapped and returned at free, so they leave no holes:
the CPU attention's float32 scores ``[b, heads, s, s]`` from 32 MiB (2 x 4 x 1024 x 1024 x 4
bytes), or the float32 logits of a large vocabulary. The plan counts the holes as
``CPU_HEAP_HOLE_FRACTION`` of a step's activation bytes held in tensors below the threshold,
reached over the run's first forward-backward passes (``CPU_HEAP_FILL_PASSES``): the heap of
that run measured 494, 602 and 757 MiB after passes 1, 2 and about 9, and 720-908 MiB over
passes 13-48.

Changing the allocator instead was measured and rejected: a fixed mmap threshold (64 KiB to
8 MiB) gives back the holes but costs 31-70% of the step time on the CPU (every large block
faulted in and zeroed again at each allocation); trimming the heap between steps
(``malloc_trim``) leaves the peak inside a step where it was.
"""

from __future__ import annotations

import math

MIB = 1 << 20

GLIBC_MMAP_THRESHOLD_MAX = 32 * MIB
"""glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: the dynamic threshold never rises above it, so
a block of this size or more is mmapped."""

CPU_HEAP_HOLE_FRACTION = 0.4
"""Heap holes at the step's peak, per byte of the step's heap-placed activations. The fraction
that minimises the largest |log(predicted / measured)| of the plan's peak RSS over the
held-out sets 1-3 and the kernel-cache fill runs of benchmarks/measure_memory_plan.py (34
configurations, 45 ranks: 0.874-1.147 of the measured peaks, against 0.840-1.156 with a flat
64 MiB). It is net of what the activation items count beyond the live bytes: measured apart
with a fixed mmap threshold, the holes were 0.26-1.46 of the heap-placed activations (2.5-3.9
on a run whose activations are 13-19 MiB) and the items 0-236 MiB above the live peak;
identical ranks of one run differ by up to 77 MiB in their holes. ``--set held_out_4`` (8
configurations, 11 ranks) was measured after it was set: 0.892-1.023."""

CPU_HEAP_FILL_PASSES = 4
"""The holes after n forward-backward passes (micro-batches x steps): 1 - exp(-n / 4) of
their full size (0.39 after the 2 passes of the calibration runs of tests/test_memory_plan.py,
0.95 after the 12 of a 3-step run of 4 micro-batches). Fitted after the fraction, with it
fixed, to every measured set and the calibration runs (49 configurations, 66 ranks:
0.874-1.142 of the measured peaks); without it the 2-pass calibration runs read up to 1.20."""


def heap_placed(step_items: dict[str, int], tensor_bytes: dict[str, int]) -> int:
    """Bytes of the step's activation items whose tensors glibc places in the heap:
    ``tensor_bytes`` gives the size of one tensor of the items made of large single tensors
    (attention scores, logits); every other item is made of tensors far below the threshold."""
    return sum(b for name, b in step_items.items()
               if tensor_bytes.get(name, 0) < GLIBC_MMAP_THRESHOLD_MAX)


def heap_hole_bytes(step_items: dict[str, int], tensor_bytes: dict[str, int], passes: int | None,
                    fraction: float = CPU_HEAP_HOLE_FRACTION) -> int:
    """The holes after ``passes`` forward-backward passes of the rank (None: a long run);
    ``fraction`` is the model family's (DeepSeek-V4.1 has its own, ``v41_plan``)."""
    share = 1.0 if passes is None else -math.expm1(-passes / CPU_HEAP_FILL_PASSES)
    return int(fraction * share * heap_placed(step_items, tensor_bytes))

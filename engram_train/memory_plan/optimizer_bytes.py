"""megatron's Adam state for the dense and expert parameters of one rank.

Adam keeps two float32 moments per parameter; with bf16 weights megatron adds a float32 main
copy (with fp32 weights the main parameters are the weights). The distributed optimizer
shards all of it over the data-parallel group (dense parameters over DP x CP, expert ones over
the expert data-parallel group); without it every rank holds the whole of its parameters'.
The step itself runs parameter by parameter on the CPU (torch's single-tensor Adam) and
allocates about one parameter shard's worth of temporaries.
"""

from __future__ import annotations

from engram_train.memory_plan.plan_layout import Layout
from engram_train.memory_plan.model_bytes import StageParams


def optimizer_state_bytes(sp: StageParams, layout: Layout, precision: str) -> dict[str, int]:
    per_param = 8 + (4 if precision != "fp32" else 0)
    dense, expert = sp.group("dense") - sp.frozen, sp.group("expert")
    if layout.distributed_optimizer:
        dense = -(-dense // (layout.dp * layout.cp))
        expert = -(-expert // layout.expert_dp)
    out = {"adam_moments": 8 * (dense + expert)}
    if per_param > 8:
        out["fp32_main_params"] = 4 * (dense + expert)
    return out


def optimizer_step_bytes(sp: StageParams) -> int:
    """Temporaries of the step: a few float32 tensors the size of the largest parameter."""
    return 3 * 4 * sp.largest

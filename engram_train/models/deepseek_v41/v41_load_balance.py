"""Auxiliary-loss-free load balancing of DeepSeek-V4.1's router, as DeepSeek-V3 and megatron's
``moe_router_enable_expert_bias`` (arXiv 2408.15664): the float32 ``e_score_correction_bias``
(which picks the experts and never weighs them) is nudged after each optimizer step by
``rate x sign(mean load - load)``: raised for the experts that got fewer routed (token, expert)
pairs than the average in the step, lowered for those that got more.

- `count_loads`: in training, with grad enabled and ``moe_router_bias_update_rate`` > 0, the
  router adds the step's routed pairs per expert into its ``local_tokens_per_expert`` buffer
  (padding tokens not counted; no host read). A recomputed MoE counts its micro-batch twice:
  the sign of every layer's offsets, hence the update, is unchanged.
- `update_expert_bias` (the router's ``after_optimizer_step``, which the trainer calls on every
  rank after the optimizer step): the loads summed over the tensor-, data- and context-parallel
  ranks of the stage (megatron's ``get_tensor_and_data_parallel_group(with_context_parallel=True)``,
  the group megatron's ``get_updated_expert_bias`` reduces over; it holds the expert-parallel
  ranks, so every token of the global batch that reached the layer is counted once), the same
  rule applied on every rank (the bias stays replicated), the counts reset.

Off (rate 0, the default, as NeMo's ``gate_bias_update_factor`` 0): nothing is counted, no
collective runs, the bias never changes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def count_loads(router, indices: torch.Tensor, valid: torch.Tensor | None) -> None:
    """Add ``indices [tokens, k]`` (the routed experts; ``valid [tokens]`` False: a padding
    token, not counted) to ``router.local_tokens_per_expert`` when the router is training."""
    if not (router.bias_update_rate > 0 and router.training and torch.is_grad_enabled()):
        return
    ones = torch.ones(indices.shape, dtype=torch.float32, device=indices.device)
    if valid is not None:
        ones = ones * valid.unsqueeze(-1)
    with torch.no_grad():
        router.local_tokens_per_expert.scatter_add_(0, indices.reshape(-1), ones.reshape(-1))


def load_group():
    """The ranks whose routed tokens one layer's bias sees: megatron's tensor-, data- and
    context-parallel group of the stage (None outside an initialized parallel state)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)


@torch.no_grad()
def update_expert_bias(router, reduce: bool = True) -> None:
    """One step's update of ``router.e_score_correction_bias`` (module docstring); ``reduce``
    False: from this rank's loads alone (a one-process reference)."""
    if not router.bias_update_rate > 0:
        return
    loads = router.local_tokens_per_expert
    group = load_group() if reduce else None
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(loads, group=group)
    offset = loads.sum() / loads.numel() - loads
    router.e_score_correction_bias += torch.sign(offset) * router.bias_update_rate
    loads.zero_()

"""DeepSeek-V4.1's MoE: a router with sqrt-softplus scores, a bias used for the selection only,
no group routing; clamped-SwiGLU routed experts and one shared expert every token takes.

Per token x (``[tokens, hidden]``; any leading dims flatten into tokens)::

    p      = sqrt(softplus(x @ gate.T))              # float32, [experts]
    top    = topk(p + e_score_correction_bias, k)    # the bias picks, it never weighs
    w      = routed_scaling_factor * p[top] / (sum(p[top]) + 1e-20)   # k > 1 and norm_topk_prob
    y      = sum_{e in top} w_e * expert_e(x) + shared(x)
    expert(x) = w2(silu(min(x w1^T, L)) * clamp(x w3^T, -L, L))   # L = swiglu_limit

The SwiGLU runs in float32 and is rounded to the model dtype once before ``w2``; each routed
output (model dtype) is multiplied by its float32 routing weight and the products add up in
float32, each token's in ascending expert order, rounded once before the shared expert's output
is added. (NeMo applies the weight to the SwiGLU before ``w2``, its default; its
``apply_router_weight_after_down`` is the order here: the same function, other roundings. It
keeps the weights out of the expert-parallel exchange.)
Padding tokens (``valid`` False) take the shared expert only. The correction bias is a float32
buffer that stays float32 under ``Float16Module`` (`DeepseekV41Router._apply`), not trained by
gradient: with ``moe_router_bias_update_rate`` > 0 the router counts its experts' loads in
training and ``after_optimizer_step`` nudges the bias by them (``v41_load_balance``).

The routed experts run as one grouped computation (``v41_grouped_experts``): one sort of the
routed pairs by expert, contiguous per-expert slices, one host read of the counts per layer.
Parallelism: routed experts are stacked ``[experts, out, in]`` (``w1``, ``w3``, ``w2`` in
``nn.Linear`` orientation) so expert parallelism splits dim 0; the shared expert is megatron's
column-parallel ``w1``/``w3`` and row-parallel ``w2``. Under expert parallelism (megatron's
expert-model-parallel group) each rank holds ``experts / ep`` of them and an exact all-to-all
dispatch sends each routed pair's row to its expert's rank in the model dtype and the outputs
back (`ExpertParallelDispatch`), the routing weights staying on their tokens' rank. The expert
weights are megatron's expert parameters (``allreduce = False``: DDP reduces them over the
expert data-parallel group) and their checkpoint tensors are sharded on the expert axis.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engram_train.errors import ConfigError, InputError
from engram_train.models.deepseek_v41.v41_attention import parallel_linears
from engram_train.models.deepseek_v41.v41_expert_parallel import (
    ExpertParallelDispatch,
    expert_sharded_state_dict,
)
from engram_train.models.deepseek_v41.v41_grouped_experts import (
    clamped_swiglu,
    combine,
    grouped_swiglu,
    route,
)
from engram_train.models.deepseek_v41.v41_load_balance import count_loads, update_expert_bias


class DeepseekV41Router(nn.Module):
    """Top-k expert choice and weights (module docstring); ``forward(x [tokens, hidden],
    valid [tokens] or None)`` -> ``(weights [tokens, k] float32, indices [tokens, k])``."""

    FLOAT32_BUFFERS = ("e_score_correction_bias", "local_tokens_per_expert")

    def __init__(self, args, device=None, dtype: torch.dtype | None = None):
        super().__init__()
        self.topk, self.scale = args.num_experts_per_tok, float(args.routed_scaling_factor)
        self.normalize = bool(args.norm_topk_prob)
        self.bias_update_rate = float(args.moe_router_bias_update_rate)
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, args.hidden_size,
                                               device=device, dtype=dtype))
        self.register_buffer("e_score_correction_bias",
                             torch.zeros(args.n_routed_experts, device=device,
                                         dtype=torch.float32))
        # routed (token, expert) pairs since the last bias update (training only, not saved)
        self.register_buffer("local_tokens_per_expert",
                             torch.zeros(args.n_routed_experts, device=device,
                                         dtype=torch.float32), persistent=False)

    def _apply(self, fn, recurse=True):
        """A cast (``Float16Module``'s ``bfloat16()``, ``.half()``, ``.to(dtype)``) leaves the
        float32 buffers float32, their values untouched; a move takes them along (as NeMo
        keeps the bias float32; megatron re-casts its expert bias to float32 each forward)."""
        kept = {name: self._buffers[name] for name in self.FLOAT32_BUFFERS}
        super()._apply(fn, recurse)
        for name, before in kept.items():
            after = self._buffers[name]
            if after.dtype != torch.float32:
                self._buffers[name] = before.to(device=after.device)
        return self

    def forward(self, x: torch.Tensor, valid: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.sqrt(F.softplus(F.linear(x.float(), self.weight.float())))
        indices = torch.topk(scores + self.e_score_correction_bias, self.topk, dim=-1)[1]
        weights = scores.gather(1, indices)
        if self.normalize and self.topk > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        count_loads(self, indices, valid)
        return weights * self.scale, indices

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """The auxiliary-loss-free bias update of this step (``v41_load_balance``; nothing at
        ``moe_router_bias_update_rate`` 0). The trainer calls it on every rank after each
        optimizer step."""
        update_expert_bias(self)


class DeepseekV41Experts(nn.Module):
    """The routed experts, stacked: ``w1``/``w3`` ``[experts, inter, hidden]``, ``w2``
    ``[experts, hidden, inter]``, this rank's ``experts / ep`` of them under expert
    parallelism (`ep_group`), run as one grouped computation (``v41_grouped_experts``)."""

    def __init__(self, args, device=None, dtype: torch.dtype | None = None, ep_group=None):
        super().__init__()
        e, i, h = args.n_routed_experts, args.moe_intermediate_size, args.hidden_size
        factory = {"device": device, "dtype": dtype}
        self.limit = float(args.swiglu_limit)
        self.dispatch = ExpertParallelDispatch(ep_group)
        ep = self.dispatch.size
        if e % ep:
            raise ConfigError(f"n_routed_experts={e} must be divisible by "
                              f"expert_model_parallel_size={ep}.")
        self.num_experts, self.num_local = e, e // ep
        self.first = self.dispatch.rank * self.num_local
        self.w1 = nn.Parameter(torch.empty(self.num_local, i, h, **factory))
        self.w3 = nn.Parameter(torch.empty(self.num_local, i, h, **factory))
        self.w2 = nn.Parameter(torch.empty(self.num_local, h, i, **factory))
        if ep > 1:  # megatron's expert parameters: DDP reduces them over expert-DP only
            for param in (self.w1, self.w3, self.w2):
                param.allreduce = False

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """The stacked weights sharded on the expert axis (dim 0) over EP ranks."""
        return expert_sharded_state_dict(self, ("w1", "w3", "w2"), self.dispatch, prefix,
                                         sharded_offsets)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                valid: torch.Tensor | None = None) -> torch.Tensor:
        """``x [tokens, hidden]``, the router's ``weights``/``indices`` ``[tokens, k]`` ->
        ``[tokens, hidden]`` in x's dtype (accumulated in float32). One sort of the routed
        pairs by expert, one host read of the counts (``v41_grouped_experts``)."""
        chosen = indices if valid is None else indices.masked_fill(~valid.unsqueeze(-1), -1)
        transfer = self.dispatch.plan(route(chosen, self.num_experts), self.num_local)
        rows = self.dispatch.send(x, transfer)
        contributions = grouped_swiglu(rows, self.w1, self.w3, self.w2, transfer.local_counts,
                                       self.limit)
        returned = self.dispatch.receive(contributions, transfer)
        pair_weights = transfer.routing.pair_weights(weights)
        return combine(returned, pair_weights, transfer.routing).to(x.dtype)


class DeepseekV41SharedExpert(nn.Module):
    """The shared expert: the clamped SwiGLU on megatron's column-parallel ``w1`` (gate) and
    ``w3`` (up), row-parallel ``w2``."""

    def __init__(self, args, config, tp_group=None):
        super().__init__()
        column, row = parallel_linears(config, tp_group)
        h, i, std = args.hidden_size, args.moe_intermediate_size, args.initializer_range
        self.limit = float(args.swiglu_limit)
        self.w1, self.w3, self.w2 = column(h, i, std), column(h, i, std), row(i, h, std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = clamped_swiglu(self.w1(x)[0], self.w3(x)[0], self.limit).to(x.dtype)
        return self.w2(hidden)[0]


def expert_parallel_group():
    """megatron's expert-model-parallel group (None outside an initialized parallel state)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_expert_model_parallel_group()


class DeepseekV41MoE(nn.Module):
    """Router, routed experts and the shared expert (module docstring). `config` and
    `tp_group` are the shared expert's megatron ``ModelParallelConfig`` and group.
    ``forward(x [..., hidden], valid [...] bool or None)`` -> ``[..., hidden]``."""

    def __init__(self, args, config, tp_group=None, device=None,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.hidden_size = args.hidden_size
        self.gate = DeepseekV41Router(args, device, dtype)
        self.experts = DeepseekV41Experts(args, device, dtype, expert_parallel_group())
        self.shared_experts = DeepseekV41SharedExpert(args, config, tp_group)
        self.reset_parameters(args.initializer_range)

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """Every weight normal(0, std), the correction bias 0."""
        for weight in (self.gate.weight, self.experts.w1, self.experts.w3, self.experts.w2,
                       self.shared_experts.w1.weight, self.shared_experts.w3.weight,
                       self.shared_experts.w2.weight):
            nn.init.normal_(weight, mean=0.0, std=std)
        self.gate.e_score_correction_bias.zero_()

    def forward(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[-1] != self.hidden_size:
            raise InputError(f"DeepSeek-V4.1 MoE takes [..., {self.hidden_size}], got "
                             f"{tuple(x.shape)}.")
        if valid is not None and (valid.shape != x.shape[:-1] or valid.dtype != torch.bool):
            raise InputError(f"valid must be a bool mask of shape {tuple(x.shape[:-1])}, got "
                             f"{tuple(valid.shape)} {valid.dtype}.")
        flat = x.reshape(-1, self.hidden_size)
        valid = None if valid is None else valid.reshape(-1)
        weights, indices = self.gate(flat, valid)
        routed = self.experts(flat, weights, indices, valid)
        return (routed + self.shared_experts(flat)).view(x.shape)

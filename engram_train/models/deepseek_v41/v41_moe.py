"""DeepSeek-V4.1's MoE: a router with sqrt-softplus scores, a bias used for the selection only,
no group routing; clamped-SwiGLU routed experts and one shared expert every token takes.

Per token x (``[tokens, hidden]``; any leading dims flatten into tokens)::

    p      = sqrt(softplus(x @ gate.T))              # float32, [experts]
    top    = topk(p + e_score_correction_bias, k)    # the bias picks, it never weighs
    w      = routed_scaling_factor * p[top] / (sum(p[top]) + 1e-20)   # k > 1 and norm_topk_prob
    y      = sum_{e in top} expert_e(x, w_e) + shared(x)
    expert(x, w) = w2((silu(min(x w1^T, L)) * clamp(x w3^T, -L, L)) * w)   # L = swiglu_limit

The SwiGLU runs in float32 (the routing weight applied before ``w2``, in float32 too) and is
rounded to the model dtype once before ``w2``; the routed outputs add up in float32 and are
rounded once before the shared expert's output is added. Padding tokens (``valid`` False) take
the shared expert only. The correction bias is a float32 buffer, not trained by gradient (an
update rule from the expert loads belongs to the trainer; none is applied here).

Parallelism: routed experts are stacked ``[experts, out, in]`` (``w1``, ``w3``, ``w2`` in
``nn.Linear`` orientation) so expert parallelism splits dim 0; the shared expert is megatron's
column-parallel ``w1``/``w3`` and row-parallel ``w2``. Under expert parallelism (megatron's
expert-model-parallel group) each rank holds ``experts / ep`` of them and an exact all-to-all
dispatch sends each (token, choice) pair to its expert's rank and the float32 contributions
back, each token's added in ascending expert order as in one process
(`ExpertParallelDispatch`). The expert weights are
megatron's expert parameters (``allreduce = False``: DDP reduces them over the expert
data-parallel group) and their checkpoint tensors are sharded on the expert axis.
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


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)`` in float32 (limit 0: no clamp)."""
    gate, up = gate.float(), up.float()
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


class DeepseekV41Router(nn.Module):
    """Top-k expert choice and weights (module docstring); ``forward(x [tokens, hidden])`` ->
    ``(weights [tokens, k] float32, indices [tokens, k])``."""

    def __init__(self, args, device=None, dtype: torch.dtype | None = None):
        super().__init__()
        self.topk, self.scale = args.num_experts_per_tok, float(args.routed_scaling_factor)
        self.normalize = bool(args.norm_topk_prob)
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, args.hidden_size,
                                               device=device, dtype=dtype))
        self.register_buffer("e_score_correction_bias",
                             torch.zeros(args.n_routed_experts, device=device,
                                         dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.sqrt(F.softplus(F.linear(x.float(), self.weight.float())))
        indices = torch.topk(scores + self.e_score_correction_bias, self.topk, dim=-1)[1]
        weights = scores.gather(1, indices)
        if self.normalize and self.topk > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, indices


class DeepseekV41Experts(nn.Module):
    """The routed experts, stacked: ``w1``/``w3`` ``[experts, inter, hidden]``, ``w2``
    ``[experts, hidden, inter]``, this rank's ``experts / ep`` of them under expert
    parallelism (`ep_group`). A loop over the experts that got tokens (the CPU reference; a
    grouped GEMM on GPUs)."""

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
        self.num_local = e // ep
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
        ``[tokens, hidden]`` in x's dtype (accumulated in float32)."""
        chosen = indices if valid is None else indices.masked_fill(~valid.unsqueeze(-1), -1)
        if self.dispatch.size == 1:
            out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
            for expert in torch.unique(chosen[chosen >= 0]).tolist():
                token, slot = torch.where(chosen == expert)
                out.index_add_(0, token, self._expert(expert, x[token], weights[token, slot]))
            return out.to(x.dtype)
        rows, pair_weights, local, route = self.dispatch.send(x, weights, chosen, self.num_local)
        results, served = [], []
        for expert in torch.unique(local).tolist():
            (pairs,) = torch.where(local == expert)
            results.append(self._expert(expert, rows[pairs], pair_weights[pairs]))
            served.append(pairs)
        if results:  # every received pair has its expert here: back in received order
            contributions = torch.cat(results)[torch.argsort(torch.cat(served))]
        else:  # no pair: an empty float32 block that keeps the exchange in the backward
            contributions = rows.float() * 0
        return self.dispatch.combine(contributions, route, x.shape[0]).to(x.dtype)

    def _expert(self, expert: int, xe: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Local expert ``expert`` on rows ``xe`` scaled by their routing ``weight``:
        float32 ``[rows, hidden]``."""
        hidden = clamped_swiglu(xe @ self.w1[expert].t(), xe @ self.w3[expert].t(), self.limit)
        hidden = (hidden * weight[:, None]).to(xe.dtype)
        return (hidden @ self.w2[expert].t()).float()


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
        weights, indices = self.gate(flat)
        routed = self.experts(flat, weights, indices, None if valid is None else valid.reshape(-1))
        return (routed + self.shared_experts(flat)).view(x.shape)

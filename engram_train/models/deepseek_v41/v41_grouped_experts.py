"""DeepSeek-V4.1's routed experts as one grouped computation (``v41_moe.DeepseekV41Experts``).

One routing pass per layer, no per-expert scan:

- `route`: each token's choices sorted ascending (a masked choice, -1, last), then ONE stable
  sort of the ``tokens x k`` pairs by expert: each expert's pairs are a contiguous slice, in
  token order, and ``position[t, j]`` is the pair of token t's j-th smallest expert; the counts
  per expert come from one ``bincount``. Nothing here reads the device.
- `host_counts`: the one host read of a layer (the counts, or under expert parallelism the
  counts both ways of the exchange, in one ``tolist``).
- `grouped_swiglu`: the clamped SwiGLU experts on the expert-sorted rows: ``torch._grouped_mm``
  where the device has it (CUDA, bf16, 16-byte aligned widths), else a loop over the contiguous
  slices (the counts already on the host); the float32 SwiGLU is rounded to the model dtype
  once, as the input of ``w2``; the output is in the model dtype (the GEMMs accumulate in
  float32). The experts never see the routing weights.
- `combine`: each token's contributions times their routing weights, added in float32 in
  ascending expert order (the order of one process's loop over its experts) by k gathers, no
  atomics (deterministic on every device); its backward is one gather, and the routing
  weights' gradient is each pair's float32 dot product of the token's gradient with the
  pair's contribution (so under expert parallelism the weights stay on their tokens' rank).

`reference_routed_experts` is the earlier loop (one ``torch.where`` per expert, three GEMMs per
expert, ``index_add_`` per expert; the routing weight applied to ``w2``'s output, as here): the
oracle of tests/test_v41_experts.py and the baseline of benchmarks/bench_v41_moe.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)`` in float32 (limit 0: no clamp)."""
    gate, up = gate.float(), up.float()
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


@dataclass
class Routing:
    """The routed pairs of one layer's tokens, sorted by expert (token order within)."""

    order: torch.Tensor  # [tokens x k] flat (token, sorted slot) index per sorted pair, masked last
    slot: torch.Tensor  # [tokens, k] each token's slots in ascending expert order
    position: torch.Tensor  # [tokens, k] pair of the token's j-th smallest expert (-1: masked)
    counts: torch.Tensor  # [experts] int64, on the device
    k: int
    pairs: int = -1  # routed pairs (known once the counts were read)
    token: torch.Tensor | None = None  # [pairs] the token of each routed pair, in expert order

    def finish(self, pairs: int) -> None:
        self.pairs = pairs
        self.token = torch.div(self.order[:pairs], self.k, rounding_mode="floor")

    @property
    def full(self) -> bool:
        """Every slot of every token routed (no masking to apply in the combine)."""
        return self.pairs == self.position.numel()

    def pair_weights(self, weights: torch.Tensor) -> torch.Tensor:
        """The routing weight of each routed pair (``weights [tokens, k]``, differentiable)."""
        return weights.gather(1, self.slot).reshape(-1)[self.order[: self.pairs]]


def route(chosen: torch.Tensor, num_experts: int) -> Routing:
    """`Routing` of ``chosen [tokens, k]`` (expert ids, -1: not routed): device ops only."""
    tokens, k = chosen.shape
    key = torch.where(chosen >= 0, chosen, num_experts)
    key, slot = torch.sort(key, dim=1, stable=True)
    flat = key.reshape(-1)
    order = torch.sort(flat, stable=True)[1]
    counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts]
    position = torch.empty_like(order)
    position[order] = torch.arange(order.numel(), device=order.device)
    position = position.view(tokens, k).masked_fill(key == num_experts, -1)
    return Routing(order, slot, position, counts, k)


def host_counts(counts: torch.Tensor) -> list[int]:
    """The one host read of a MoE layer: ``counts`` (int64) as a list."""
    return counts.tolist()


def _grouped_mm_fits(rows: torch.Tensor, *weights: torch.Tensor) -> bool:
    if not (rows.is_cuda and rows.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")):
        return False
    if torch.cuda.get_device_capability(rows.device) < (9, 0):
        return False
    return all(w.dtype == rows.dtype and (w.shape[-1] * 2) % 16 == 0 and (w.shape[-2] * 2) % 16 == 0
               for w in weights)


def grouped_swiglu(rows: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                   counts: list[int], limit: float) -> torch.Tensor:
    """Experts ``w1``/``w3`` ``[experts, inter, hidden]``, ``w2`` ``[experts, hidden, inter]``
    on ``rows [pairs, hidden]`` sorted by expert (``counts[e]`` rows each) -> ``[pairs, hidden]``
    in the rows' dtype (unweighted: `combine` applies the routing weights)."""
    if not rows.shape[0]:  # no pair: an empty block that keeps the rows in the graph
        return rows * 0
    if _grouped_mm_fits(rows, w1, w3, w2):
        offs = torch.cumsum(torch.tensor(counts, device=rows.device), 0).to(torch.int32)
        gate = torch._grouped_mm(rows, w1.transpose(-2, -1), offs=offs)
        up = torch._grouped_mm(rows, w3.transpose(-2, -1), offs=offs)
        hidden = clamped_swiglu(gate, up, limit).to(rows.dtype)
        return torch._grouped_mm(hidden, w2.transpose(-2, -1), offs=offs)
    return _SlicedExperts.apply(rows, w1, w3, w2, counts, limit)


def _slices(counts: list[int]):
    start = 0
    for e, count in enumerate(counts):
        if count:
            yield e, slice(start, start + count)
        start += count


def _swiglu_parts(gate: torch.Tensor, up: torch.Tensor, limit: float):
    """The clamped inputs and ``silu(gate)`` in float32 (`clamped_swiglu`'s steps)."""
    g, u = gate.float(), up.float()
    if limit > 0:
        g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
    return g, u, F.silu(g)


class _SlicedExperts(torch.autograd.Function):
    """The CPU path of `grouped_swiglu`: per expert, the GEMMs write into one buffer per
    tensor (``torch.mm(out=...)``), the elementwise SwiGLU runs on the expert's slice (its
    values those of a standalone per-expert tensor: the same bits under any layout), and the
    backward is written out (no per-slice autograd nodes, no full-size zero gradients per
    expert); it keeps the GEMMs' outputs ``gate`` and ``up`` and recomputes the rest."""

    @staticmethod
    def forward(ctx, rows, w1, w3, w2, counts, limit):
        pairs, inter = rows.shape[0], w1.shape[1]
        gate, up = rows.new_empty(pairs, inter), rows.new_empty(pairs, inter)
        out = rows.new_empty(pairs, w2.shape[1])
        for e, part in _slices(counts):
            torch.mm(rows[part], w1[e].t(), out=gate[part])
            torch.mm(rows[part], w3[e].t(), out=up[part])
            g, u, silu = _swiglu_parts(gate[part], up[part], limit)
            hidden = (silu * u).to(rows.dtype)
            torch.mm(hidden, w2[e].t(), out=out[part])
        ctx.save_for_backward(rows, w1, w3, w2, gate, up)
        ctx.counts, ctx.limit = counts, limit
        return out

    @staticmethod
    def backward(ctx, grad):
        rows, w1, w3, w2, gate, up = ctx.saved_tensors
        limit, dtype = ctx.limit, rows.dtype
        grad_rows = torch.empty_like(rows)
        grads = [torch.zeros_like(w) if w.requires_grad else None for w in (w1, w3, w2)]
        for e, part in _slices(ctx.counts):
            g, u, silu = _swiglu_parts(gate[part], up[part], limit)
            ge = grad[part].to(dtype)
            if grads[2] is not None:
                torch.mm(ge.t(), (silu * u).to(dtype), out=grads[2][e])
            d_swiglu = (ge @ w2[e]).float()
            d_up = d_swiglu * silu
            d_gate = torch.ops.aten.silu_backward(d_swiglu * u, g)
            if limit > 0:  # clamp's gradient: where the input was inside the bounds
                d_up = d_up.masked_fill_(up[part].float().abs() > limit, 0)
                d_gate = d_gate.masked_fill_(gate[part].float() > limit, 0)
            d_up, d_gate = d_up.to(dtype), d_gate.to(dtype)
            torch.mm(d_gate, w1[e], out=grad_rows[part])
            grad_rows[part] += d_up @ w3[e]  # two rounded GEMMs added, as autograd adds them
            if grads[0] is not None:
                torch.mm(d_gate.t(), rows[part], out=grads[0][e])
                torch.mm(d_up.t(), rows[part], out=grads[1][e])
        return grad_rows, *grads, None, None


class _Combine(torch.autograd.Function):
    """``[pairs, hidden]`` contributions in expert order and their float32 routing weights
    ``[pairs]`` -> float32 ``[tokens, hidden]`` (`combine`)."""

    @staticmethod
    def forward(ctx, contributions, weight, position, token, full):
        ctx.save_for_backward(contributions, weight, token)
        out = contributions.new_zeros(position.shape[0], contributions.shape[1], dtype=torch.float32)
        if not contributions.shape[0]:
            return out
        for j in range(position.shape[1]):  # ascending expert order per token
            p = position[:, j]
            if full:
                out += contributions.index_select(0, p) * weight.index_select(0, p)[:, None]
            else:
                q = p.clamp(min=0)
                part = contributions.index_select(0, q) * weight.index_select(0, q)[:, None]
                out += part.masked_fill_(p[:, None] < 0, 0)
        return out

    @staticmethod
    def backward(ctx, grad):
        contributions, weight, token = ctx.saved_tensors
        grad_pairs = grad.index_select(0, token)  # float32 [pairs, hidden]
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad_pairs * contributions).sum(dim=1)
        grad_contributions = grad_pairs.mul_(weight[:, None]).to(contributions.dtype)
        return grad_contributions, grad_weight, None, None, None


def combine(contributions: torch.Tensor, weight: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Each token's contributions (``[pairs, hidden]`` in expert order, as `route` sorted them)
    times their float32 routing ``weight [pairs]``, added in float32 in ascending expert order:
    ``[tokens, hidden]`` float32."""
    return _Combine.apply(contributions, weight, routing.position, routing.token, routing.full)


class _GatherRows(torch.autograd.Function):
    """``x[token]``; its backward adds each token's pairs in float32, in pair order."""

    @staticmethod
    def forward(ctx, x, token):
        ctx.save_for_backward(token)
        ctx.shape, ctx.dtype = x.shape, x.dtype
        return x.index_select(0, token)

    @staticmethod
    def backward(ctx, grad):
        (token,) = ctx.saved_tensors
        out = grad.new_zeros(ctx.shape, dtype=torch.float32)
        return out.index_add_(0, token, grad.float()).to(ctx.dtype), None


def gather_rows(x: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    return _GatherRows.apply(x, token)


def reference_routed_experts(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
                             w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                             limit: float) -> torch.Tensor:
    """The earlier one-process loop (module docstring): ``[tokens, hidden]`` in x's dtype."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in torch.unique(chosen[chosen >= 0]).tolist():
        token, slot = torch.where(chosen == expert)
        xe = x[token]
        hidden = clamped_swiglu(xe @ w1[expert].t(), xe @ w3[expert].t(), limit).to(xe.dtype)
        out.index_add_(0, token, (hidden @ w2[expert].t()) * weights[token, slot][:, None])
    return out.to(x.dtype)

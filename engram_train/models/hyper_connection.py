"""DeepSeek's manifold-constrained hyper-connections (mHC, arXiv 2512.24880), in plain torch.

The residual stream becomes ``n`` streams ``X [s, b, n, h]``. Each sublayer (attention, MLP/MoE)
reads one collapsed input ``u = sum_j H_pre[j] X[j]`` and writes back through
``X'[k] = H_post[k] y + sum_j C[j, k] X[j]``, where ``C`` is a doubly stochastic mixing matrix
(Sinkhorn projection), so stream mixing neither grows nor shrinks the residual. The mappings
are computed per token from the RMS-normalized streams, in float32 whatever the model dtype.
The numerics are DeepSeek-V4's released form (``docs/mhc.md``); parameter names and shapes are
those of upstream megatron-core and of transformers' ``DeepseekV4Model`` (``attn_hc``,
``ffn_hc``: ``fn``, ``base``, ``scale``; ``hc_head``: ``hc_fn``, ``hc_base``, ``hc_scale``).

Nothing here knows megatron: ``models/hyper_connection_layer.py`` wraps megatron's layers
with these modules, ``models/hyper_connection_model.py`` expands and collapses the streams.
"""

from __future__ import annotations

import math

import torch
from torch import nn

HC_EPS = 1e-6
"""``eps_hc``: added to H_pre, C and the Sinkhorn denominators (DeepSeek-V4)."""

BATCHED_MIX_MIN_HIDDEN = 128
"""Hidden size from which the write-back runs as one batched GEMM per token on the CPU (below
it, n broadcast multiply-adds are faster; on CUDA always the GEMM)."""

RESIDUAL_OFF_DIAGONAL_BIAS = -8.0
"""Init of ``b_res`` off the diagonal (0 on it): C starts at ~0.999 on the diagonal, close to
a plain residual per stream, yet far enough from saturation for the mixing to learn."""


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x**2) + eps)`` over the last dim, no weight (the mappings' input
    normalization), torch's fused kernel."""
    return nn.functional.rms_norm(x, (x.shape[-1],), eps=eps)


def _sinkhorn_steps(iterations: int) -> list[int]:
    """The normalized dim of each step in the token-last layout ``[n (row), n (col), tokens]``:
    columns (a sum over rows, dim 0) first, then rows (dim 1) and columns alternately."""
    return [0] + [1, 0] * (iterations - 1)


def _tokens_last(x: torch.Tensor) -> torch.Tensor:
    """``[..., n, n]`` -> ``[n, n, tokens]`` contiguous: the sums over a matrix's rows or
    columns become adds of contiguous token vectors (a reduction over a trailing dim of 4 is
    several times slower on CPU)."""
    n = x.shape[-1]
    return x.reshape(-1, n, n).permute(1, 2, 0).contiguous()


def _tokens_first(x: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    return x.permute(2, 0, 1).reshape(shape)


class _SinkhornProjection(torch.autograd.Function):
    """``sinkhorn`` with a hand-written backward: the reverse sweep of the iterations, a few
    tensor ops per step on the saved normalized matrices and denominators (``[n, n]`` and ``[n]``
    per token, small next to the ``n x h`` streams), instead of autograd's graph of ~10 nodes per
    step."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, iterations: int, eps: float) -> torch.Tensor:
        p = torch.softmax(_tokens_last(logits), dim=1)
        c, saved = p + eps, [p]
        for dim in _sinkhorn_steps(iterations):
            d = c.sum(dim=dim, keepdim=True) + eps
            c = c / d
            saved += [c, d]
        ctx.save_for_backward(*saved)
        ctx.iterations, ctx.shape = iterations, logits.shape
        return _tokens_first(c, logits.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        p, *steps = ctx.saved_tensors
        dims = _sinkhorn_steps(ctx.iterations)
        grad = _tokens_last(grad)
        for i in reversed(range(len(dims))):  # out = c / d:  dc = (g - sum(g * out)) / d
            out, d = steps[2 * i], steps[2 * i + 1]
            grad = (grad - (grad * out).sum(dim=dims[i], keepdim=True)) / d
        grad = p * (grad - (grad * p).sum(dim=1, keepdim=True))
        return _tokens_first(grad, ctx.shape), None, None


def sinkhorn(logits: torch.Tensor, iterations: int, eps: float = HC_EPS) -> torch.Tensor:
    """Doubly stochastic projection of ``[..., n, n]`` logits: row softmax, then alternate
    column and row normalizations (``iterations`` column steps in all), DeepSeek-V4's form."""
    return _SinkhornProjection.apply(logits, int(iterations), float(eps))


def weighted_stream_sum(weights: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``sum_j weights[..., j] * X[:, :, j]``: ``[s, b, n]``, ``[s, b, n, h]`` -> ``[s, b, h]``."""
    return (weights.unsqueeze(-1) * x).sum(dim=2)


def _check_streams(x: torch.Tensor, num_streams: int, hidden_size: int, who: str) -> None:
    if x.ndim != 4 or x.shape[2] != num_streams or x.shape[3] != hidden_size:
        raise ValueError(
            f"{who} expects the residual streams as [s, b, {num_streams}, {hidden_size}] "
            f"(sequence first, num_residual_streams={num_streams}), got {tuple(x.shape)}"
        )


class HyperConnection(nn.Module):
    """The mapping around one sublayer: ``forward(X)`` gives the sublayer's input ``u`` and
    the write-back weights ``H_post``, ``C``; ``mix(X, y, H_post, C)`` applies them to the
    sublayer's output ``y``. The sublayer itself (norm + attention or MLP) runs in between,
    unchanged."""

    def __init__(self, hidden_size: int, num_streams: int, sinkhorn_iterations: int = 20,
                 eps: float = HC_EPS, norm_eps: float = 1e-6, device=None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if num_streams < 2:
            raise ValueError(f"num_residual_streams={num_streams} must be >= 2 for mHC")
        if sinkhorn_iterations < 1:
            raise ValueError(f"mhc_sinkhorn_iterations={sinkhorn_iterations} must be >= 1")
        n = num_streams
        factory = {"device": device, "dtype": dtype or torch.float32}
        self.hidden_size, self.num_streams = int(hidden_size), int(n)
        self.sinkhorn_iterations = int(sinkhorn_iterations)
        self.eps, self.norm_eps = float(eps), float(norm_eps)
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * hidden_size, **factory))
        self.base = nn.Parameter(torch.empty((2 + n) * n, **factory))
        self.scale = nn.Parameter(torch.empty(3, **factory))
        self.register_buffer("_logit_groups", torch.tensor([n, n, n * n], device=device),
                             persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, gating_factor: float = 0.01, std: float = 0.02) -> None:
        """The spec's start: H_pre = 1/n, H_post = 1, C near the identity."""
        n = self.num_streams
        self.fn.normal_(0.0, std)
        self.scale.fill_(gating_factor)
        b_pre, b_post, b_res = self.base.split([n, n, n * n])
        b_pre.fill_(-math.log(n - 1))
        b_post.zero_()
        off_diagonal = 1 - torch.eye(n, device=b_res.device)
        b_res.copy_(RESIDUAL_OFF_DIAGONAL_BIAS * off_diagonal.flatten())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``X [s, b, n, h]`` -> ``(u [s, b, h] in X's dtype, H_post [s, b, n], C [s, b, n, n])``,
        the last two in float32."""
        _check_streams(x, self.num_streams, self.hidden_size, "HyperConnection")
        s, b, n, h = x.shape
        r = unweighted_rms_norm(x.reshape(s, b, n * h).float(), self.norm_eps)
        # scale[0] on the n pre logits, scale[1] on the n post logits, scale[2] on the n*n
        # mixing logits: one multiply-add for all (fewer small ops: this runs per sublayer)
        scales = self.scale.float().repeat_interleave(self._logit_groups)
        z = torch.addcmul(self.base.float(), nn.functional.linear(r, self.fn.float()), scales)
        gates = torch.sigmoid(z[..., : 2 * n])
        h_pre = gates[..., :n] + self.eps
        h_post = 2 * gates[..., n:]
        c = sinkhorn(z[..., 2 * n :].view(s, b, n, n), self.sinkhorn_iterations, self.eps)
        return weighted_stream_sum(h_pre.to(x.dtype), x), h_post, c

    @staticmethod
    def mix(x: torch.Tensor, y: torch.Tensor, h_post: torch.Tensor, c: torch.Tensor
            ) -> torch.Tensor:
        """``X'[k] = H_post[k] y + sum_j C[j, k] X[j]``, in X's dtype: ``[s, b, n, h]``."""
        dtype = x.dtype
        s, b, n, h = x.shape
        c, h_post, y = c.to(dtype), h_post.to(dtype), y.to(dtype)
        if x.is_cuda or h >= BATCHED_MIX_MIN_HIDDEN:
            # one batched GEMM per token: [H_post | C^T] ([n, n+1]) @ [y; X] ([n+1, h])
            weights = torch.cat([h_post.unsqueeze(-1), c.transpose(-1, -2)], dim=-1)
            rows = torch.cat([y.unsqueeze(2), x], dim=2)
            return torch.bmm(weights.reshape(s * b, n, n + 1),
                             rows.reshape(s * b, n + 1, h)).view(s, b, n, h)
        out = h_post.unsqueeze(-1) * y.unsqueeze(-2)
        for j in range(n):  # n broadcast multiply-adds: faster than the GEMMs for small h on CPU
            out = torch.addcmul(out, c[..., j, :].unsqueeze(-1), x[:, :, j : j + 1])
        return out


class HyperHead(nn.Module):
    """The collapse of the streams before the final norm: ``out = sum_j w[j] X[j]``."""

    def __init__(self, hidden_size: int, num_streams: int, eps: float = HC_EPS,
                 norm_eps: float = 1e-6, device=None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if num_streams < 2:
            raise ValueError(f"num_residual_streams={num_streams} must be >= 2 for mHC")
        n = num_streams
        factory = {"device": device, "dtype": dtype or torch.float32}
        self.hidden_size, self.num_streams = int(hidden_size), int(n)
        self.eps, self.norm_eps = float(eps), float(norm_eps)
        self.hc_fn = nn.Parameter(torch.empty(n, n * hidden_size, **factory))
        self.hc_base = nn.Parameter(torch.empty(n, **factory))
        self.hc_scale = nn.Parameter(torch.empty(1, **factory))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, gating_factor: float = 0.01, std: float = 0.02) -> None:
        """The spec's start: w = 1/n on every stream."""
        self.hc_fn.normal_(0.0, std)
        self.hc_scale.fill_(gating_factor)
        self.hc_base.fill_(-math.log(self.num_streams - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``X [s, b, n, h]`` -> ``[s, b, h]`` in X's dtype."""
        _check_streams(x, self.num_streams, self.hidden_size, "HyperHead")
        s, b, n, h = x.shape
        r = unweighted_rms_norm(x.reshape(s, b, n * h).float(), self.norm_eps)
        w = torch.sigmoid(self.hc_scale.float() * nn.functional.linear(r, self.hc_fn.float())
                          + self.hc_base.float()) + self.eps
        return weighted_stream_sum(w.to(x.dtype), x)

"""DeepSeek's manifold-constrained hyper-connections (mHC, arXiv 2512.24880), in plain torch.

The residual stream becomes ``n`` streams ``X [s, b, n, h]``. Each sublayer (attention, MLP/MoE)
reads one collapsed input ``u = sum_j H_pre[j] X[j]`` and writes back through
``X'[k] = H_post[k] y + sum_j C[j, k] X[j]``, where ``C`` is a doubly stochastic mixing matrix
(Sinkhorn projection), so stream mixing neither grows nor shrinks the residual. The mappings
are computed per token from the RMS-normalized streams, in float32 whatever the model dtype.
The numerics are DeepSeek-V4's released form (``docs/mhc.md``); parameter names and shapes are
those of upstream megatron-core and of transformers' ``DeepseekV4Model`` (``attn_hc``,
``ffn_hc``: ``fn``, ``base``, ``scale``; ``hc_head``: ``hc_fn``, ``hc_base``, ``hc_scale``).

The arithmetic of the mappings is in ``models/hyper_connection_ops.py``; the modules are here.
Nothing here knows megatron: ``models/hyper_connection_layer.py`` wraps megatron's layers
with these modules, ``models/hyper_connection_model.py`` expands and collapses the streams.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from engram_train.errors import InputError
from engram_train.models.hyper_connection_ops import (
    HC_EPS,
    check_streams,
    mix_backward,
    mix_streams,
    mixing_weights,
    normalized_projection,
    projection_backward,
    projection_forward,
    scale_index,
    sinkhorn,
    stream_dots,
    weighted_stream_sum,
)

RESIDUAL_OFF_DIAGONAL_BIAS = -8.0
"""Init of ``b_res`` off the diagonal (0 on it): C starts at ~0.999 on the diagonal, close to
a plain residual per stream, yet far enough from saturation for the mixing to learn."""


class _MappingState:
    """What the two halves of a recomputed sublayer hand each other: the forward's ``H_post``
    and ``C`` (collapse -> write-back, dropped once used) and, in the backward, the recomputed
    projection and the gradients of ``H_post`` and ``C`` (write-back -> collapse)."""

    __slots__ = ("h_post", "c", "projected", "grads")

    def __init__(self) -> None:
        self.h_post = self.c = self.projected = self.grads = None


class _CollapseRecomputed(torch.autograd.Function):
    """``u = sum_j H_pre[j] X[j]`` saving only X (and the parameters). The backward recomputes
    the small part of the mapping (gates, Sinkhorn) with its graph from the projection the
    write-back's backward recomputed, back-propagates the gradients of all three mappings
    (``H_post`` and ``C``'s handed over by ``_WriteBackRecomputed``) to it, and through the
    projection to X and ``fn`` by hand (``projection_backward``)."""

    @staticmethod
    def forward(ctx, x, fn, base, scale, hc, state):
        with torch.no_grad():
            projected = projection_forward(hc.flat(x), fn, hc.norm_eps)
            h_pre, state.h_post, state.c = hc.gates(projected, base, scale)
            u = weighted_stream_sum(h_pre.to(x.dtype), x)
        ctx.save_for_backward(x, fn, base, scale)
        ctx.hc, ctx.state = hc, state
        return u

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_u):
        x, fn, base, scale = ctx.saved_tensors
        hc, state = ctx.hc, ctx.state
        projected, handed = state.projected, state.grads
        state.projected = state.grads = None
        flat = hc.flat(x)
        if projected is None:  # the write-back's output took no part in the loss
            projected = projection_forward(flat, fn, hc.norm_eps)
        grad_u = grad_u.to(x.dtype)
        leaves = [t.detach().requires_grad_() for t in (projected, base, scale)]
        with torch.enable_grad():
            h_pre, h_post, c = hc.gates(*leaves)
        outputs, grads = [h_pre], [stream_dots(x, grad_u).float()]
        if handed is not None:
            outputs += [h_post, c]
            grads += handed
        grad_projected, grad_base, grad_scale = torch.autograd.grad(outputs, leaves, grads)
        weights = h_pre.detach().to(x.dtype).unsqueeze(-1)
        s, b, n, h = x.shape

        def add_collapse(chunk, grad_flat):  # u's part: dX[j] += H_pre[j] du
            grad_flat.view(-1, b, n, h).addcmul_(weights[chunk], grad_u[chunk].unsqueeze(-2))

        grad_flat, grad_fn = projection_backward(flat, fn, projected, grad_projected,
                                                 hc.norm_eps, add=add_collapse)
        return grad_flat.view_as(x), grad_fn.to(fn.dtype), grad_base, grad_scale, None, None


class _WriteBackRecomputed(torch.autograd.Function):
    """``mix_streams`` saving only X and y: the backward recomputes ``H_post`` and ``C`` without
    a graph, writes the mix's gradients by hand (the ones autograd forms for ``mix_streams``)
    and hands the projection and the gradients of ``H_post`` and ``C`` to
    ``_CollapseRecomputed``'s backward, which runs after the sublayer's."""

    @staticmethod
    def forward(ctx, x, y, hc, state):
        with torch.no_grad():
            out = mix_streams(x, y, state.h_post, state.c)
        state.h_post = state.c = None
        ctx.save_for_backward(x, y)
        ctx.hc, ctx.state = hc, state
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, y = ctx.saved_tensors
        hc, state = ctx.hc, ctx.state
        state.projected = projection_forward(hc.flat(x), hc.fn, hc.norm_eps)
        _, h_post, c = hc.gates(state.projected, hc.base, hc.scale)
        h_post, d = mixing_weights(h_post, c, x.dtype)
        grad_x, grad_y, grad_h_post, grad_c = mix_backward(x, y.to(x.dtype), h_post, d,
                                                            grad.to(x.dtype))
        state.grads = [grad_h_post, grad_c]
        return grad_x, grad_y.to(y.dtype), None, None


class HyperConnection(nn.Module):
    """The mapping around one sublayer: ``forward(X)`` gives the sublayer's input ``u`` and
    the write-back weights ``H_post``, ``C``; ``mix(X, y, H_post, C)`` applies them to the
    sublayer's output ``y``. ``sublayer(X, f, recompute)`` runs both around ``f``; with
    ``recompute`` only X and y are kept for the backward (the mapping is recomputed from X)."""

    def __init__(self, hidden_size: int, num_streams: int, sinkhorn_iterations: int = 20,
                 eps: float = HC_EPS, norm_eps: float = 1e-6, device=None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if num_streams < 2:
            raise InputError(f"num_residual_streams={num_streams} must be >= 2 for mHC")
        if sinkhorn_iterations < 1:
            raise InputError(f"mhc_sinkhorn_iterations={sinkhorn_iterations} must be >= 1")
        n = num_streams
        factory = {"device": device, "dtype": dtype or torch.float32}
        self.hidden_size, self.num_streams = int(hidden_size), int(n)
        self.sinkhorn_iterations = int(sinkhorn_iterations)
        self.eps, self.norm_eps = float(eps), float(norm_eps)
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * hidden_size, **factory))
        self.base = nn.Parameter(torch.empty((2 + n) * n, **factory))
        self.scale = nn.Parameter(torch.empty(3, **factory))
        self.register_buffer("_scale_index", scale_index(n, device), persistent=False)
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

    def flat(self, x: torch.Tensor) -> torch.Tensor:
        """``X [s, b, n, h]`` -> ``[s, b, n*h]`` (a view): the mappings' input."""
        s, b, n, h = x.shape
        return x.reshape(s, b, n * h)

    def gates(self, projected: torch.Tensor, base: torch.Tensor, scale: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(H_pre, H_post, C)`` from the normalized projection ``[s, b, (2+n)n]``: the small,
        per-token part of the mapping (gates and the Sinkhorn projection), float32."""
        s, b, n = *projected.shape[:2], self.num_streams
        # scale[0] on the n pre logits, scale[1] on the n post logits, scale[2] on the n*n
        # mixing logits: one multiply-add for all (fewer small ops: this runs per sublayer)
        scales = scale.float().index_select(0, self._scale_index)
        z = torch.addcmul(base.float(), projected, scales)
        gates = torch.sigmoid(z[..., : 2 * n])
        c = sinkhorn(z[..., 2 * n :].view(s, b, n, n), self.sinkhorn_iterations, self.eps)
        return gates[..., :n] + self.eps, 2 * gates[..., n:], c

    def mapping(self, x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor,
                scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(H_pre [s, b, n], H_post [s, b, n], C [s, b, n, n])`` in float32 from X and the
        given parameters."""
        return self.gates(normalized_projection(self.flat(x), fn, self.norm_eps), base, scale)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``X [s, b, n, h]`` -> ``(u [s, b, h] in X's dtype, H_post [s, b, n], C [s, b, n, n])``,
        the last two in float32."""
        check_streams(x, self.num_streams, self.hidden_size, "HyperConnection")
        h_pre, h_post, c = self.mapping(x, self.fn, self.base, self.scale)
        return weighted_stream_sum(h_pre.to(x.dtype), x), h_post, c

    mix = staticmethod(mix_streams)

    def sublayer(self, x: torch.Tensor, function, recompute: bool = False) -> torch.Tensor:
        """``X' = mix(X, function(u), H_post, C)``; with ``recompute`` the backward keeps X and
        y only and recomputes the mapping from X (the same numbers)."""
        if not recompute or not torch.is_grad_enabled():
            u, h_post, c = self(x)
            return self.mix(x, function(u), h_post, c)
        check_streams(x, self.num_streams, self.hidden_size, "HyperConnection")
        state = _MappingState()
        u = _CollapseRecomputed.apply(x, self.fn, self.base, self.scale, self, state)
        return _WriteBackRecomputed.apply(x, function(u), self, state)


class HyperHead(nn.Module):
    """The collapse of the streams before the final norm: ``out = sum_j w[j] X[j]``."""

    def __init__(self, hidden_size: int, num_streams: int, eps: float = HC_EPS,
                 norm_eps: float = 1e-6, device=None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if num_streams < 2:
            raise InputError(f"num_residual_streams={num_streams} must be >= 2 for mHC")
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

    def weights(self, x: torch.Tensor) -> torch.Tensor:
        """``w [s, b, n]`` in float32 from the streams."""
        s, b, n, h = x.shape
        projected = normalized_projection(x.reshape(s, b, n * h), self.hc_fn, self.norm_eps)
        return torch.sigmoid(self.hc_scale.float() * projected + self.hc_base.float()) + self.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``X [s, b, n, h]`` -> ``[s, b, h]`` in X's dtype. The backward keeps X and O(n) values
        per token (the projection keeps no float32 copy of the streams)."""
        check_streams(x, self.num_streams, self.hidden_size, "HyperHead")
        return weighted_stream_sum(self.weights(x).to(x.dtype), x)

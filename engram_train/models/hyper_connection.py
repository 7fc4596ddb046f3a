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
from torch.autograd.function import once_differentiable

from engram_train.errors import InputError

HC_EPS = 1e-6
"""``eps_hc``: added to H_pre, C and the Sinkhorn denominators (DeepSeek-V4)."""

BATCHED_MIX_MIN_HIDDEN = 128
"""Hidden size from which the write-back runs as one batched GEMM per token on the CPU (below
it, n broadcast multiply-adds are faster; on CUDA always the GEMM)."""

RESIDUAL_OFF_DIAGONAL_BIAS = -8.0
"""Init of ``b_res`` off the diagonal (0 on it): C starts at ~0.999 on the diagonal, close to
a plain residual per stream, yet far enough from saturation for the mixing to learn."""


TOKEN_CHUNK_ELEMENTS = {"cpu": 2**19, "cuda": 2**25}
"""Stream elements (tokens x n x h) per chunk of the hand-written passes over the streams (the
mappings' projection, the recomputed write-back), by device. Every op of a chunk then reads
what the previous one wrote from cache rather than from memory, and the projection's float32
copy of the streams (and its gradient) exists for one chunk at a time, never for the whole
sequence. On the CPU this halves the write-back's backward; on CUDA a chunk only bounds the
float32 copies (few launches)."""


def _token_chunks(x: torch.Tensor) -> list[slice]:
    """Slices of the leading (token) dim of ``x``, about ``TOKEN_CHUNK_ELEMENTS`` elements
    each (everything chunked is per token: chunks are independent)."""
    budget = TOKEN_CHUNK_ELEMENTS["cuda" if x.is_cuda else "cpu"]
    rows = max(1, budget // max(1, x[0].numel()))
    return [slice(i, min(i + rows, x.shape[0])) for i in range(0, x.shape[0], rows)]


def _inverse_rms(xf: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(xf.square().mean(-1, keepdim=True).add_(eps))


@torch.no_grad()
def projection_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``linear(rms_norm(x.float(), eps), weight.float())`` (no norm weight) computed as
    ``rsqrt(mean(x**2) + eps) * (x @ weight.T)`` chunk by chunk: float32 ``[..., m]``; the
    normalized float32 streams are never formed. No graph (``normalized_projection`` is the
    differentiable form)."""
    weight = weight.float()
    out = x.new_empty(*x.shape[:-1], weight.shape[0], dtype=torch.float32)
    for chunk in _token_chunks(x):
        xf = x[chunk].float()
        torch.mul(nn.functional.linear(xf, weight), _inverse_rms(xf, eps), out=out[chunk])
    return out


@torch.no_grad()
def projection_backward(x: torch.Tensor, weight: torch.Tensor, projected: torch.Tensor,
                        grad: torch.Tensor, eps: float, add=None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``projection_forward`` (X in its dtype, the weight in float32) from its
    output ``projected`` and that output's gradient, chunk by chunk, by hand: with
    ``r = rsqrt(mean(x**2) + eps)``, ``dX = r (g @ W) - (r^2 / width) (g . projected) x`` and
    ``dW = (r g)^T x``: two passes over the streams where autograd through ``rms_norm`` makes
    about eight. ``add(chunk, grad_x)``, when given, adds more of X's gradient into the chunk's
    float32 gradient before its one rounding to X's dtype."""
    weight = weight.float()
    grad_x = torch.empty_like(x)
    grad_w = torch.zeros_like(weight)
    for chunk in _token_chunks(x):
        xf, g = x[chunk].float(), grad[chunk]
        r = _inverse_rms(xf, eps)
        coef = (g * projected[chunk]).sum(-1, keepdim=True).mul_(r.square()).div_(-x.shape[-1])
        g = g * r
        chunk_grad = torch.matmul(g, weight).addcmul_(xf, coef)
        if add is not None:
            add(chunk, chunk_grad)
        grad_x[chunk] = chunk_grad
        grad_w.addmm_(g.reshape(-1, g.shape[-1]).t(), xf.reshape(-1, xf.shape[-1]))
    return grad_x, grad_w


class _NormalizedProjection(torch.autograd.Function):
    """``projection_forward`` keeping X in its own dtype (the storage the write-back keeps
    anyway) and the ``m`` float32 outputs per token for the backward, nothing of size n*h in
    float32."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        out = projection_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, out)
        ctx.eps = eps
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, weight, out = ctx.saved_tensors
        grad_x, grad_w = projection_backward(x, weight, out, grad, ctx.eps)
        return grad_x, grad_w.to(weight.dtype), None


def normalized_projection(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``linear(rms_norm(x.float(), eps), weight.float())`` (no norm weight), float32, differentiable
    in X and the weight (``_NormalizedProjection``)."""
    return _NormalizedProjection.apply(x, weight, float(eps))


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
    @once_differentiable
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
    """``sum_j weights[..., j] * X[:, :, j]``: ``[s, b, n]``, ``[s, b, n, h]`` -> ``[s, b, h]``,
    as a batched ``[1, n] @ [n, h]`` (accumulated in float32 and rounded once in bf16)."""
    return torch.matmul(weights.unsqueeze(-2), x).squeeze(-2)


def stream_dots(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``X[:, :, j] . g`` per stream: ``[s, b, n, h]``, ``[s, b, h]`` -> ``[s, b, n]`` (the
    gradient of a stream weight from the gradient of the weighted sum)."""
    return (x * g.unsqueeze(2)).sum(-1)


def _check_streams(x: torch.Tensor, num_streams: int, hidden_size: int, who: str) -> None:
    if x.ndim != 4 or x.shape[2] != num_streams or x.shape[3] != hidden_size:
        raise InputError(
            f"{who} expects the residual streams as [s, b, {num_streams}, {hidden_size}] "
            f"(sequence first, num_residual_streams={num_streams}), got {tuple(x.shape)}"
        )


def scale_index(num_streams: int, device=None) -> torch.Tensor:
    """Which of ``scale``'s three entries gates each of the ``(2+n)n`` mapping logits: a
    precomputed index (a ``repeat_interleave`` with a tensor of repeats would wait for the
    device to learn the output size)."""
    n = num_streams
    return torch.tensor([0] * n + [1] * n + [2] * n * n, device=device)


def mixing_weights(h_post: torch.Tensor, c: torch.Tensor, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The write-back weights in the model dtype: ``H_post`` and ``C - I``."""
    eye = torch.eye(c.shape[-1], dtype=c.dtype, device=c.device)
    return h_post.to(dtype), (c - eye).to(dtype)


def mix_streams(x: torch.Tensor, y: torch.Tensor, h_post: torch.Tensor, c: torch.Tensor
                ) -> torch.Tensor:
    """``X'[k] = H_post[k] y + sum_j C[j, k] X[j]`` in X's dtype, written as
    ``X + H_post y + (C - I)^T X``: ``C - I`` is small near the identity, so its bf16 rounding
    keeps C's row and column sums (the ~0.999 diagonal of C itself rounds to 1.0 in bf16, and
    the residual would grow by ~0.1% per sublayer). Without autograd, chunk by chunk."""
    h_post, d = mixing_weights(h_post, c, x.dtype)
    y = y.to(x.dtype)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, y, h_post, d)):
        return _mix(x, y, h_post, d)
    out = torch.empty_like(x)
    for chunk in _token_chunks(x):
        _mix(x[chunk], y[chunk], h_post[chunk], d[chunk], out[chunk])
    return out


def _mix(x, y, h_post, d, out=None):
    """The write-back into ``out``, or (None, under autograd) into a new tensor."""
    n, h = x.shape[2], x.shape[3]
    if x.is_cuda or h >= BATCHED_MIX_MIN_HIDDEN:  # one batched [n, n] @ [n, h] per token
        # accumulated in place into the product: the output is the only stream-sized tensor
        out = torch.matmul(d.transpose(-1, -2), x, out=out)
        return out.add_(x).addcmul_(h_post.unsqueeze(-1), y.unsqueeze(-2))
    out = torch.addcmul(x, h_post.unsqueeze(-1), y.unsqueeze(-2), out=out)
    for j in range(n):  # n broadcast multiply-adds: faster than the GEMMs for small h on CPU
        out.addcmul_(d[..., j, :].unsqueeze(-1), x[:, :, j : j + 1])
    return out


def _mix_backward(x, y, h_post, d, grad):
    """The write-back's gradients by hand, chunk by chunk (each chunk of ``grad`` read from
    cache by its four products): X's, y's, and the float32 gradients of ``H_post`` and of C
    (that of ``C - I``)."""
    s, b, n, _ = x.shape
    grad_x, grad_y = torch.empty_like(x), torch.empty_like(y)
    grad_h_post = x.new_empty((s, b, n), dtype=torch.float32)
    grad_c = x.new_empty((s, b, n, n), dtype=torch.float32)
    for chunk in _token_chunks(x):
        g = grad[chunk]
        # dX[j] = g[j] + sum_k (C - I)[j, k] g[k]
        torch.matmul(d[chunk], g, out=grad_x[chunk]).add_(g)
        grad_y[chunk] = weighted_stream_sum(h_post[chunk], g)
        grad_h_post[chunk] = stream_dots(g, y[chunk])
        grad_c[chunk] = torch.matmul(x[chunk], g.transpose(-1, -2))
    return grad_x, grad_y, grad_h_post, grad_c


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
        grad_x, grad_y, grad_h_post, grad_c = _mix_backward(x, y.to(x.dtype), h_post, d,
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
        _check_streams(x, self.num_streams, self.hidden_size, "HyperConnection")
        h_pre, h_post, c = self.mapping(x, self.fn, self.base, self.scale)
        return weighted_stream_sum(h_pre.to(x.dtype), x), h_post, c

    mix = staticmethod(mix_streams)

    def sublayer(self, x: torch.Tensor, function, recompute: bool = False) -> torch.Tensor:
        """``X' = mix(X, function(u), H_post, C)``; with ``recompute`` the backward keeps X and
        y only and recomputes the mapping from X (the same numbers)."""
        if not recompute or not torch.is_grad_enabled():
            u, h_post, c = self(x)
            return self.mix(x, function(u), h_post, c)
        _check_streams(x, self.num_streams, self.hidden_size, "HyperConnection")
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
        _check_streams(x, self.num_streams, self.hidden_size, "HyperHead")
        return weighted_stream_sum(self.weights(x).to(x.dtype), x)

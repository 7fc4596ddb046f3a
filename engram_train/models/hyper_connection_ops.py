"""The mHC mappings' arithmetic (``docs/mhc.md``), in plain torch: the normalized projection of
the streams, the Sinkhorn projection, and the collapse and write-back of the streams, each with
its hand-written backward. ``models/hyper_connection.py`` builds the modules from these.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from engram_train.errors import InputError

HC_EPS = 1e-6
"""``eps_hc``: added to H_pre, C and the Sinkhorn denominators (DeepSeek-V4)."""

BATCHED_MIX_MIN_HIDDEN = 128
"""Hidden size from which the write-back runs as one batched GEMM per token on the CPU (below
it, n broadcast multiply-adds are faster; on CUDA always the GEMM)."""


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


def check_streams(x: torch.Tensor, num_streams: int, hidden_size: int, who: str) -> None:
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


def mix_backward(x, y, h_post, d, grad):
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

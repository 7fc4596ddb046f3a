"""DeepSeek-V4.1's single-pass mHC: one projection per sublayer, whose ``pre`` part is the
*next* sublayer's collapse.

The mapping of a sublayer is DeepSeek-V4's (``models/hyper_connection.py``, ``docs/mhc.md``),
computed from the streams the sublayer receives, ``X [s, b, n, h]``::

    m            = rmsnorm(X.reshape(s, b, n*h).float()) @ fn.T      # no weight, eps rms_norm_eps
    pre, post, C = sigmoid(scale[0] m_pre + base_pre) + hc_eps,
                   2 sigmoid(scale[1] m_post + base_post),
                   sinkhorn(scale[2] m_res + base_res)

the same arithmetic as the project's mHC (`normalized_projection`, `sinkhorn`), written here in
the released reference's order of operations (project, then scale by the inverse RMS; the
Sinkhorn sums over a matrix's rows and columns; autograd's backward): V4.1's fake quantization
turns a last-bit difference upstream into another FP4/FP8 code now and then, so the blocks keep
the reference's bits (forward and stream gradients bitwise equal to NeMo Automodel's; the
parameters' gradients sum over the tokens sequence-first, NeMo's batch-first, a last-bit
difference: docs/deepseek-v41.md, 'Exact against NeMo'). What V4.1 changes is
which ``pre`` collapses the streams: the attention sublayer of a layer reads ``sum_j pre[j] X[j]``
with the ``pre`` of the sublayer *before* it (the previous layer's MoE; a one-hot on stream 0 at
the first layer, `first_pre`), the MoE sublayer reads its streams with the attention sublayer's
``pre``, and the model's last collapse uses the last MoE sublayer's ``pre``: there is no
``hc_head``. The write-back is the same: ``X'[k] = post[k] y + sum_j C[j, k] X[j]``; collapse and
write-back run in float32 and round once to the streams' dtype.

Activation memory: the mapping and the collapse are recomputed in the backward (`recomputed`),
so a sublayer's mHC keeps the streams X and the sublayer's output y in their own dtype plus the
float32 coefficients (``(n + 1) h`` elements and ``(2 + n) n`` floats per token): docs/mhc.md's
saved-bytes rule.

Parameters ``fn [(2+n) n, n h]``, ``base [(2+n) n]``, ``scale [3]`` (float32, the checkpoint's
names and shapes: ``attn_hc``/``ffn_hc`` of a layer); V4.1 starts at ``fn`` normal(0, std),
``base`` 0, ``scale`` 1. Replicated under tensor parallelism.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from engram_train.errors import InputError


class DeepseekV41Mix(NamedTuple):
    """A sublayer's float32 coefficients: ``pre``/``post`` ``[s, b, n]``, ``comb``
    ``[s, b, n (from), n (to)]``."""

    pre: torch.Tensor
    post: torch.Tensor
    comb: torch.Tensor


def sinkhorn(logits: torch.Tensor, iterations: int, eps: float) -> torch.Tensor:
    """The doubly stochastic ``comb`` from ``[..., n (from), n (to)]`` logits, in the released
    reference's order of operations: a softmax over each row, then a column and a row
    normalisation alternately (``iterations`` column steps). The project mHC's `sinkhorn`
    computes the same in a tokens-last layout; its sums round differently in the last bit,
    and V4.1's fake quantization downstream turns a last-bit difference into a different FP4
    or FP8 code now and then, so V4.1 keeps the reference's order (autograd's backward)."""
    x = logits.softmax(dim=-1) + eps
    x = x / (x.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iterations - 1):
        x = x / (x.sum(dim=-1, keepdim=True) + eps)
        x = x / (x.sum(dim=-2, keepdim=True) + eps)
    return x


def first_pre(streams: torch.Tensor) -> torch.Tensor:
    """The ``pre`` of the first collapse: stream 0 alone, float32 ``[s, b, n]``."""
    pre = streams.new_zeros(streams.shape[:-1], dtype=torch.float32)
    pre[..., 0] = 1
    return pre


def _collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    return (pre.unsqueeze(-1) * streams.float()).sum(2).to(streams.dtype)


def collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``sum_j pre[j] X[j]``: ``[s, b, n, h]``, float32 ``[s, b, n]`` -> ``[s, b, h]`` in the
    streams' dtype. Under autograd recomputed in the backward (`recomputed`)."""
    return recomputed(_collapse, streams, pre)


def recomputed(function, *args):
    """``function(*args)``, its graph rebuilt in the backward from the saved arguments (torch's
    non-reentrant checkpoint) when autograd records: the forward's operations run twice (the
    same bits), and the backward keeps the streams in their own dtype, not the float32 copy the
    reference's arithmetic makes (module docstring, 'Activation memory')."""
    if not torch.is_grad_enabled():
        return function(*args)
    from torch.utils.checkpoint import checkpoint

    return checkpoint(function, *args, use_reentrant=False)


def expand(output: torch.Tensor, streams: torch.Tensor, mix: DeepseekV41Mix) -> torch.Tensor:
    """``X'[k] = post[k] y + sum_j comb[j, k] X[j]`` in float32, in the output's dtype."""
    update = mix.post.unsqueeze(-1) * output.unsqueeze(-2)
    mixed = (mix.comb.unsqueeze(-1) * streams.unsqueeze(-2)).sum(2)
    return (update + mixed).to(output.dtype)


class DeepseekV41HyperConnection(nn.Module):
    """One sublayer's mapping: ``forward(X [s, b, n, h])`` -> `DeepseekV41Mix`."""

    def __init__(self, hidden_size: int, hc_mult: int, sinkhorn_iters: int = 20,
                 hc_eps: float = 1e-6, norm_eps: float = 1e-20, init_std: float = 0.02,
                 device=None):
        super().__init__()
        if hc_mult < 1 or sinkhorn_iters < 1:
            raise InputError(f"hc_mult={hc_mult} and hc_sinkhorn_iters={sinkhorn_iters} must "
                             "be >= 1.")
        n = self.num_streams = int(hc_mult)
        self.hidden_size, self.iterations = int(hidden_size), int(sinkhorn_iters)
        self.eps, self.norm_eps = float(hc_eps), float(norm_eps)
        factory = {"device": device, "dtype": torch.float32}
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * hidden_size, **factory))
        self.base = nn.Parameter(torch.empty((2 + n) * n, **factory))
        self.scale = nn.Parameter(torch.empty(3, **factory))
        self.reset_parameters(init_std)

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        nn.init.normal_(self.fn, mean=0.0, std=std)
        self.base.zero_()
        self.scale.fill_(1.0)

    def forward(self, streams: torch.Tensor) -> DeepseekV41Mix:
        n, h = self.num_streams, self.hidden_size
        if streams.ndim != 4 or streams.shape[2:] != (n, h):
            raise InputError(f"the mHC streams are [s, b, {n}, {h}], got {tuple(streams.shape)}.")
        return DeepseekV41Mix(*recomputed(self._mapping, streams))

    def _mapping(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = self.num_streams
        flat = streams.flatten(2).float()  # project, then scale by the inverse RMS
        projected = F.linear(flat, self.fn.float()) * torch.rsqrt(
            flat.square().mean(-1, keepdim=True) + self.norm_eps)
        scale = self.scale.float()  # one per part, expanded as the reference does
        scales = torch.cat((scale[0].expand(n), scale[1].expand(n), scale[2].expand(n * n)))
        z = torch.addcmul(self.base.float(), projected, scales)
        gates = torch.sigmoid(z[..., : 2 * n])
        comb = sinkhorn(z[..., 2 * n:].unflatten(-1, (n, n)), self.iterations, self.eps)
        return gates[..., :n] + self.eps, 2 * gates[..., n:], comb

"""mHC (manifold-constrained hyper-connections): the modules against an independent float64 oracle.

The oracle below transcribes DeepSeek's mHC spec in float64 with plain torch ops (nothing from
the module under test): an unweighted RMSNorm over the flattened streams, one linear map to the
(2 + n) * n mapping logits, sigmoid gates H_pre / H_post, and a Sinkhorn-normalised residual
mixing matrix C (softmax over rows, then column / row / column ... normalisation). Float32
modules must agree with it to ~1e-5 relative (normwise), gradients included (torch.autograd
through the oracle). The modules compute the mappings in float32 whatever the parameters' dtype
(the spec's ``.float()``), so there is no float64 module to compare more tightly; instead one
case uses large eps / norm_eps, so that every eps term of the spec shows well above 1e-5.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from engram_train.models import hyper_connection_ops
from engram_train.models.hyper_connection import HyperConnection, HyperHead, mixing_weights

S, B, H = 3, 2, 16  # sequence, micro-batch and hidden sizes: small, the math is per token
RTOL32 = 1e-5  # float32 module vs float64 oracle, relative to the largest reference entry


# ---------------------------------------------------------------- float64 oracle (the spec)


def ref_rmsnorm(x: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """Unweighted RMSNorm over the last dimension."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + norm_eps)


def ref_sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """softmax over rows + eps, normalise columns, then iters - 1 rounds of (rows, columns)."""
    c = torch.softmax(logits, dim=-1) + eps
    c = c / (c.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + eps)
        c = c / (c.sum(dim=-2, keepdim=True) + eps)
    return c


def ref_connection(X, fn, base, scale, *, iters=20, eps=1e-6, norm_eps=1e-6):
    """One sublayer's mapping: (u [s,b,h], H_post [s,b,n], C [s,b,n,n]), C[j,k]: stream j -> k."""
    s, b, n, h = X.shape
    r = ref_rmsnorm(X.reshape(s, b, n * h), norm_eps)
    m = r @ fn.T
    m_pre, m_post, m_res = m.split([n, n, n * n], dim=-1)
    b_pre, b_post, b_res = base.split([n, n, n * n])
    h_pre = torch.sigmoid(scale[0] * m_pre + b_pre) + eps
    h_post = 2 * torch.sigmoid(scale[1] * m_post + b_post)
    C = ref_sinkhorn(scale[2] * m_res.reshape(s, b, n, n) + b_res.reshape(n, n), iters, eps)
    u = (h_pre.unsqueeze(-1) * X).sum(dim=2)
    return u, h_post, C


def ref_mix(X, y, h_post, C):
    """X'[k] = H_post[k] * y + sum_j C[j, k] * X[j]."""
    return h_post.unsqueeze(-1) * y.unsqueeze(2) + torch.einsum("sbjk,sbjh->sbkh", C, X)


def ref_head(X, hc_fn, hc_base, hc_scale, *, eps=1e-6, norm_eps=1e-6):
    """Head collapse: out = sum_j (sigmoid(hc_scale * (r @ hc_fn.T) + hc_base) + eps)[j] X[j]."""
    s, b, n, h = X.shape
    r = ref_rmsnorm(X.reshape(s, b, n * h), norm_eps)
    w = torch.sigmoid(hc_scale * (r @ hc_fn.T) + hc_base) + eps
    return (w.unsqueeze(-1) * X).sum(dim=2)


# ---------------------------------------------------------------- helpers


def assert_close(actual, expected, rtol, what=""):
    """Normwise: max |actual - expected| <= rtol * max(|expected|, 1)."""
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    err = (actual.double() - expected.double()).abs().max().item()
    bound = rtol * max(expected.abs().max().item(), 1.0)
    assert err <= bound, f"{what}: max error {err:.3e} > {bound:.3e}"


def randomize_connection(hc: HyperConnection, seed: int) -> None:
    """Non-trivial mapping: scales ~ U(0.5, 2), biases ~ N(0, 1), fn ~ N(0, 0.1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        hc.fn.copy_(0.1 * torch.randn(hc.fn.shape, generator=g, dtype=torch.float64))
        hc.base.copy_(torch.randn(hc.base.shape, generator=g, dtype=torch.float64))
        hc.scale.copy_(0.5 + 1.5 * torch.rand(hc.scale.shape, generator=g, dtype=torch.float64))


def randomize_head(head: HyperHead, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.hc_fn.copy_(0.1 * torch.randn(head.hc_fn.shape, generator=g, dtype=torch.float64))
        head.hc_base.copy_(torch.randn(head.hc_base.shape, generator=g, dtype=torch.float64))
        head.hc_scale.copy_(
            0.5 + 1.5 * torch.rand(head.hc_scale.shape, generator=g, dtype=torch.float64)
        )


def random_streams(n: int, seed: int, dtype=torch.float32, h: int = H) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randn(S, B, n, h, generator=g, dtype=torch.float64).to(dtype)


def oracle_params(module, names):
    """float64 leaf copies of the module's parameters, for autograd through the oracle."""
    return [getattr(module, name).detach().double().requires_grad_() for name in names]


# Constructor arguments: the defaults, and non-default ones that the module must honour
# (norm_eps = 0.5 is comparable to mean(x**2) ~ 1, so it changes r visibly).
CONNECTION_CASES = [
    pytest.param(2, {}, id="n2-defaults"),
    pytest.param(4, {}, id="n4-defaults"),
    pytest.param(4, dict(sinkhorn_iterations=3, eps=1e-3, norm_eps=0.5), id="n4-iters3-eps"),
]


def oracle_kwargs(kwargs):
    return dict(
        iters=kwargs.get("sinkhorn_iterations", 20),
        eps=kwargs.get("eps", 1e-6),
        norm_eps=kwargs.get("norm_eps", 1e-6),
    )


# ---------------------------------------------------------------- 1. forward


def test_parameter_shapes():
    """Parameter shapes from the spec: fn [(2+n)n, nh], base [(2+n)n], scale [3];
    the head's hc_fn [n, nh], hc_base [n], hc_scale [1]."""
    n = 4
    hc = HyperConnection(H, n)
    assert tuple(hc.fn.shape) == ((2 + n) * n, n * H)
    assert tuple(hc.base.shape) == ((2 + n) * n,)
    assert tuple(hc.scale.shape) == (3,)
    head = HyperHead(H, n)
    assert tuple(head.hc_fn.shape) == (n, n * H)
    assert tuple(head.hc_base.shape) == (n,)
    assert tuple(head.hc_scale.shape) == (1,)


@pytest.mark.parametrize("n, kwargs", CONNECTION_CASES)
def test_connection_forward_matches_oracle(n, kwargs):
    """HyperConnection.forward (u, H_post, C) and mix, float32, vs the float64 oracle."""
    hc = HyperConnection(H, n, **kwargs)
    randomize_connection(hc, seed=n)
    X = random_streams(n, seed=n)
    y = random_streams(1, seed=50 + n)[:, :, 0]

    u, h_post, C = hc(X)
    assert u.shape == (S, B, H) and h_post.shape == (S, B, n) and C.shape == (S, B, n, n)
    assert u.dtype == h_post.dtype == C.dtype == torch.float32

    ref_u, ref_post, ref_C = ref_connection(
        X.double(), hc.fn.double(), hc.base.double(), hc.scale.double(), **oracle_kwargs(kwargs)
    )
    assert_close(u, ref_u, RTOL32, "u")
    assert_close(h_post, ref_post, RTOL32, "H_post")
    assert_close(C, ref_C, RTOL32, "C")

    mixed = hc.mix(X, y, h_post, C)
    assert mixed.shape == X.shape and mixed.dtype == torch.float32
    assert_close(mixed, ref_mix(X.double(), y.double(), ref_post, ref_C), RTOL32, "mix")


def test_mix_orientation_by_hand():
    """mix with C a permutation matrix (C[j, k] = 1 iff k = perm[j]) moves stream j to perm[j]
    (to one float32 rounding: the mix adds ``(C - I)^T X`` to X)."""
    n = 4
    perm = [2, 0, 3, 1]
    hc = HyperConnection(H, n)
    X = random_streams(n, seed=7)
    y = torch.zeros(S, B, H)
    C = torch.zeros(S, B, n, n)
    for j, k in enumerate(perm):
        C[:, :, j, k] = 1.0
    out = hc.mix(X, y, torch.zeros(S, B, n), C)
    for j, k in enumerate(perm):
        torch.testing.assert_close(out[:, :, k], X[:, :, j], rtol=0, atol=2.5e-7)
    # H_post scales y onto each stream independently.
    h_post = torch.tensor([0.5, 1.0, 1.5, 2.0]).expand(S, B, n)
    y = random_streams(1, seed=8)[:, :, 0]
    out = hc.mix(torch.zeros_like(X), y, h_post, torch.zeros_like(C))
    for k in range(n):
        torch.testing.assert_close(out[:, :, k], h_post[0, 0, k] * y, rtol=0, atol=0)


@pytest.mark.parametrize("n", [2, 4])
def test_head_forward_matches_oracle(n):
    """HyperHead.forward, float32, vs the float64 oracle."""
    head = HyperHead(H, n)
    randomize_head(head, seed=10 + n)
    X = random_streams(n, seed=20 + n)
    out = head(X)
    assert out.shape == (S, B, H) and out.dtype == torch.float32
    ref = ref_head(X.double(), head.hc_fn.double(), head.hc_base.double(), head.hc_scale.double())
    assert_close(out, ref, RTOL32, "head")


def test_head_honours_eps_arguments():
    """HyperHead(eps=, norm_eps=) reach the math: compared to the oracle with the same values."""
    n = 4
    head = HyperHead(H, n, eps=1e-2, norm_eps=0.5)
    randomize_head(head, seed=3)
    X = random_streams(n, seed=3)
    ref = ref_head(
        X.double(), head.hc_fn.double(), head.hc_base.double(), head.hc_scale.double(),
        eps=1e-2, norm_eps=0.5,
    )
    assert_close(head(X), ref, RTOL32, "head")


# ---------------------------------------------------------------- 2. backward


def connection_loss_and_grads(hc, X, y, weights, *, oracle_kwargs_=None):
    """Scalar loss <w, u> + <w, H_post> + <w, C> + <w, mix>; gradients w.r.t. X, y and params.

    With oracle_kwargs_ the oracle (float64 copies) is differentiated, otherwise the module.
    """
    names = ["fn", "base", "scale"]
    X = X.detach().clone().requires_grad_()
    y = y.detach().clone().requires_grad_()
    if oracle_kwargs_ is None:
        hc.zero_grad(set_to_none=True)
        u, h_post, C = hc(X)
        mixed = hc.mix(X, y, h_post, C)
        params = [getattr(hc, name) for name in names]
    else:
        params = oracle_params(hc, names)
        u, h_post, C = ref_connection(X, *params, **oracle_kwargs_)
        mixed = ref_mix(X, y, h_post, C)
    w_u, w_p, w_c, w_m = (w.to(u.dtype) for w in weights)
    loss = (w_u * u).sum() + (w_p * h_post).sum() + (w_c * C).sum() + (w_m * mixed).sum()
    grads = torch.autograd.grad(loss, [X, y, *params])
    return dict(zip(["X", "y", *names], grads))


def loss_weights(n, seed):
    g = torch.Generator().manual_seed(seed)
    shapes = [(S, B, H), (S, B, n), (S, B, n, n), (S, B, n, H)]
    return [torch.randn(shape, generator=g, dtype=torch.float64) for shape in shapes]


@pytest.mark.parametrize("n, kwargs", CONNECTION_CASES)
def test_connection_backward_matches_oracle(n, kwargs):
    """Gradients (X, y, fn, base, scale) of the float32 module vs autograd through the oracle."""
    hc = HyperConnection(H, n, **kwargs)
    randomize_connection(hc, seed=30 + n)
    X = random_streams(n, seed=30 + n)
    y = random_streams(1, seed=60 + n)[:, :, 0]
    weights = loss_weights(n, seed=n)

    got = connection_loss_and_grads(hc, X, y, weights)
    want = connection_loss_and_grads(
        hc, X.double(), y.double(), weights, oracle_kwargs_=oracle_kwargs(kwargs)
    )
    for name in want:
        assert got[name].dtype == torch.float32, name
        assert_close(got[name], want[name], RTOL32, f"d loss / d {name}")


def head_grads(head, X, w, oracle: bool):
    names = ["hc_fn", "hc_base", "hc_scale"]
    X = X.detach().clone().requires_grad_()
    if oracle:
        params = oracle_params(head, names)
        out = ref_head(X, *params)
    else:
        head.zero_grad(set_to_none=True)
        params = [getattr(head, name) for name in names]
        out = head(X)
    grads = torch.autograd.grad((w.to(out.dtype) * out).sum(), [X, *params])
    return dict(zip(["X", *names], grads))


@pytest.mark.parametrize("n", [2, 4])
def test_head_backward_matches_oracle(n):
    """HyperHead gradients (X, hc_fn, hc_base, hc_scale), float32, vs autograd on the oracle."""
    head = HyperHead(H, n)
    randomize_head(head, seed=90 + n)
    X = random_streams(n, seed=90 + n)
    w = torch.randn(S, B, H, generator=torch.Generator().manual_seed(n), dtype=torch.float64)

    want = head_grads(head, X.double(), w, oracle=True)
    got = head_grads(head, X, w, oracle=False)
    for name in want:
        assert got[name].dtype == torch.float32, name
        assert_close(got[name], want[name], RTOL32, f"d loss / d {name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [None, 1])
def test_normalized_projection_matches_oracle(dtype, chunk, monkeypatch):
    """The mappings' logits ``rms_norm(X) @ fn.T``, computed as ``rsqrt(mean X^2) * (X @ fn.T)``
    chunk by chunk with a hand-written backward: value and gradients (X in its dtype, fn) vs
    autograd through the oracle's ``ref_rmsnorm``, whole and in chunks of one token."""
    if chunk is not None:
        monkeypatch.setitem(hyper_connection_ops.TOKEN_CHUNK_ELEMENTS, "cpu", chunk)
    n = 4
    g = torch.Generator().manual_seed(11)
    x = (3 * torch.randn(S, B, n * H, generator=g)).to(dtype).requires_grad_()
    fn = (0.1 * torch.randn(24, n * H, generator=g)).requires_grad_()
    w = torch.randn(S, B, 24, generator=g, dtype=torch.float64)
    got = hyper_connection_ops.normalized_projection(x, fn, 1e-3)
    assert got.dtype == torch.float32
    got_grads = torch.autograd.grad((got * w).sum(), [x, fn])
    x64, fn64 = (t.detach().double().requires_grad_() for t in (x, fn))
    want = ref_rmsnorm(x64, 1e-3) @ fn64.T
    want_grads = torch.autograd.grad((want * w).sum(), [x64, fn64])
    assert_close(got, want, RTOL32, "projection")
    assert got_grads[0].dtype == dtype
    rtol_x = RTOL32 if dtype == torch.float32 else 1e-2  # dX rounded to bf16 once
    assert_close(got_grads[0], want_grads[0], rtol_x, "d / d X")
    assert_close(got_grads[1], want_grads[1], RTOL32, "d / d fn")


# ---------------------------------------------------------------- 3. Sinkhorn


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize(
    "logit_gain, iterations",
    [(0.5, 20), (1.0, 200)],
    ids=["moderate-logits-20-iters", "full-logits-200-iters"],
)
def test_sinkhorn_doubly_stochastic(n, seed, logit_gain, iterations):
    """Every token's C is positive and its columns (normalized last) and rows sum to 1 (1e-5).

    Sinkhorn's row error shrinks per iteration by a factor that approaches 1 as the logits
    spread (a 2x2 token with logits 2.8, 0.1 / -1.1, 2.6 still has 1.4e-3 after 20 iterations,
    in float64 too), so: 20 iterations for moderate logits (the random parameters of the
    forward tests with the C logits' scale and bias halved), 200 for the unhalved ones.
    """
    hc = HyperConnection(H, n, sinkhorn_iterations=iterations)
    randomize_connection(hc, seed=100 + seed)
    with torch.no_grad():
        hc.scale[2] *= logit_gain
        hc.base[2 * n:] *= logit_gain
    _, _, C = hc(random_streams(n, seed=100 + seed))
    assert (C > 0).all()
    ones = torch.ones(S, B, n)
    torch.testing.assert_close(C.sum(dim=-2), ones, rtol=0, atol=1e-5)  # columns
    torch.testing.assert_close(C.sum(dim=-1), ones, rtol=0, atol=1e-5)  # rows


# ---------------------------------------------------------------- 4. init


@pytest.mark.parametrize("n", [2, 4])
def test_reset_parameters_values(n):
    """reset_parameters: scale = gating factor, b_pre = -log(n-1), b_post = 0, b_res = big negative
    off the diagonal and 0 on it; fn / hc_fn ~ N(0, std); the head likewise."""
    torch.manual_seed(n)
    hc = HyperConnection(H, n)
    hc.reset_parameters(gating_factor=0.01, std=0.02)
    torch.testing.assert_close(hc.scale.detach(), torch.full((3,), 0.01))
    b_pre, b_post, b_res = hc.base.detach().split([n, n, n * n])
    torch.testing.assert_close(b_pre, torch.full((n,), -math.log(n - 1)))
    torch.testing.assert_close(b_post, torch.zeros(n))
    b_res = b_res.view(n, n)
    off = ~torch.eye(n, dtype=torch.bool)
    torch.testing.assert_close(b_res.diagonal(), torch.zeros(n))
    assert (b_res[off] == b_res[off][0]).all() and b_res[off][0] <= -5, b_res  # one large negative
    assert hc.fn.abs().max() > 0 and abs(hc.fn.std().item() - 0.02) < 0.2 * 0.02

    head = HyperHead(H, n)
    head.reset_parameters(gating_factor=0.01, std=0.02)
    torch.testing.assert_close(head.hc_scale.detach(), torch.full((1,), 0.01))
    torch.testing.assert_close(head.hc_base.detach(), torch.full((n,), -math.log(n - 1)))
    assert head.hc_fn.abs().max() > 0 and abs(head.hc_fn.std().item() - 0.02) < 0.3 * 0.02


@pytest.mark.parametrize("n", [2, 4])
def test_init_is_identity_on_identical_streams(n):
    """gating_factor=0 and identical streams X[j] = x: u == x, H_post == 1, C doubly stochastic
    and diagonal-dominant, mix gives x + y on every stream, the head returns x (all up to
    ~n * eps_hc relative: H_pre = 1/n + eps_hc)."""
    hc = HyperConnection(H, n)
    hc.reset_parameters(gating_factor=0.0)
    x = random_streams(1, seed=200 + n)[:, :, 0]
    y = random_streams(1, seed=300 + n)[:, :, 0]
    X = x.unsqueeze(2).expand(S, B, n, H).contiguous()

    u, h_post, C = hc(X)
    tol = 2 * n * 1e-6
    torch.testing.assert_close(u, x, rtol=tol, atol=tol)
    torch.testing.assert_close(h_post, torch.ones(S, B, n), rtol=0, atol=1e-6)
    torch.testing.assert_close(C, torch.eye(n).expand(S, B, n, n), rtol=0, atol=1e-2)
    torch.testing.assert_close(hc.mix(X, y, h_post, C), (x + y).unsqueeze(2).expand_as(X),
                               rtol=tol, atol=tol)

    head = HyperHead(H, n)
    head.reset_parameters(gating_factor=0.0)
    torch.testing.assert_close(head(X), x, rtol=tol, atol=tol)


@pytest.mark.parametrize("n", [2, 4])
def test_init_residual_mixing_is_identity_to_eps(n):
    """The init's C: the identity up to the off-diagonal bias (b_res = -8 off the diagonal, so
    each off-diagonal entry is about exp(-8) ~ 3.4e-4, plus the eps_hc floor): close to a plain
    residual per stream, with mixing gradients that are not saturated away."""
    hc = HyperConnection(H, n)
    hc.reset_parameters(gating_factor=0.0)
    _, _, C = hc(random_streams(n, seed=250 + n))
    off = ~torch.eye(n, dtype=torch.bool).expand(S, B, n, n)
    expected = math.exp(-8.0) / (1 + (n - 1) * math.exp(-8.0))
    assert torch.allclose(C[off], torch.full_like(C[off], expected), rtol=0.02, atol=2e-6)
    assert (C[~off] > 1 - n * 4e-4).all()


# ---------------------------------------------------------------- 5. bf16


@pytest.mark.parametrize("n", [2, 4])
def test_bf16_streams(n):
    """bf16 X: H_post and C are float32 and match the oracle to float32 accuracy (the mapping math
    is float32); u and mix are bf16 and match the oracle within bf16 rounding; so does the head."""
    hc = HyperConnection(H, n)
    randomize_connection(hc, seed=400 + n)
    X = random_streams(n, seed=400 + n, dtype=torch.bfloat16)
    y = random_streams(1, seed=500 + n, dtype=torch.bfloat16)[:, :, 0]
    X64 = X.double()  # the oracle sees exactly the bf16 values

    u, h_post, C = hc(X)
    assert u.dtype == torch.bfloat16 and h_post.dtype == C.dtype == torch.float32
    ref_u, ref_post, ref_C = ref_connection(
        X64, hc.fn.double(), hc.base.double(), hc.scale.double()
    )
    assert_close(h_post, ref_post, RTOL32, "H_post")
    assert_close(C, ref_C, RTOL32, "C")
    assert_close(u, ref_u, 2e-2, "u (bf16)")

    mixed = hc.mix(X, y, h_post, C)
    assert mixed.dtype == torch.bfloat16 and mixed.shape == X.shape
    assert_close(mixed, ref_mix(X64, y.double(), ref_post, ref_C), 2e-2, "mix (bf16)")

    head = HyperHead(H, n)
    randomize_head(head, seed=600 + n)
    out = head(X)
    assert out.dtype == torch.bfloat16 and out.shape == (S, B, H)
    ref = ref_head(X64, head.hc_fn.double(), head.hc_base.double(), head.hc_scale.double())
    assert_close(out, ref, 2e-2, "head (bf16)")


# ---------------------------------------------------------------- 6. shape errors

N_ERR, H_ERR = 5, 24  # distinctive sizes (not S or B), so the message can be checked for them


@pytest.mark.parametrize(
    "shape",
    [(S, B, H_ERR), (S, B, N_ERR + 1, H_ERR), (S, B, N_ERR, H_ERR + 1), (S, N_ERR, H_ERR)],
    ids=["no-stream-dim", "wrong-n", "wrong-h", "3d-with-n"],
)
@pytest.mark.parametrize("cls", [HyperConnection, HyperHead])
def test_wrong_shape_raises(cls, shape):
    """A wrong X shape raises ValueError whose message names the expected n and h."""
    module = cls(H_ERR, N_ERR)
    with pytest.raises(ValueError) as info:
        module(torch.randn(shape))
    message = str(info.value)
    assert re.search(rf"\b{N_ERR}\b", message) and re.search(rf"\b{H_ERR}\b", message), message


@pytest.mark.parametrize("n", [2, 4])
def test_both_write_back_paths_agree(n, monkeypatch):
    """The write-back runs as n broadcast multiply-adds (small h on CPU) or as one batched GEMM
    per token (large h, CUDA): both equal the float64 sum, forward and backward."""
    g = torch.Generator().manual_seed(77 + n)
    x = torch.randn(S, B, n, H, generator=g)
    y = torch.randn(S, B, H, generator=g)
    h_post = torch.rand(S, B, n, generator=g) * 2
    c = torch.rand(S, B, n, n, generator=g)
    probe = torch.randn(S, B, n, H, generator=g)
    want = h_post.double().unsqueeze(-1) * y.double().unsqueeze(-2) + torch.einsum(
        "sbjk,sbjh->sbkh", c.double(), x.double())
    grads = []
    for threshold in (1, 10**9):  # batched GEMM, then the multiply-adds
        monkeypatch.setattr(hyper_connection_ops, "BATCHED_MIX_MIN_HIDDEN", threshold)
        leaves = [t.clone().requires_grad_() for t in (x, y, h_post, c)]
        out = HyperConnection.mix(*leaves)
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)
        (out * probe).sum().backward()
        grads.append([t.grad for t in leaves])
    for batched, looped in zip(*grads):
        torch.testing.assert_close(batched, looped, rtol=1e-5, atol=1e-6)


# ------------------------------------------------- recompute, bf16 mixing, saved activations


def _sublayer_run(hc, lin, x0, recompute):
    """One sublayer (mapping, a linear + tanh as F, write-back) forward and backward."""
    hc.zero_grad()
    lin.zero_grad()
    x = x0.clone().requires_grad_()
    out = hc.sublayer(x, lambda u: torch.tanh(lin(u)), recompute)
    (out.float().square() * torch.linspace(0.5, 1.5, out.shape[-1])).sum().backward()
    return [out.detach(), x.grad, hc.fn.grad, hc.base.grad, hc.scale.grad, lin.weight.grad]


@pytest.mark.parametrize("h,chunk", [(16, None), (256, None), (16, 4 * 16 * B)])
def test_recompute_gives_the_same_numbers(h, chunk, monkeypatch):
    """The recomputed mapping and the hand-written write-back backward equal autograd through
    the stored mapping (float32: to rounding); both write-back paths (broadcast, batched), and
    the projection in chunks of one position."""
    if chunk is not None:
        monkeypatch.setitem(hyper_connection_ops.TOKEN_CHUNK_ELEMENTS, "cpu", chunk)
        assert len(hyper_connection_ops._token_chunks(torch.empty(S, B, 4 * h))) == S > 1
    torch.manual_seed(3)
    hc = HyperConnection(h, 4)
    with torch.no_grad():  # away from the init so every gradient is large
        hc.scale.fill_(0.7)
        hc.base.normal_()
    lin = torch.nn.Linear(h, h)
    x0 = torch.randn(S, B, 4, h)
    stored, recomputed = (_sublayer_run(hc, lin, x0, r) for r in (False, True))
    for name, a, b in zip(["out", "x", "fn", "base", "scale", "F"], stored, recomputed):
        assert (a - b).abs().max() <= 1e-6 * a.abs().max(), name


class SavedBytes:
    """Bytes saved for backward inside the context (``saved_tensors_hooks``), each storage
    once, parameters left out (they are kept anyway, not per token)."""

    def __init__(self, params):
        self.params = {p.data_ptr() for p in params}
        self.storages = {}

    def pack(self, t):
        if t.data_ptr() not in self.params:
            storage = t.untyped_storage()
            self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)

    @property
    def total(self):
        return sum(self.storages.values())


def saved_bytes_per_token(n, h, dtype, recompute):
    """Saved bytes per token of one mapping and its write-back (the sublayer F excluded)."""
    s, b = 32, 2
    hc = HyperConnection(h, n)
    x = torch.randn(s, b, n, h, dtype=dtype, requires_grad=True) * 1
    lin = torch.nn.Linear(h, h, dtype=dtype)
    counter = SavedBytes(hc.parameters())

    def f(u):  # the sublayer itself: its saved tensors are not the mapping's
        counter.__exit__(None, None, None)
        y = lin(u)
        counter.__enter__()
        return y

    with counter:
        hc.sublayer(x, f, recompute)
    return counter.total / (s * b)


@pytest.mark.parametrize("n", [2, 4])
def test_recompute_keeps_only_x_and_the_sublayer_output(n):
    """With recompute, one sublayer's mapping keeps X (n x h) and F's output (h) in the model
    dtype: (n + 1) x h x 2 bytes per token under bf16; without, also the float32 gates and
    the Sinkhorn's 2T - 1 intermediate n x n matrices (no n x h float32 copy either way)."""
    h = 64
    bound = (n + 1) * h * 2
    recomputed = saved_bytes_per_token(n, h, torch.bfloat16, True)
    assert recomputed <= bound, (recomputed, bound)
    assert recomputed == bound  # X and y are needed: the bound is tight
    extra = [saved_bytes_per_token(n, width, torch.bfloat16, False) - (n + 1) * width * 2
             for width in (h, 2 * h)]
    assert extra[0] >= (2 * 20 - 1) * n * n * 4, extra
    assert extra[0] == extra[1], extra  # per token, whatever the hidden size


def test_head_keeps_only_x_and_its_weights():
    """HyperHead's backward keeps X (bf16) and O(n) float32 values per token, no float32 copy of
    the streams or of their normalization (the projection's hand-written backward)."""
    n, s, b = 4, 32, 2
    kept = []
    for h in (64, 128):
        head = HyperHead(h, n)
        x = torch.randn(s, b, n, h, dtype=torch.bfloat16, requires_grad=True)
        counter = SavedBytes(head.parameters())
        with counter:
            head(x)
        kept.append(counter.total / (s * b) - n * h * 2)
    assert kept[0] == kept[1] <= 16 * n, kept  # the same few values per token at any width


def _growth(weights, sublayers=100, n=4, h=64):
    """Residual growth per sublayer over ``sublayers`` identity-initialized write-backs (F = 0)
    whose weights ``weights(c)`` (``[s, b, n, n]``, ``C^T``'s stand-in) are rounded as the bf16
    model rounds them, the streams kept in float32 (so only the weights' rounding shows): the
    size of the sum over the streams, which a doubly stochastic mix preserves."""
    torch.manual_seed(0)
    hc = HyperConnection(h, n)
    x = torch.randn(16, 2, n, h)
    start = x.sum(2).norm()
    with torch.no_grad():
        for _ in range(sublayers):
            _, _, c = hc(x)
            x = torch.matmul(weights(c).transpose(-1, -2), x)
    return (x.sum(2).norm() / start).item() ** (1 / sublayers) - 1


def test_bf16_mixing_keeps_the_residual_size():
    """C near the identity (diagonal ~0.999) rounds to 1.0 in bf16: ``C`` cast to bf16 has row
    sums ~1.001 and grows the residual ~1e-3 per sublayer; the write-back's weights ``C - I``
    in bf16 (added to X) keep C's sums: within 1e-4 per sublayer."""
    naive = _growth(lambda c: c.bfloat16().float())
    eye = torch.eye(4)
    ours = _growth(lambda c: mixing_weights(torch.ones(1), c, torch.bfloat16)[1].float() + eye)
    assert naive > 5e-4, naive
    assert abs(ours) <= 1e-4, ours
    assert abs(_growth(lambda c: c)) <= 1e-5  # float32: doubly stochastic to eps_hc


def test_mapping_needs_no_output_size_from_the_device():
    """The gating scales are spread over the logits by a precomputed index (no
    ``repeat_interleave`` with a tensor of repeats, which waits for the device)."""
    hc = HyperConnection(H, 4)
    assert hc._scale_index.tolist() == [0] * 4 + [1] * 4 + [2] * 16
    original = torch.Tensor.repeat_interleave

    def refuse(*args, **kwargs):
        raise AssertionError("repeat_interleave in the mapping")

    torch.Tensor.repeat_interleave = refuse
    try:
        x = random_streams(4, seed=1).requires_grad_()
        hc.sublayer(x, lambda u: u, True).sum().backward()
    finally:
        torch.Tensor.repeat_interleave = original

"""DeepSeek-V4.1's routed experts as megatron trains experts (docs/deepseek-v41.md 'MoE and
expert parallelism'): the grouped experts against the earlier loop (their oracle), one host
read per layer, the float32 router bias under bf16, auxiliary-loss-free load balancing, and
(one 4-rank launch, tests/dist/v41_experts.py, TP2 x EP2) the dispatch's bytes per routed pair,
the loads summed over the stage's ranks, and the plan's expert bytes against the model's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engram_train.models.deepseek_v41.v41_grouped_experts import reference_routed_experts
from engram_train.models.deepseek_v41.v41_moe import (
    DeepseekV41Experts,
    DeepseekV41MoE,
    DeepseekV41Router,
)

EXPERTS, TOP_K, HIDDEN, INTER, TOKENS = 8, 3, 32, 48, 64


def spec(**changes):
    return SimpleNamespace(**{**dict(
        n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K, hidden_size=HIDDEN,
        moe_intermediate_size=INTER, swiglu_limit=2.0, routed_scaling_factor=1.5,
        norm_topk_prob=True, moe_router_bias_update_rate=0.0, initializer_range=0.3), **changes})


def experts(dtype, seed=0):
    module = DeepseekV41Experts(spec(), dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for w in (module.w1, module.w3, module.w2):
            w.copy_(torch.randn(w.shape, generator=g) * 0.4)
    return module


def routing(case: str, g):
    chosen = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(TOKENS)])
    if case == "skewed":  # experts 2 and 5 get nothing, expert 0 every token
        chosen = torch.stack([torch.zeros(TOKENS, dtype=torch.long),
                              torch.randint(6, 8, (TOKENS,), generator=g),
                              torch.randint(3, 5, (TOKENS,), generator=g)], 1)
    if case == "masked":  # some tokens not routed, some single slots masked
        chosen[torch.rand(TOKENS, generator=g) < 0.3] = -1
        chosen[::7, 1] = -1
    if case == "none":
        chosen[:] = -1
    return chosen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("case", ["random", "skewed", "masked", "none"])
def test_grouped_experts_equal_the_loop(dtype, case):
    """Output bit for bit the loop's (the same per-expert GEMMs, each token's contributions added
    in float32 in ascending expert order); the gradients of the expert weights and routing
    weights bit for bit, the tokens' within float32 rounding (their pairs add in another order;
    under bf16 the grouped backward adds them in float32, the loop in bf16)."""
    g = torch.Generator().manual_seed(3)
    module = experts(dtype)
    x = (torch.randn(TOKENS, HIDDEN, generator=g) * 2).to(dtype)
    weights = torch.rand(TOKENS, TOP_K, generator=g)
    chosen = routing(case, g)
    upstream = torch.randn(TOKENS, HIDDEN, generator=g).to(dtype)
    leaves = [x.clone().requires_grad_(), weights.clone().requires_grad_()]
    ref_leaves = [x.clone().requires_grad_(), weights.clone().requires_grad_()]
    out = module(*leaves, chosen)
    params = [module.w1, module.w3, module.w2]
    ref = reference_routed_experts(*ref_leaves, chosen, *params, module.limit)
    assert torch.equal(out, ref)
    if case == "none":  # nothing routed: zeros, still in the graph (the exchanges' backward)
        assert not out.any() and out.requires_grad
        (out.float() * upstream.float()).sum().backward()
        assert not leaves[0].grad.any()
        assert leaves[1].grad is None or not leaves[1].grad.any()
        return
    if case != "none":  # the clamp is reached
        assert (x.float() @ module.w1.float().flatten(0, 1).t()).abs().max() > module.limit
    grads = torch.autograd.grad((out.float() * upstream.float()).sum(), [*leaves, *params],
                                allow_unused=True)
    ref_grads = torch.autograd.grad((ref.float() * upstream.float()).sum(),
                                    [*ref_leaves, *params], allow_unused=True)
    zeros = [torch.zeros_like(t) for t in (*leaves, *params)]
    grads = [z if a is None else a for a, z in zip(grads, zeros)]
    ref_grads = [z if a is None else a for a, z in zip(ref_grads, zeros)]
    for got, want in zip(grads[1:], ref_grads[1:]):
        assert torch.equal(got, want)
    scale = max(ref_grads[0].float().abs().max().item(), 1e-30)
    bound = 1e-6 if dtype == torch.float32 else 2 ** -6  # bf16: a few last-bit roundings
    assert (grads[0].float() - ref_grads[0].float()).abs().max().item() / scale <= bound


def test_grouped_mm_branch_equals_the_slices(monkeypatch):
    """The ``torch._grouped_mm`` branch (taken on CUDA in bf16) forced on the CPU, where torch
    runs it too: the output of the slice loop bit for bit, with an expert that got no pair;
    the gradients of the weights bit for bit, the rows' within bf16 rounding."""
    from engram_train.models.deepseek_v41 import v41_grouped_experts as grouped

    g = torch.Generator().manual_seed(4)
    weights = [(torch.randn(shape, generator=g) * 0.3).bfloat16().requires_grad_()
               for shape in ((4, INTER, HIDDEN), (4, INTER, HIDDEN), (4, HIDDEN, INTER))]
    counts = [5, 0, 9, 2]
    rows = (torch.randn(16, HIDDEN, generator=g) * 2).bfloat16().requires_grad_()
    inputs = [rows, *weights]

    def run():
        out = grouped.grouped_swiglu(rows, *weights, counts, 2.0)
        return out, torch.autograd.grad(out.float().sum(), inputs)

    loop, loop_grads = run()
    monkeypatch.setattr(grouped, "_grouped_mm_fits", lambda *tensors: True)
    fused, fused_grads = run()
    assert torch.equal(fused, loop)
    for got, want in zip(fused_grads[1:], loop_grads[1:]):
        assert torch.equal(got, want)
    scale = loop_grads[0].float().abs().max()
    assert (fused_grads[0].float() - loop_grads[0].float()).abs().max() <= scale * 2 ** -6


class _DataDependentOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten ops whose output shape or value goes through the host."""

    WATCH = ("nonzero", "unique", "_unique", "masked_select", "_local_scalar_dense", "item")

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if any(name.startswith(w) for w in self.WATCH):
            self.seen.append(name)
        if name == "repeat_interleave" and "output_size" not in (kwargs or {}):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def test_one_host_read_of_the_counts_per_layer(monkeypatch):
    """A MoE layer's forward and backward read the device once: the counts (one ``tolist``);
    no ``torch.where``/``nonzero``/``unique`` scan, no ``item``."""
    from engram_train.models.deepseek_v41 import v41_expert_parallel, v41_grouped_experts

    reads = []
    real = v41_grouped_experts.host_counts

    def counted(counts):
        reads.append(counts.numel())
        return real(counts)

    monkeypatch.setattr(v41_expert_parallel, "host_counts", counted)
    tolist_calls = []
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist",
                        lambda self: tolist_calls.append(self.shape) or real_tolist(self))
    g = torch.Generator().manual_seed(1)
    module = experts(torch.float32)
    router = DeepseekV41Router(spec())
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
    x = torch.randn(TOKENS, HIDDEN, generator=g, requires_grad=True)
    valid = torch.rand(TOKENS, generator=g) > 0.2
    with _DataDependentOps() as mode:
        weights, indices = router(x, valid)
        out = module(x, weights, indices, valid)
        out.sum().backward()
    assert reads == [EXPERTS] and len(tolist_calls) == 1, (reads, tolist_calls)
    assert mode.seen == [], mode.seen


def test_router_bias_stays_float32_under_bf16():
    """``Float16Module`` casts the router with ``bfloat16()``: the correction bias keeps its
    float32 dtype and values, and on the same scores the bf16 router chooses the float32
    router's experts (a bias rounded to bf16 would choose others: checked)."""
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.transformer.module import Float16Module

    g = torch.Generator().manual_seed(5)
    router = DeepseekV41Router(spec())
    with torch.no_grad():  # weights exact in bf16 (the same float32 scores under both dtypes),
        # small: the bias steps of 1e-3 decide the choice, steps bf16 cannot hold near 1
        router.weight.copy_((torch.randn(router.weight.shape, generator=g) * 1e-4).bfloat16().float())
        router.e_score_correction_bias.copy_(1 + torch.arange(EXPERTS) * 1e-3)
    x = torch.randn(TOKENS, HIDDEN, generator=g).bfloat16()
    reference = router(x.float())[1]
    bias = router.e_score_correction_bias.clone()
    config = ModelParallelConfig(bf16=True, params_dtype=torch.bfloat16)
    wrapped = Float16Module(config, router)
    assert router.weight.dtype == torch.bfloat16
    assert router.e_score_correction_bias.dtype == torch.float32
    assert router.local_tokens_per_expert.dtype == torch.float32
    assert torch.equal(router.e_score_correction_bias, bias)
    assert torch.equal(wrapped.module(x)[1], reference)
    router.to(torch.float32).to(torch.bfloat16)  # casts both ways: still the same values
    assert torch.equal(router.e_score_correction_bias, bias)
    scores = torch.sqrt(torch.nn.functional.softplus(x.float() @ router.weight.float().t()))
    rounded = torch.topk(scores + bias.bfloat16(), TOP_K, dim=-1)[1]
    assert not torch.equal(rounded, reference)  # the test would see a bf16 bias


def skewed_moe(rate: float):
    from megatron.core.model_parallel_config import ModelParallelConfig

    args = spec(moe_router_bias_update_rate=rate, n_shared_experts=1, initializer_range=0.05)
    config = ModelParallelConfig(use_cpu_initialization=True, perform_initialization=False)
    moe = DeepseekV41MoE(args, config)
    with torch.no_grad():  # on tokens of mean 1, a router that prefers the low experts
        moe.gate.weight.add_(torch.linspace(0.03, -0.03, EXPERTS)[:, None])
    return moe


def tokens(n: int, g, requires_grad: bool = False) -> torch.Tensor:
    return (torch.randn(n, HIDDEN, generator=g) * 0.5 + 1).requires_grad_(requires_grad)


@torch.no_grad()
def imbalance(moe, x) -> float:
    indices = moe.gate(x)[1]
    loads = torch.bincount(indices.flatten(), minlength=EXPERTS).float()
    return (loads.max() / loads.mean()).item()


@pytest.mark.parametrize("rate", [0.0, 0.01], ids=["off", "on"])
def test_load_balancing_evens_the_loads_of_a_skewed_router(one_rank, rate):
    """50 steps of forward, backward and ``after_optimizer_step`` on a skewed router: with
    ``moe_router_bias_update_rate`` the largest expert load falls to within 35% of the mean
    (from 8/3 of it: the top 3 experts took every token); at 0 nothing is counted and the bias stays 0. Evaluation (no grad)
    counts nothing."""
    from engram_train.training.step import after_optimizer_step

    torch.manual_seed(0)
    moe = skewed_moe(rate)
    g = torch.Generator().manual_seed(2)
    held_out = tokens(512, g)
    before = imbalance(moe, held_out)
    assert before > 2
    for _ in range(50):
        x = tokens(256, g, requires_grad=True)
        moe(x).sum().backward()
        assert moe.gate.local_tokens_per_expert.sum() == (256 * TOP_K if rate else 0)
        after_optimizer_step([moe])
        assert not moe.gate.local_tokens_per_expert.any()
    with torch.no_grad():
        moe(held_out)
    assert not moe.gate.local_tokens_per_expert.any()
    bias = moe.gate.e_score_correction_bias
    if rate:
        assert imbalance(moe, held_out) < 1.35, imbalance(moe, held_out)
        assert bias.dtype == torch.float32 and bias.abs().max() <= 50 * rate
    else:
        assert not bias.any() and imbalance(moe, held_out) == before


def test_bias_update_rate_is_checked():
    from engram_train.errors import ConfigError
    from engram_train.models.deepseek_v41.v41_args import DeepseekV41BackboneArgs

    assert DeepseekV41BackboneArgs().moe_router_bias_update_rate == 0.0
    for bad in (-1e-3, float("nan")):
        with pytest.raises(ConfigError, match="moe_router_bias_update_rate"):
            DeepseekV41BackboneArgs(moe_router_bias_update_rate=bad)


@pytest.fixture(scope="module")
def tp2_ep2(tmp_path_factory):
    from launch import torchrun

    return torchrun("v41_experts.py", 4, tmp_path_factory.mktemp("v41_experts"))


@pytest.mark.parametrize("dtype, itemsize", [("bf16", 2), ("float32", 4)])
def test_ep_dispatch_bytes_per_routed_pair(tp2_ep2, dtype, itemsize):
    """TP2 x EP2: each routed pair goes out as its row alone and comes back as the expert's
    row, ``itemsize x hidden`` bytes each way (``2 hidden`` under bf16: at most megatron's
    all-to-all dispatcher, which adds 4 bytes of float32 probability out), the backward the
    same reversed; the routing weights never travel (the combine applies them and computes
    their gradient on the tokens' rank); one count exchange and one host read per layer on
    every rank; the output one process's bit for bit."""
    for rank in tp2_ep2:
        b = rank["bytes"][dtype]
        assert b["pairs_sent"] > 0 and b["pairs_received"] > 0
        row = itemsize * b["hidden"]
        for direction in ("forward_out", "forward_back", "backward_out", "backward_back"):
            assert b[direction] == row * b["pairs_sent"], (direction, b)
        if dtype == "bf16":
            assert b["forward_out"] <= 2 * b["hidden"] * b["pairs_sent"]
        assert b["row_exchanges"] == 4 and b["count_exchanges"] == 1
        assert b["host_reads"] == 1 and b["output_equal_one_process"]


def test_loads_summed_over_the_stage_ranks(tp2_ep2):
    """Each of the 4 ranks routes its own tokens; after the update every rank's bias equals
    the one-process update on all 4 ranks' tokens and megatron's ``get_updated_expert_bias``
    on the same loads."""
    biases = [rank["balance"]["bias"] for rank in tp2_ep2]
    assert all(b == biases[0] for b in biases)
    for rank in tp2_ep2:
        assert rank["balance"]["equal_one_process"] and rank["balance"]["equal_megatron"]
        assert rank["balance"]["moved"]


def test_plan_expert_bytes_equal_the_model_on_tp2_ep2(one_rank, tp2_ep2):
    """engram-plan's routed-expert parameters per rank of the tiny preset at TP2 x EP2 equal
    the numel each rank of the model holds (replicated over TP, split over EP)."""
    from engram_train.memory_plan.model_bytes import stage_params
    from engram_train.memory_plan.plan_cli import make_plan
    from engram_train.training.param_count import compose_config

    cfg = compose_config(["model=deepseek_v41_tiny", "model.use_engram=false",
                          "system.tensor_model_parallel_size=2",
                          "system.expert_model_parallel_size=2", "train.global_batch_size=4"])
    cache: dict = {}
    plan = make_plan(cfg, 4, 4, 1024, "cpu", 64 << 30, 64 << 30, cache=cache)
    planned = stage_params(cache["model"], cache["validated_config"], plan.layout)[0].params["routed_experts"]
    held = {rank["routed_expert_numel"] for rank in tp2_ep2}
    assert held == {planned}, (held, planned)
    assert planned == 7 * 3 * (4 // 2) * 64 * 32  # layers x w1/w3/w2 x local experts x sizes

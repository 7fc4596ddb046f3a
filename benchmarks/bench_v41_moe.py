"""One DeepSeek-V4.1 MoE layer, forward + backward on the CPU: the grouped routed experts
(``models/deepseek_v41/v41_grouped_experts.py``: one sort of the routed pairs, contiguous
per-expert slices, one host read of the counts) against the earlier loop over the experts
(``reference_routed_experts``: ``torch.unique(...).tolist()``, one ``torch.where`` scan and
three GEMMs per expert, ``index_add_`` per expert), kept in the package as the tests' oracle.

Both run in one process on the same weights and tokens, interleaved in every round (machine
drift hits them alike); the router and the shared expert are the same module in both. The
outputs are checked bit-equal first. Prints the medians and their ratio, writes JSON.

    python benchmarks/bench_v41_moe.py [--experts 64] [--topk 6] [--hidden 1024]
        [--inter 512] [--tokens 4096] [--rounds 5] [--dtype float32] [--threads N] [--out PATH.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from bench_common import free_port, write_result

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "outputs" / "benchmarks" / "bench_v41_moe.json"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--topk", type=int, default=6)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--inter", type=int, default=512, help="moe_intermediate_size")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p.parse_args(argv)


def build(a, dtype):
    from megatron.core.model_parallel_config import ModelParallelConfig

    from engram_train.models.deepseek_v41.v41_args import DeepseekV41BackboneArgs
    from engram_train.models.deepseek_v41.v41_moe import DeepseekV41MoE

    args = DeepseekV41BackboneArgs(hidden_size=a.hidden, moe_intermediate_size=a.inter,
                                   n_routed_experts=a.experts, num_experts_per_tok=a.topk)
    config = ModelParallelConfig(use_cpu_initialization=True, perform_initialization=False,
                                 params_dtype=dtype)
    torch.manual_seed(0)
    moe = DeepseekV41MoE(args, config, dtype=dtype).to(dtype)
    with torch.no_grad():  # a skewed, moving correction bias: uneven expert loads
        moe.gate.e_score_correction_bias.copy_(torch.linspace(-0.05, 0.05, a.experts))
    return moe


def old_layer(moe, x):
    """The MoE with the earlier loop in place of the grouped experts."""
    from engram_train.models.deepseek_v41.v41_grouped_experts import reference_routed_experts

    e = moe.experts
    weights, indices = moe.gate(x)
    routed = reference_routed_experts(x, weights, indices, e.w1, e.w3, e.w2, e.limit)
    return routed + moe.shared_experts(x)


def fwd_bwd(fn, moe, x, upstream) -> float:
    moe.zero_grad(set_to_none=True)
    leaf = x.detach().requires_grad_()
    start = time.perf_counter()
    (fn(moe, leaf) * upstream).sum().backward()
    return time.perf_counter() - start


def main(argv=None) -> None:
    a = parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ["WORLD_SIZE"], os.environ["RANK"] = "1", "0"
    from engram_train.runtime import ParallelSizes, initialize_distributed

    initialize_distributed(ParallelSizes())
    if a.threads:
        torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    moe = build(a, dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(a.tokens, a.hidden, generator=g).to(dtype)
    upstream = torch.randn(a.tokens, a.hidden, generator=g).to(dtype)
    with torch.no_grad():
        equal = torch.equal(moe(x), old_layer(moe, x))
    impls = {"loop": old_layer, "grouped": lambda m, t: m(t)}
    for fn in impls.values():  # warm-up
        fwd_bwd(fn, moe, x, upstream)
    times = {name: [] for name in impls}
    for _ in range(a.rounds):
        for name, fn in impls.items():
            times[name].append(fwd_bwd(fn, moe, x, upstream))
    med = {name: statistics.median(t) for name, t in times.items()}
    ratio = med["grouped"] / med["loop"]
    print(f"V4.1 MoE layer fwd+bwd, {a.experts} experts top-{a.topk}, hidden {a.hidden}, "
          f"inter {a.inter}, {a.tokens} tokens, {a.dtype}, {torch.get_num_threads()} threads: "
          f"loop {med['loop']:.3f} s, grouped {med['grouped']:.3f} s, ratio {ratio:.3f} "
          f"(outputs equal: {equal})")
    write_result(a.out, {"shape": vars(a) | {"out": str(a.out)}, "threads": torch.get_num_threads(),
                         "seconds": times, "median_s": med, "ratio_grouped_over_loop": ratio,
                         "outputs_equal": equal})


if __name__ == "__main__":
    main()

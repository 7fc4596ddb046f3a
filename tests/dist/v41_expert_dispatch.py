"""DeepSeek-V4.1's all-to-all expert dispatch on EP 2 against one process's experts.

    torchrun --nproc-per-node 2 tests/dist/v41_expert_dispatch.py --out DIR

Each rank holds 2 of 4 experts (top-3 routing) and its own tokens; the reference is the
one-process module (all 4 experts, the same weights) on both ranks' tokens, rank 0's first.
Routings: random; every pair to rank 0's experts (rank 1 receives none); rank 1's tokens all
masked (-1: it sends none). The output must be the reference's bit for bit (each token adds
its contributions in ascending expert order, from the same expert matmuls); the gradients of
the tokens, routing weights and this rank's expert weights must match within float32
rounding (the tokens' gradient adds each token's pairs in another order: relative to its
largest entry). float32 and bf16 tokens. Writes the largest differences per case.
"""

import os
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402

from common import parse_args, write_result  # noqa: E402

EXPERTS, TOP_K, HIDDEN, INTER, TOKENS = 4, 3, 16, 24, 10


def routing(case: str, generator) -> torch.Tensor:
    """Expert choices ``[2 x TOKENS, TOP_K]`` of both ranks' tokens."""
    scores = torch.rand(2 * TOKENS, EXPERTS, generator=generator)
    chosen = torch.topk(scores, TOP_K, dim=-1)[1]
    if case == "to_rank0":  # experts 0 and 1 only (rank 0's); the third choice masked
        chosen = torch.stack([torch.zeros(2 * TOKENS, dtype=torch.long),
                              torch.ones(2 * TOKENS, dtype=torch.long),
                              torch.full((2 * TOKENS,), -1)], dim=1)
    if case == "rank1_masked":
        chosen[TOKENS:] = -1
    return chosen


def main() -> None:
    args = parse_args()
    from engram_train.models.deepseek_v41.v41_moe import DeepseekV41Experts, expert_parallel_group
    from engram_train.runtime import ParallelSizes, initialize_distributed

    initialize_distributed(ParallelSizes(expert=2))
    rank = int(os.environ["RANK"])
    spec = SimpleNamespace(n_routed_experts=EXPERTS, moe_intermediate_size=INTER,
                           hidden_size=HIDDEN, swiglu_limit=7.0)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        for case in ("random", "to_rank0", "rank1_masked"):
            generator = torch.Generator().manual_seed(7)
            reference = DeepseekV41Experts(spec, dtype=dtype)
            with torch.no_grad():
                for w in (reference.w1, reference.w3, reference.w2):
                    w.copy_(torch.randn(w.shape, generator=generator) * 0.3)
            ep = DeepseekV41Experts(spec, dtype=dtype, ep_group=expert_parallel_group())
            own = slice(rank * ep.num_local, (rank + 1) * ep.num_local)
            with torch.no_grad():
                for name in ("w1", "w3", "w2"):
                    getattr(ep, name).copy_(getattr(reference, name)[own])
            x = torch.randn(2 * TOKENS, HIDDEN, generator=generator).to(dtype)
            weights = torch.rand(2 * TOKENS, TOP_K, generator=generator)
            chosen = routing(case, generator)
            upstream = torch.randn(2 * TOKENS, HIDDEN, generator=generator).to(dtype)
            rows = slice(rank * TOKENS, (rank + 1) * TOKENS)

            x_ref, w_ref = x.clone().requires_grad_(), weights.clone().requires_grad_()
            out_ref = reference(x_ref, w_ref, chosen)
            (out_ref * upstream).sum().backward()
            x_ep, w_ep = x[rows].clone().requires_grad_(), weights[rows].clone().requires_grad_()
            out_ep = ep(x_ep, w_ep, chosen[rows])
            (out_ep * upstream[rows]).sum().backward()

            def diff(a, b):  # an expert no pair reached has no gradient: zeros
                a = torch.zeros_like(b) if a is None else a
                return (a.float() - b.float()).abs().max().item()

            results[f"{case} {str(dtype)[6:]}"] = {
                "output_equal": torch.equal(out_ep, out_ref[rows]),
                "x_grad": diff(x_ep.grad, x_ref.grad[rows]) / max(x_ref.grad[rows].float().abs().max().item(), 1e-30),
                "weight_grad": diff(w_ep.grad, w_ref.grad[rows]),
                "expert_grad": max(diff(getattr(ep, n).grad, getattr(reference, n).grad[own])
                                   for n in ("w1", "w3", "w2")),
                "received_pairs": int((chosen[:, :] // ep.num_local == rank).sum()),
            }
    write_result(args.out, results)


if __name__ == "__main__":
    main()

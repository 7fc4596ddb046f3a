"""DeepSeek-V4.1's routed experts on TP2 x EP2 (4 ranks), for tests/test_v41_experts.py.

    torchrun --nproc-per-node 4 tests/dist/v41_experts.py --out DIR

Each rank has its own tokens (as under sequence parallelism). Per rank:

- ``bytes``: per dtype (bf16, float32), one forward and backward of the EP experts with
  ``all_to_all_single`` recorded: bytes of each row exchange (the dispatch's input and output,
  the return's), the pairs this rank sent and received, the count exchanges; ``host_reads``
  the calls of ``host_counts``; ``output_equal_one_process`` the output against the
  one-process experts (all experts) on the EP group's tokens;
- ``balance``: a router with ``moe_router_bias_update_rate`` routes this rank's tokens in
  training, ``after_optimizer_step`` updates its bias; compared with the one-process update
  on all 4 ranks' tokens and with megatron's ``get_updated_expert_bias`` on the same loads;
- ``routed_expert_numel``: the routed-expert parameters this rank's tiny V4.1 model holds.
"""

import os
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from common import parse_args, write_result  # noqa: E402

EXPERTS, TOP_K, HIDDEN, INTER, TOKENS = 8, 3, 64, 32, 24
SPEC = SimpleNamespace(n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K, hidden_size=HIDDEN,
                       moe_intermediate_size=INTER, swiglu_limit=7.0, routed_scaling_factor=1.5,
                       norm_topk_prob=True, moe_router_bias_update_rate=0.01)


def rank_tokens(rank: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(100 + rank)).to(dtype)


def dispatch_bytes(rank: int, dtype: torch.dtype) -> dict:
    from engram_train.models.deepseek_v41 import v41_expert_parallel
    from engram_train.models.deepseek_v41.v41_moe import DeepseekV41Experts, expert_parallel_group

    group = expert_parallel_group()
    members = dist.get_process_group_ranks(group)
    g = torch.Generator().manual_seed(7)
    reference = DeepseekV41Experts(SPEC, dtype=dtype)
    with torch.no_grad():
        for w in (reference.w1, reference.w3, reference.w2):
            w.copy_(torch.randn(w.shape, generator=g) * 0.3)
    ep = DeepseekV41Experts(SPEC, dtype=dtype, ep_group=group)
    own = slice(ep.first, ep.first + ep.num_local)
    with torch.no_grad():
        for name in ("w1", "w3", "w2"):
            getattr(ep, name).copy_(getattr(reference, name)[own])

    def inputs(r):
        gen = torch.Generator().manual_seed(200 + r)
        chosen = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(TOKENS)])
        return rank_tokens(r, dtype), torch.rand(TOKENS, TOP_K, generator=gen), chosen

    calls, reads = [], []
    real_all_to_all, real_reads = dist.all_to_all_single, v41_expert_parallel.host_counts

    def recorded(output, input, *args, **kwargs):
        calls.append((input.dim(), input.numel() * input.element_size(),
                      output.numel() * output.element_size()))
        return real_all_to_all(output, input, *args, **kwargs)

    x, weights, chosen = inputs(rank)
    x.requires_grad_()
    weights.requires_grad_()
    dist.all_to_all_single = recorded
    v41_expert_parallel.host_counts = lambda counts: reads.append(1) or real_reads(counts)
    try:
        out = ep(x, weights, chosen)
        forward = list(calls)
        out.float().sum().backward()
        backward = calls[len(forward):]
    finally:
        dist.all_to_all_single, v41_expert_parallel.host_counts = real_all_to_all, real_reads
    everyone = [inputs(r) for r in members]
    expected = reference(torch.cat([e[0] for e in everyone]), torch.cat([e[1] for e in everyone]),
                         torch.cat([e[2] for e in everyone]))
    mine = members.index(rank)
    rows = [c for c in forward if c[0] == 2]
    back_rows = [c for c in backward if c[0] == 2]
    sent = int(chosen.numel())
    received = int(sum((e[2] // ep.num_local == ep.dispatch.rank).sum() for e in everyone))
    return {
        "hidden": HIDDEN, "pairs_sent": sent, "pairs_received": received,
        "forward_out": rows[0][1], "forward_back": rows[1][2],
        "backward_out": back_rows[0][1], "backward_back": back_rows[1][2],
        "row_exchanges": len(rows) + len(back_rows),
        "count_exchanges": len([c for c in forward + backward if c[0] == 1]),
        "host_reads": len(reads),
        "output_equal_one_process": torch.equal(out, expected[mine * TOKENS:(mine + 1) * TOKENS]),
    }


def balance(rank: int, world: int) -> dict:
    from megatron.core.transformer.moe.moe_utils import get_updated_expert_bias

    from engram_train.models.deepseek_v41.v41_load_balance import update_expert_bias
    from engram_train.models.deepseek_v41.v41_moe import DeepseekV41Router

    def router():
        module = DeepseekV41Router(SPEC)
        with torch.no_grad():
            module.weight.copy_(torch.randn(module.weight.shape,
                                            generator=torch.Generator().manual_seed(3)))
        return module

    mine, everyone = router(), router()
    mine(rank_tokens(rank).requires_grad_())
    everyone(torch.cat([rank_tokens(r) for r in range(world)]).requires_grad_())
    loads = mine.local_tokens_per_expert.clone()
    megatron = get_updated_expert_bias(loads[None], mine.e_score_correction_bias.clone()[None],
                                       SPEC.moe_router_bias_update_rate)[0]
    mine.after_optimizer_step()
    update_expert_bias(everyone, reduce=False)
    bias = mine.e_score_correction_bias
    return {"bias": bias.tolist(), "moved": bool(bias.any()),
            "equal_one_process": torch.equal(bias, everyone.e_score_correction_bias),
            "equal_megatron": torch.equal(bias, megatron)}


def routed_expert_numel() -> int:
    from engram_train.models.builder import build_gpt_model
    from engram_train.models.deepseek_v41.v41_config import deepseek_v41_config
    from engram_train.models.presets import model_preset

    section = dict(model_preset("deepseek_v41_tiny"), use_engram=False)
    section.pop("engram_tokenizer_name_or_path", None)
    config = deepseek_v41_config(section, dict(
        params_dtype=torch.float32, perform_initialization=False, tensor_model_parallel_size=2,
        expert_model_parallel_size=2, sequence_parallel=True))
    model = build_gpt_model(config, 1024, 64)
    return sum(p.numel() for name, p in model.named_parameters() if ".ffn.experts." in name)


def main() -> None:
    args = parse_args()
    from engram_train.runtime import ParallelSizes, initialize_distributed

    initialize_distributed(ParallelSizes(tensor=2, expert=2))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    write_result(args.out, {"bytes": {name: dispatch_bytes(rank, dtype) for name, dtype in
                                      (("bf16", torch.bfloat16), ("float32", torch.float32))},
                            "balance": balance(rank, world),
                            "routed_expert_numel": routed_expert_numel()})


if __name__ == "__main__":
    main()

"""Engram embedding parallelism at the module level, one launch of 1, 2 or 4 processes.

For every layout that fits the world (method alltoall with eps 1/2/4 x TP 1/2, method
allreduce with TP 1/2/4) the
same global batch (4 micro-batches; each megatron DP rank takes its share, TP peers share a
micro-batch) goes through an Engram branch whose table is sharded by the method; table
gradients go through the table optimizer's grad sync (``prepare_grads``). Each rank compares
with a single-rank computation of the whole global batch done locally on an unsharded Engram
built from the same seed (no process group involved):

- initial table rows (partition-invariant init), reassembled from the shards;
- Engram outputs of this rank's micro-batches;
- the full table gradient, reassembled from the shards, and its norm ratio to the reference
  (1.0, not the TP size);
- the table optimizer's grad norm vs the reference norm.
Plus (4 processes): Engram group membership under TP2 x PP2 eps 2 and DP4 eps 4, the error when
the model's eps differs from the groups'; (2+ processes) a bf16 table stepped through float32
main copies.
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch
import torch.distributed as dist
from common import forget_graphs
from common import parse_args, write_result

from engram_train.runtime import ParallelSizes, initialize_distributed

from megatron.core import parallel_state
from megatron.core.optimizer import OptimizerConfig

from engram_train.config import EngramConfig
from engram_train.engram.engram_module import Engram
from engram_train.parallel import groups
from engram_train.parallel.groups import table_gradient_groups
from engram_train.parallel.lookup import engram_embedding_parallel
from engram_train.training.engram_optimizer import EngramTableOptimizer, engram_table_param_group

TOKENIZER = str(Path(__file__).resolve().parents[1] / "data" / "golden" / "tok_bpe4k")
HIDDEN, SEQ, MICRO_BATCH, NUM_MICRO = 16, 12, 2, 4
LAYER = 3
LAYOUTS = [  # (name, method, tp, eps)
    ("alltoall_eps1_tp1", "alltoall", 1, 1),
    ("alltoall_eps2_tp1", "alltoall", 1, 2),
    ("alltoall_eps4_tp1", "alltoall", 1, 4),
    ("alltoall_eps1_tp2", "alltoall", 2, 1),
    ("alltoall_eps2_tp2", "alltoall", 2, 2),
    ("alltoall_eps4_tp2", "alltoall", 2, 4),
    ("allreduce_tp1", "allreduce", 1, 1),
    ("allreduce_tp2", "allreduce", 2, 1),
    ("allreduce_tp4", "allreduce", 4, 1),
]


def engram_config(method="alltoall", eps=1):
    return EngramConfig(
        use_engram=True,
        engram_tokenizer_name_or_path=TOKENIZER,
        engram_vocab_size=[1000, 1200],  # 8 prime heads: an odd row count, uneven shards
        max_ngram_size=3,
        n_embed_per_ngram=32,
        n_head_per_ngram=4,
        engram_layer_ids=[1, LAYER],
        engram_embedding_parallel_method=method,
        engram_embedding_parallel_size=eps,
    )


def build_engram(config, embedding_parallel=None, dtype=None):
    torch.manual_seed(0)  # projections: same on every rank; the table init is partition-invariant
    return Engram(config, HIDDEN, LAYER, zero_init_conv=False,
                  embedding_parallel=embedding_parallel, dtype=dtype)


def global_batch(engram):
    """4 micro-batches of (hash ids [S, B, K], hidden [S, B, d]) and a fixed output weight."""
    g = torch.Generator().manual_seed(5)
    sizes = engram.multi_head_embedding.head_sizes
    batches = []
    for _ in range(NUM_MICRO):
        ids = torch.stack(
            [torch.randint(0, n, (SEQ, MICRO_BATCH), generator=g) for n in sizes], dim=-1
        )
        batches.append((ids, torch.randn(SEQ, MICRO_BATCH, HIDDEN, generator=g)))
    return batches, torch.randn(SEQ, MICRO_BATCH, HIDDEN, generator=g)


def reference(config):
    """Single-rank result for the global batch: loss = mean over micro-batches."""
    engram = build_engram(config)
    batches, weight = global_batch(engram)
    outputs = [engram(hidden, hash_ids=ids) for ids, hidden in batches]
    loss = sum((y * weight).sum() for y in outputs) / NUM_MICRO
    loss.backward()
    table = engram.multi_head_embedding.weight
    return dict(
        table=table.detach().clone(),
        grad=table.grad.detach().clone(),
        outputs=[y.detach() for y in outputs],
    )


def reassemble(engram, tensor, shard_group):
    """Full [rows, D] table from this rank's shard rows, summed over the shard group."""
    emb = engram.multi_head_embedding
    full = torch.zeros(emb.num_rows, emb.embedding_dim, dtype=torch.float64)
    full[emb.row_start : emb.row_end] = tensor.detach().double()
    dist.all_reduce(full, group=shard_group)
    return full


def check_layout(result, ref, name, method, tp, eps):
    parallel_state.destroy_model_parallel()
    forget_graphs()  # the previous layout's model can be freed
    initialize_distributed(ParallelSizes(tensor=tp, engram_embedding=eps), seed=1)
    config = engram_config(method, eps)
    parallel = engram_embedding_parallel(config)
    engram = build_engram(config, parallel)
    emb = engram.multi_head_embedding
    shard_group = (groups.get_engram_embedding_parallel_group() if method == "alltoall"
                   else parallel_state.get_tensor_model_parallel_group())
    out = {}
    initial = reassemble(engram, emb.weight, shard_group)
    out["init_max_diff"] = (initial - ref["table"].double()).abs().max().item()
    out["rows"] = [emb.row_start, emb.row_end]

    opt_config = OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=0.0)
    optimizer = EngramTableOptimizer(
        opt_config, [emb.weight], engram_table_param_group(opt_config, config),
        *table_gradient_groups(config), table_optimizer=config.engram_optimizer,
    )
    batches, weight = global_batch(engram)
    dp, dp_rank = (parallel_state.get_data_parallel_world_size(),
                   parallel_state.get_data_parallel_rank())
    share = NUM_MICRO // dp
    mine = range(dp_rank * share, (dp_rank + 1) * share)
    output_diffs = []
    losses = []
    for m in mine:
        ids, hidden = batches[m]
        y = engram(hidden, hash_ids=ids)
        output_diffs.append((y - ref["outputs"][m]).abs().max().item())
        losses.append((y * weight).sum())
    (sum(losses) / share).backward()  # megatron: mean over this rank's micro-batches
    optimizer.prepare_grads()  # scale 1/DP, sum over the grad-sync group
    grad = reassemble(engram, optimizer.dense_grad(0), shard_group)
    ref_grad = ref["grad"].double()
    out["output_max_diff"] = max(output_diffs)
    out["grad_max_diff"] = (grad - ref_grad).abs().max().item()
    out["grad_norm_ratio"] = (grad.norm() / ref_grad.norm()).item()
    out["optimizer_grad_norm"] = optimizer.get_grad_norm()
    out["reference_grad_norm"] = ref_grad.norm().item()
    result[name] = out


def check_groups(result):
    """Engram groups under TP2 x PP2 with eps 2 (formed inside each pipeline stage) and DP4 eps 4;
    a model asking for another eps than the groups have is refused."""
    parallel_state.destroy_model_parallel()
    forget_graphs()  # the previous layout's model can be freed
    initialize_distributed(ParallelSizes(tensor=2, pipeline=2, engram_embedding=2), seed=1)
    result["groups_tp2pp2_eps2"] = dict(
        embedding=list(groups.get_engram_embedding_parallel_ranks()),
        data=list(groups.get_engram_data_parallel_ranks()),
        model=list(groups.get_engram_model_parallel_ranks()),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        embedding_rank=groups.get_engram_embedding_parallel_rank(),
        embedding_size=groups.get_engram_embedding_parallel_world_size(),
    )
    parallel_state.destroy_model_parallel()
    forget_graphs()  # the previous layout's model can be freed
    initialize_distributed(ParallelSizes(engram_embedding=4), seed=1)
    result["groups_dp4_eps4"] = dict(
        embedding=list(groups.get_engram_embedding_parallel_ranks()),
        data=list(groups.get_engram_data_parallel_ranks()),
        model=list(groups.get_engram_model_parallel_ranks()),
    )
    try:
        engram_embedding_parallel(engram_config("alltoall", 2))
        result["eps_mismatch_error"] = None
    except ValueError as error:
        result["eps_mismatch_error"] = str(error)


def check_bf16(result):
    """bf16 table: row gradients accumulate in float32, Adam steps float32 main copies."""
    parallel_state.destroy_model_parallel()
    forget_graphs()  # the previous layout's model can be freed
    initialize_distributed(ParallelSizes(engram_embedding=2), seed=1)
    config = engram_config("alltoall", 2)
    out = {}
    for table_optimizer in ("adam", "sparse_adam"):
        engram = build_engram(config, engram_embedding_parallel(config), dtype=torch.bfloat16)
        emb = engram.multi_head_embedding
        opt_config = OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=0.0, bf16=True)
        optimizer = EngramTableOptimizer(
            opt_config, [emb.weight], engram_table_param_group(opt_config, config),
            *table_gradient_groups(config), table_optimizer=table_optimizer,
        )
        batches, weight = global_batch(engram)
        ids, hidden = batches[dist.get_rank()]
        for _ in range(2):  # two micro-batches: accumulation happens in float32
            y = engram(hidden.bfloat16(), hash_ids=ids)
            (y.float() * weight).sum().backward()
        before = optimizer.main_params[0].detach().clone()
        success, _, _ = optimizer.step()
        main = optimizer.main_params[0]
        out[table_optimizer] = dict(
            grad_is_none=emb.weight.grad is None,
            # rows arrive in the table's dtype and are summed in float32 (coalesce)
            row_grad_dtypes=[str(optimizer.row_grads()[0][1].dtype)],
            main_dtype=str(main.dtype),
            success=success,
            moved=(main - before).abs().max().item(),
            param_equals_main=bool(torch.equal(emb.weight.data, main.data.bfloat16())),
        )
    result["bf16"] = out


def main():
    args = parse_args()
    result = {}
    ref = reference(engram_config())
    world = int(os.environ["WORLD_SIZE"])
    for name, method, tp, eps in LAYOUTS:
        if world % tp == 0 and world % eps == 0:
            check_layout(result, ref, name, method, tp, eps)
    if world == 4:
        check_groups(result)
    if world >= 2:
        check_bf16(result)
    write_result(args.out, result)


if __name__ == "__main__":
    main()

"""Tiny DeepSeek-V3 Engram model (MLA + MoE, Engram on layers 1 and 3) trained under several
Engram embedding-parallel layouts, 4 processes, one launch.

Every layout loads the same initial weights (a checkpoint written once under TP1/eps 1, so the
tables also reshard on load) and trains 5 steps on the same global batch (8 sequences in
micro-batches of 2; each data-parallel rank takes its share, TP peers share theirs) with a small clip_grad, so the
combined (megatron + table) grad norm decides every update. Layouts: alltoall eps 1/2/4 (TP1),
eps 2/4 with TP2 + sequence parallel, eps 2 with PP2 (with and without full recompute),
allreduce TP1/TP2. Recorded per layout:
- the 5 losses and grad norms;
- the full table gradients of the first global batch after the table optimizer's grad sync,
  reassembled from the shards (TP2 must equal TP1: no TP-fold over-count).
Checkpoint round trip: the eps 2 run saves model + optimizer after its 5 steps and records its
tables, Adam moments and 6th-step loss; eps 4 and eps 1 load that checkpoint and must restore
the same tables and moments and give the same 6th-step loss.
"""

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch
import torch.distributed as dist
from common import SEQ, VOCAB, parse_args, repeated_batches, write_result
from engram_integration import build_engram_training, dp_share_of_step, engram_config, table_optimizer, with_hash_ids

from engram_train.runtime import ParallelSizes, initialize_distributed

from megatron.core import parallel_state

from engram_train.checkpoint import load_checkpoint, save_checkpoint
from engram_train.models.builder import build_model
from engram_train.parallel import groups, row_grad_sync
from engram_train.training.step import run_forward_backward, train_step

LAYER_IDS = [1, 3]
GLOBAL_BATCH = 8
MICRO_BATCH = 2  # fewer micro-batches: fewer TP collectives per step on gloo
STEPS = 5
FULL_RECOMPUTE = dict(
    recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
)
LAYOUTS = [  # name, method, ParallelSizes, sequence parallel, config overrides
    ("alltoall_eps1", "alltoall", ParallelSizes(), False),
    ("alltoall_eps2", "alltoall", ParallelSizes(engram_embedding=2), False),
    ("alltoall_eps4", "alltoall", ParallelSizes(engram_embedding=4), False),
    ("alltoall_eps2_tp2", "alltoall", ParallelSizes(tensor=2, engram_embedding=2), True),
    ("alltoall_eps4_tp2", "alltoall", ParallelSizes(tensor=2, engram_embedding=4), True),
    ("alltoall_eps2_pp2", "alltoall", ParallelSizes(pipeline=2, engram_embedding=2), False),
    # Full recompute re-runs the routed lookups inside backward, in the same order on every rank.
    ("alltoall_eps2_pp2_recompute", "alltoall", ParallelSizes(pipeline=2, engram_embedding=2),
     False, FULL_RECOMPUTE),
    ("allreduce_tp1", "allreduce", ParallelSizes(), False),
    ("allreduce_tp2", "allreduce", ParallelSizes(tensor=2), True),
    # Dense Adam through the same row-sparse gradient route (sync, norm, clip).
    ("alltoall_eps2_tp2_adam", "alltoall", ParallelSizes(tensor=2, engram_embedding=2), True,
     dict(engram_optimizer="adam")),
    ("allreduce_tp1_adam", "allreduce", ParallelSizes(), False, dict(engram_optimizer="adam")),
]
SAVE_LAYOUT = "alltoall_eps2"
RESUME_LAYOUTS = [  # the checkpoint was written with sparse_adam
    ("resume_eps4", ParallelSizes(engram_embedding=4), {}),
    ("resume_eps1", ParallelSizes(), {}),
    ("resume_eps2_adam", ParallelSizes(engram_embedding=2), dict(engram_optimizer="adam")),
]
VARYING_STEPS = 12


def setup(layout: ParallelSizes, method="alltoall", sp=False, seed=1, **overrides):
    return build_engram_training(layout, LAYER_IDS, method=method, sp=sp, seed=seed,
                                 optimizer=dict(weight_decay=0.0), **overrides)


def my_batches():
    batches = with_hash_ids(
        repeated_batches(GLOBAL_BATCH // MICRO_BATCH, MICRO_BATCH, seed=3), LAYER_IDS
    )
    dp = parallel_state.get_data_parallel_world_size()
    rank = parallel_state.get_data_parallel_rank()
    share = len(batches) // dp
    return batches[rank * share : (rank + 1) * share]


def reassemble(model, tensors_of) -> dict[int, torch.Tensor]:
    """{layer id: full [rows, D] float64} of a per-table tensor, on every rank."""
    mine = {}
    for chunk in model:
        for module in chunk.modules():
            if type(module).__name__ != "MultiHeadEmbedding":
                continue
            shard_group = module.parallel.shard_group
            full = torch.zeros(module.num_rows, module.embedding_dim, dtype=torch.float64)
            full[module.row_start : module.row_end] = tensors_of(module.weight).detach().double()
            dist.all_reduce(full, group=shard_group)
            mine[module.layer_id] = full
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    merged = {}
    for tables in everyone:
        merged.update(tables)
    return merged


def structure(model, optimizer) -> dict:
    """Where the tables went: out of megatron DDP and optimizer, into the chained table group."""
    from engram_train.models.table_params import engram_table_params

    tables = {id(p) for p in engram_table_params(model)}
    ddp_params = {id(p) for chunk in model for p in chunk.params_with_grad}
    megatron_params = {id(p) for o in optimizer.chained_optimizers[:-1] for p in o.get_parameters()}
    table_opt = table_optimizer(optimizer)
    return dict(
        num_tables=len(tables),
        tables_require_grad=all(p.requires_grad for p in engram_table_params(model)),
        tables_in_ddp=len(tables & ddp_params),
        tables_in_megatron_optimizer=len(tables & megatron_params),
        table_optimizer_is_last=optimizer.chained_optimizers[-1] is table_opt,
        table_optimizer_params=len(table_opt.get_parameters()),
        lrs=[(g.get("is_engram_table", False), g["lr"], g["max_lr"])
             for g in optimizer.param_groups],
    )


def first_batch_table_grads(model, optimizer):
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    run_forward_backward(model, my_batches(), SEQ, MICRO_BATCH)
    opt = table_optimizer(optimizer)
    opt.prepare_grads()
    index = {id(p): i for i, p in enumerate(opt.model_params)}
    grads = reassemble(model, lambda p: opt.dense_grad(index[id(p)]))
    optimizer.zero_grad()
    return grads


def train(model, optimizer, steps):
    results = [train_step(model, optimizer, my_batches(), SEQ, MICRO_BATCH) for _ in range(steps)]
    return [r.lm_loss for r in results], [r.grad_norm for r in results]


def varying_batches(step: int):
    """This rank's share of a global batch that changes every step (new rows get touched)."""
    return dp_share_of_step(100 + step, LAYER_IDS, GLOBAL_BATCH)


def replica_max_diff(model, optimizer) -> float:
    """Largest difference between replicas of a table shard (tables and moments) over the
    Engram data-parallel group: 0.0 when every replica applied the same update."""
    opt = table_optimizer(optimizer)
    worst = torch.zeros(())
    group = groups.get_engram_data_parallel_group()
    for param, main in zip(opt.model_params, opt.main_params):
        state = opt.optimizer.state[main]
        for tensor in (param.data, state["exp_avg"], state["exp_avg_sq"]):
            gathered = [torch.empty_like(tensor) for _ in range(group.size())]
            dist.all_gather(gathered, tensor.contiguous(), group=group)
            for other in gathered:
                worst = torch.maximum(worst, (other - tensor).abs().max())
    return worst.item()


AUTO_ROUTE = row_grad_sync.sparse_is_cheaper


def dense_vs_sparse(root, result):
    """eps 2 (two replicas per shard), a different global batch every step: dense adam,
    sparse_adam with the automatic and with the dense gradient-sync route."""
    runs = [("adam", None), ("sparse_adam", None), ("sparse_adam", "dense"),
            ("sparse_adam", "sparse")]
    for table_opt, route in runs:
        layout = ParallelSizes(engram_embedding=2)
        _, model, optimizer = setup(layout, engram_optimizer=table_opt)
        load_checkpoint(root / "base", model)
        opt = table_optimizer(optimizer)
        # the automatic route choice, or one route forced for every table
        row_grad_sync.sparse_is_cheaper = (
            AUTO_ROUTE if route is None else (lambda *_, sparse=route == "sparse": sparse))
        losses, routes = [], set()
        for step in range(VARYING_STEPS):
            losses.append(train_step(model, optimizer, varying_batches(step), SEQ, 1).lm_loss)
            routes.update(opt.last_sync.routes)
        result[f"varying_{table_opt}_{route or 'auto'}"] = dict(
            losses=losses, routes=sorted(routes),
            replica_max_diff=replica_max_diff(model, optimizer),
            replicas=groups.get_engram_data_parallel_world_size(),
        )
    row_grad_sync.sparse_is_cheaper = AUTO_ROUTE


def moments(model, optimizer):
    opt = table_optimizer(optimizer)
    by_param = {id(p): opt.optimizer.state[main]
                for p, main in zip(opt.model_params, opt.main_params)}
    return {key: reassemble(model, lambda p, key=key: by_param[id(p)][key])
            for key in ("exp_avg", "exp_avg_sq")}


def max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def main():
    args = parse_args()
    result = {}
    parallel_state.destroy_model_parallel()
    initialize_distributed(ParallelSizes(), seed=11)
    holder = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    root = Path(holder[0])
    base = engram_config(ParallelSizes(), LAYER_IDS)
    save_checkpoint(root / "base", 0, build_model(base, VOCAB, SEQ))

    reference_grads = None
    saved = {}
    for name, method, layout, sp, *overrides in LAYOUTS:
        _, model, optimizer = setup(layout, method, sp, **(overrides[0] if overrides else {}))
        load_checkpoint(root / "base", model)
        grads = first_batch_table_grads(model, optimizer)
        if reference_grads is None:
            reference_grads = grads
        losses, norms = train(model, optimizer, STEPS)
        entry = dict(losses=losses, grad_norms=norms,
                     table_grad_max_diff=max_diff(grads, reference_grads),
                     table_grad_norm=sum(g.pow(2).sum() for g in grads.values()).sqrt().item(),
                     tables=sorted(grads))
        if name == "alltoall_eps2_pp2":
            entry["structure"] = structure(model, optimizer)
        if method == "alltoall":
            entry["eps"] = groups.get_engram_embedding_parallel_world_size()
        if name == SAVE_LAYOUT:
            save_checkpoint(root / "trained", STEPS, model, optimizer)
            saved = dict(tables=reassemble(model, lambda p: p), moments=moments(model, optimizer))
            entry["next_loss"] = train(model, optimizer, 1)[0][0]
        result[name] = entry

    for name, layout, overrides in RESUME_LAYOUTS:
        _, model, optimizer = setup(layout, seed=77, **overrides)
        iteration, _ = load_checkpoint(root / "trained", model, optimizer)
        now = moments(model, optimizer)
        result[name] = dict(
            iteration=iteration,
            table_max_diff=max_diff(reassemble(model, lambda p: p), saved["tables"]),
            exp_avg_max_diff=max_diff(now["exp_avg"], saved["moments"]["exp_avg"]),
            exp_avg_sq_max_diff=max_diff(now["exp_avg_sq"], saved["moments"]["exp_avg_sq"]),
            num_steps=table_optimizer(optimizer).num_steps,
            next_loss=train(model, optimizer, 1)[0][0],
        )
    dense_vs_sparse(root, result)
    write_result(args.out, result)


if __name__ == "__main__":
    main()

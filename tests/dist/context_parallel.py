"""Context and sequence parallelism with Engram, 4 processes per launch (``--part``):

part ``core`` (every lane):
- the Engram branch on a split sequence (CP 4, CP 2 x TP 2 with SP, TP 4 with SP, CP 4 on
  chunks shorter than the halo; 1 and 2 streams) equals the unsplit branch at every position,
  output and input gradient, and its halo moves ``B x (K-1) x N x d x G x 4`` bytes per edge;
- every dense parameter's first gradient in every core layout against DP4's, TP shards
  gathered;
- the demo-like model with Engram for 6 optimizer steps: DP4 (the CP1 reference), CP2 x DP2,
  CP2 x TP2 (SP), CP4, TP2 with SP (with its per-rank lookup counts), and checkpoints
  across CP (CP2 x TP2 -> CP1 and CP1 -> CP2 continue the same losses); its dense variant
  (megatron refuses MoE under TP without SP) on DP4 and on TP2 without SP, first gradients
  and losses;
part ``more``: CP2 with PP2, full recompute, eps 2 + host tables + prefetch, the allreduce
method under CP2 x TP2 (SP), bf16, EOS reset, the mHC backbone, TP4 with SP.
"""

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))

import torch
import torch.distributed as dist
from common import forget_graphs
from common import SEQ, VOCAB, parse_args, repeated_batches, tiny_config, write_result
from engram_integration import ENGRAM, build

from engram_train.runtime import ParallelSizes, initialize_distributed

from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig

try:
    from engram_train.checkpoint import load_checkpoint, save_checkpoint
except ImportError:  # before the checkpoint package
    from engram_train.checkpointing import load_checkpoint, save_checkpoint
from engram_train.config import EngramConfig, EngramMLATransformerConfig
from engram_train.engram.ngram_hash import NgramHashMapping
from engram_train.training.optimizer import build_optimizer
from engram_train.training.step import run_forward_backward, train_step

LAYER_IDS = [1, 3]
GLOBAL_BATCH = 8
MICRO_BATCH = 2
STEPS = 6
SAVE_AFTER = 3
FULL_RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform",
                      recompute_num_layers=1)
BF16 = dict(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
DENSE = dict(num_moe_experts=None, moe_ffn_hidden_size=None,
             moe_shared_expert_intermediate_size=None)
# name, ParallelSizes, sequence parallel, config overrides, distributed optimizer
CORE = [
    ("dp4", ParallelSizes(), False, {}, False),
    ("cp2", ParallelSizes(context=2), False, {}, False),
    ("cp2_tp2sp", ParallelSizes(context=2, tensor=2), True, {}, False),
    ("cp4", ParallelSizes(context=4), False, {}, False),
    ("tp2sp", ParallelSizes(tensor=2), True, {}, False),
    ("dp4_dense", ParallelSizes(), False, DENSE, False),
    ("tp2", ParallelSizes(tensor=2), False, DENSE, False),
]
MORE = [
    ("dp4", ParallelSizes(), False, {}, False),
    ("cp2_pp2", ParallelSizes(context=2, pipeline=2), False, {}, False),
    ("cp2_full_recompute", ParallelSizes(context=2), False, FULL_RECOMPUTE, False),
    ("cp2_eps2_host_prefetch_distopt", ParallelSizes(context=2, engram_embedding=2), False,
     dict(engram_table_placement="host", engram_prefetch=True), True),
    ("cp2_allreduce_tp2sp", ParallelSizes(context=2, tensor=2), True,
     dict(engram_embedding_parallel_method="allreduce"), False),
    ("tp4sp", ParallelSizes(tensor=4), True, {}, False),
    ("dp4_bf16", ParallelSizes(), False, BF16, False),
    ("cp2_bf16", ParallelSizes(context=2), False, BF16, False),
    ("dp4_eos", ParallelSizes(), False, {}, False),
    ("cp2_eos", ParallelSizes(context=2), False, {}, False),
    ("dp4_mhc", ParallelSizes(), False, dict(enable_hyper_connections=True), False),
    ("cp2_mhc", ParallelSizes(context=2), False, dict(enable_hyper_connections=True), False),
]
EOS = dict(engram_reset_at_eos=True, engram_eos_id=5)
# The checkpoint every layout of a model variant starts from (its first layout is the
# first-gradient reference of the others).
BASES = {"base": {}, "base_dense": DENSE, "base_mhc": dict(enable_hyper_connections=True)}


def base_of(overrides: dict) -> str:
    if overrides.get("enable_hyper_connections"):
        return "base_mhc"
    return "base_dense" if "num_moe_experts" in overrides else "base"


def init(layout: ParallelSizes, seed=1):
    parallel_state.destroy_model_parallel()
    forget_graphs()  # the previous layout's model can be freed
    initialize_distributed(layout, seed=seed)


def model_config(layout: ParallelSizes, sp=False, **overrides):
    fields = dict(ENGRAM, engram_layer_ids=LAYER_IDS, context_parallel_size=layout.context)
    if layout.engram_embedding > 1:
        fields["engram_embedding_parallel_size"] = layout.engram_embedding
    if overrides.get("enable_hyper_connections"):
        fields["num_residual_streams"] = 4
    fields.update(overrides)
    cfg = tiny_config(tp=layout.tensor, pp=layout.pipeline, ep=layout.expert, sp=sp,
                      config_class=EngramMLATransformerConfig, **fields)
    cfg.finalize_model_grads_func = finalize_model_grads
    return cfg


def step_batches(step: int, eos=False):
    """This data-parallel rank's micro-batches of step ``step``, hashed on the whole sequence
    (CP peers share a data-parallel rank and read the same ones)."""
    fields = dict(ENGRAM, engram_layer_ids=LAYER_IDS, **(EOS if eos else {}))
    mapping = NgramHashMapping(EngramConfig(**fields))
    batches = repeated_batches(GLOBAL_BATCH // MICRO_BATCH, MICRO_BATCH, seed=300 + step)
    batches = [dict(b, engram_hash_ids=mapping.hash_stacked(b["tokens"])) for b in batches]
    share = len(batches) // parallel_state.get_data_parallel_world_size()
    rank = parallel_state.get_data_parallel_rank()
    return batches[rank * share : (rank + 1) * share]


def setup(layout, sp, overrides, distopt, seed):
    init(layout, seed=seed)
    cfg = model_config(layout, sp, **overrides)
    model = build(cfg, distopt)
    if len(model) > 1:
        cfg.no_sync_func = [m.no_sync for m in model]
    # lr 3e-4: the tiny model's dynamics are stable there, so layouts agree to float-order noise
    # (at 3e-3 without warm-up they are chaotic and CP4 drifts from CP1 by ~1e-4 in 6 steps).
    opt_config = OptimizerConfig(optimizer="adam", lr=3e-4, clip_grad=0.5, weight_decay=0.0,
                                 use_distributed_optimizer=distopt,
                                 bf16=bool(overrides.get("bf16")),
                                 params_dtype=overrides.get("params_dtype", torch.float32))
    return model, build_optimizer(opt_config, model, cfg)


def shared_tmpdir() -> Path:
    holder = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    return Path(holder[0])


class LookupCounter:
    """Ids and distinct rows this rank looks up (wraps the lookup methods' ``issue``)."""

    def __init__(self):
        from engram_train.parallel.lookup import _ShardedLookup

        self.cls, self.original = _ShardedLookup, _ShardedLookup.issue
        self.ids = self.rows = 0
        counter = self

        def issue(method, embedding, rows, prefetch=True):
            counter.ids += rows.numel()
            counter.rows += torch.unique(rows).numel()
            return counter.original(method, embedding, rows, prefetch)

        _ShardedLookup.issue = issue

    def close(self):
        self.cls.issue = self.original





def full_gradients(model, config) -> dict:
    """Every dense parameter's gradient after one forward-backward (megatron's finalization
    included), TP shards gathered into the one-rank layout (a gated ``linear_fc1`` holds
    ``[gate_r; up_r]`` per rank: the gate halves first, then the up halves)."""
    group = parallel_state.get_tensor_model_parallel_group()
    grads = {}
    for name, param in model[0].named_parameters():
        grad = getattr(param, "main_grad", None)
        if grad is None:  # Engram's tables: row updates, not dense gradients
            continue
        grad = grad.detach().float().clone()
        if getattr(param, "tensor_model_parallel", False) and group.size() > 1:
            shards = [torch.empty_like(grad) for _ in range(group.size())]
            dist.all_gather(shards, grad.contiguous(), group=group)
            if name.endswith("linear_fc1.weight") and config.gated_linear_unit:
                halves = [shard.chunk(2, dim=0) for shard in shards]
                shards = [h[0] for h in halves] + [h[1] for h in halves]
            grad = torch.cat(shards, dim=param.partition_dim)
        grads[name] = grad
    return grads


def first_gradients(model, config) -> dict:
    """``full_gradients`` of step 0's batches (the grad buffers left zero)."""
    for chunk in model:
        chunk.zero_grad_buffer()
    run_forward_backward(model, step_batches(0), SEQ, MICRO_BATCH)
    grads = full_gradients(model, config)
    for chunk in model:
        chunk.zero_grad_buffer()
    return grads


def run_layouts(result, layouts, root: Path, checkpoints: bool):
    for base in sorted({base_of(overrides) for _, _, _, overrides, _ in layouts}):
        init(ParallelSizes(), seed=11)
        save_checkpoint(root / base, 0, build(model_config(ParallelSizes(), **BASES[base])))
    references = {}
    for name, layout, sp, overrides, distopt in layouts:
        model, optimizer = setup(layout, sp, overrides, distopt, seed=21)
        load_checkpoint(root / base_of(overrides), model)
        if checkpoints:  # every layout alike: the pass moves the routers' expert bias
            grads = first_gradients(model, model_config(layout, sp, **overrides))
            reference = references.setdefault(base_of(overrides), grads)
            if reference is not grads:
                result[f"{name}_first_gradients"] = {
                    n: ((g - grads[n]).norm() / g.norm().clamp_min(1e-30)).item()
                    if n in grads and grads[n].shape == g.shape else None
                    for n, g in reference.items()}
        counter = LookupCounter()
        steps = []
        try:
            for step in range(STEPS):
                steps.append(train_step(model, optimizer, step_batches(step, "eos" in name), SEQ,
                                        MICRO_BATCH))
                if checkpoints and name in ("cp2_tp2sp", "dp4") and step + 1 == SAVE_AFTER:
                    save_checkpoint(root / f"from_{name}", SAVE_AFTER, model, optimizer)
        finally:
            counter.close()
        result[name] = dict(losses=[s.lm_loss for s in steps],
                            grad_norms=[s.grad_norm for s in steps],
                            lookup_ids=counter.ids, lookup_rows=counter.rows)
    if not checkpoints:
        return
    for source, layout, sp in (("cp2_tp2sp", ParallelSizes(), False),
                               ("dp4", ParallelSizes(context=2), False)):
        model, optimizer = setup(layout, sp, {}, False, seed=31)
        iteration, _ = load_checkpoint(root / f"from_{source}", model, optimizer)
        result[f"resume_from_{source}"] = dict(iteration=iteration, losses=[
            train_step(model, optimizer, step_batches(step), SEQ, MICRO_BATCH).lm_loss
            for step in range(SAVE_AFTER, STEPS)])


def check_branch(result):
    """The Engram branch on each rank's positions (zigzag CP chunks and/or SP slices) with the
    halo, against the unsplit branch computed on every rank from the same weights."""
    from types import SimpleNamespace

    from engram_train.engram.engram_module import Engram
    from engram_train.parallel.context import (
        HALO_STATS,
        context_parallel_batch,
        held_positions,
        sequence_halo,
        zigzag_positions,
    )

    cases = [("cp4", ParallelSizes(context=4), False, 128, 1),
             ("cp2_tp2sp", ParallelSizes(context=2, tensor=2), True, 128, 2),
             ("tp4sp", ParallelSizes(tensor=4), True, 128, 1),
             ("cp4_short_chunks", ParallelSizes(context=4), False, 24, 1)]
    hidden_size, batch = 16, 2
    for name, layout, sp, seq, streams in cases:
        init(layout, seed=3)
        config = EngramConfig(**ENGRAM, engram_layer_ids=LAYER_IDS, engram_hc_mult=streams)
        torch.manual_seed(0)
        engram = Engram(config, hidden_size, LAYER_IDS[0], zero_init_conv=False,
                        dtype=torch.float32)
        with torch.no_grad():  # a conv and gate that see every tap
            engram.short_conv.conv.weight.normal_(0.0, 0.5)
        tokens = torch.randint(0, VOCAB, (batch, seq))
        ids = NgramHashMapping(config).hash_stacked(tokens)[0].transpose(0, 1)  # [S, B, K]
        shape = (seq, batch, hidden_size) if streams == 1 else (seq, batch, streams, hidden_size)
        hidden = torch.randn(shape)
        weight = torch.randn(shape)
        full_in = hidden.clone().requires_grad_()
        full = engram(full_in, hash_ids=ids)
        (full * weight).sum().backward()

        cp = parallel_state.get_context_parallel_group()
        tp = parallel_state.get_tensor_model_parallel_group()
        split = context_parallel_batch(dict(tokens=torch.arange(seq)[None].expand(batch, seq),
                                            engram_hash_ids=torch.arange(seq).view(1, 1, seq, 1)
                                            .expand(2, batch, seq, 3).contiguous()))
        zigzag = zigzag_positions(seq, cp.size(), cp.rank())
        zigzag_ok = (torch.equal(split["tokens"][0], zigzag)
                     and torch.equal(split["engram_hash_ids"][1, 1, :, 2], zigzag))
        pos = held_positions(seq, cp.size(), cp.rank(), tp.size() if sp else 1,
                             tp.rank() if sp else 0)
        halo = sequence_halo(SimpleNamespace(sequence_parallel=sp),
                             (config.engram_kernel_size - 1) * config.max_ngram_size)
        local_in = hidden[pos].clone().requires_grad_()
        HALO_STATS.reset()
        local = engram(local_in, hash_ids=ids[pos], halo=halo)
        halo_bytes = HALO_STATS.bytes
        (local * weight[pos]).sum().backward()
        plan = halo.plan(pos.numel())
        result[f"branch_{name}"] = dict(
            output_diff=(local - full[pos]).abs().max().item(),
            output_scale=full.abs().max().item(),
            grad_diff=(local_in.grad - full_in.grad[pos]).abs().max().item(),
            grad_scale=full_in.grad.abs().max().item(),
            halo_bytes=halo_bytes, edges=plan.edges,
            edge_bytes=batch * plan.width * hidden_size * streams * 4,
            short_pieces=any(end - start < plan.width for start, end in plan.pieces),
            zigzag_matches_megatron=zigzag_ok)


def main():
    args = parse_args({"--part": dict(required=True)})
    result = {}
    if args.part == "core":
        check_branch(result)
        run_layouts(result, CORE, shared_tmpdir(), checkpoints=True)
    else:
        init(ParallelSizes())
        run_layouts(result, MORE, shared_tmpdir(), checkpoints=False)
    write_result(args.out, result)


if __name__ == "__main__":
    main()

"""Engram inside megatron on 4 processes, one launch:

- use_engram=False builds megatron's GPTModel: same parameter names, bitwise-equal output.
- For Engram layers on both PP stages ([1, 3]) and only on the second ([2, 3]): the PP1 model is
  saved with dist_checkpointing, then loaded into PP2, TP2(+SP / no SP) layouts; the loss on
  the same micro-batches must match PP1.
- Full recompute vs none under PP2 with 4 distinct micro-batches (1F1B keeps several in
  flight, so a recomputed layer must see its own micro-batch's hash ids): identical loss and
  identical gradients.
"""

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch
import torch.distributed as dist
from common import SEQ, VOCAB, forget_graphs, parse_args, repeated_batches, tiny_config, write_result

from engram_train.runtime import ParallelSizes, initialize_distributed

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel

from engram_train.checkpoint import load_checkpoint, save_checkpoint
from engram_train.config import EngramMLATransformerConfig
from engram_train.models.builder import build_model
from engram_train.models.deepseek_v3.v3_specs import deepseek_v3_block_spec
from engram_train.training.step import evaluate, run_forward_backward

TOKENIZER = str(Path(__file__).resolve().parents[1] / "data" / "golden" / "tok_bpe4k")
ENGRAM = dict(
    use_engram=True,
    engram_tokenizer_name_or_path=TOKENIZER,
    engram_vocab_size=[257, 263],
    max_ngram_size=3,
    n_embed_per_ngram=32,
    n_head_per_ngram=4,
)

# A 2-layer MoE of small width, for launches that build many models (resume across layouts).
SMALL = dict(
    num_layers=2, hidden_size=32, num_attention_heads=2, ffn_hidden_size=64, q_lora_rank=16,
    kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8, moe_ffn_hidden_size=16,
    moe_shared_expert_intermediate_size=16,
)


def engram_config(layout: ParallelSizes, layer_ids, sp=False, **overrides):
    cfg = tiny_config(
        tp=layout.tensor, pp=layout.pipeline, sp=sp, config_class=EngramMLATransformerConfig,
        engram_layer_ids=layer_ids, **{**ENGRAM, **overrides},
    )
    cfg.finalize_model_grads_func = finalize_model_grads
    return cfg


def build_engram_training(layout: ParallelSizes, layer_ids, *, method="alltoall", sp=False, seed=1,
                          load=None, optimizer=None, **overrides):
    """A fresh layout's process groups, then the Engram model (loaded from ``load`` when given)
    and megatron's Adam with the Engram table optimizer: (config, model, optimizer)."""
    from megatron.core.optimizer import OptimizerConfig

    from engram_train.training.optimizer import build_optimizer

    forget_graphs()
    parallel_state.destroy_model_parallel()
    initialize_distributed(layout, seed=seed)
    if layout.virtual_pipeline:
        overrides.setdefault("virtual_pipeline_model_parallel_size", layout.virtual_pipeline)
    config = engram_config(layout, layer_ids, sp=sp, engram_embedding_parallel_method=method,
                           engram_embedding_parallel_size=layout.engram_embedding, **overrides)
    model = build_model(config, VOCAB, SEQ, DistributedDataParallelConfig(grad_reduce_in_fp32=True))
    config.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
    if load is not None:
        load_checkpoint(load, model)
    opt_config = OptimizerConfig(optimizer="adam", lr=3e-3, clip_grad=0.05, **(optimizer or {}))
    return config, model, build_optimizer(opt_config, model, config)


def table_optimizer(optimizer):
    """The Engram table optimizer in a chain that ``build_optimizer`` returned."""
    from engram_train.training.engram_optimizer import EngramTableOptimizer

    return next(o for o in optimizer.chained_optimizers if isinstance(o, EngramTableOptimizer))


def with_hash_ids(batches, layer_ids):
    """The data path's hash ids: one [L, B, S, K] block per micro-batch (as the trainer's
    HashPrefetchIterator adds them), so the model takes the ids it is given."""
    from engram_train.config import EngramConfig
    from engram_train.engram.ngram_hash import NgramHashMapping

    mapping = NgramHashMapping(EngramConfig(engram_layer_ids=list(layer_ids), **ENGRAM))
    return [dict(b, engram_hash_ids=mapping.hash_stacked(b["tokens"])) for b in batches]


def dp_share_of_step(seed: int, layer_ids, global_batch: int, micro_batch_size: int = 1):
    """This data-parallel rank's micro-batches (with data-path hash ids) of a global batch of
    ``global_batch`` sequences drawn with ``seed``: a new seed per step touches new rows every
    step. The sequences do not depend on ``micro_batch_size``, only their grouping."""
    batches = with_hash_ids(
        repeated_batches(global_batch // micro_batch_size, micro_batch_size, seed=seed), layer_ids
    )
    share = len(batches) // parallel_state.get_data_parallel_world_size()
    rank = parallel_state.get_data_parallel_rank()
    return batches[rank * share : (rank + 1) * share]


def init(layout: ParallelSizes, seed=1):
    forget_graphs()
    parallel_state.destroy_model_parallel()
    initialize_distributed(layout, seed=seed)


def build(cfg, distopt=False):
    model = build_model(cfg, VOCAB, SEQ, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distopt))
    return model


def shared_tmpdir():
    holder = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def check_plain_equals_gpt(result):
    init(ParallelSizes())
    plain_cfg = tiny_config()
    torch.manual_seed(7)
    reference = GPTModel(plain_cfg, deepseek_v3_block_spec(plain_cfg), vocab_size=VOCAB, max_sequence_length=SEQ,
                         share_embeddings_and_output_weights=False, position_embedding_type="rope")
    off_cfg = tiny_config(config_class=EngramMLATransformerConfig, use_engram=False)
    torch.manual_seed(7)
    ours = build_model(off_cfg, VOCAB, SEQ, wrap_with_ddp=False)[0]
    b = repeated_batches(1, 2)[0]
    out_ref = reference(b["tokens"], b["position_ids"], None, labels=b["labels"])
    out = ours(b["tokens"], b["position_ids"], None, labels=b["labels"])
    result["plain_type"] = type(ours).__name__
    result["plain_same_names"] = list(reference.state_dict()) == list(ours.state_dict())
    result["plain_bitwise"] = bool(torch.equal(out_ref, out))


def check_layouts(result, layer_ids, tag):
    plain = repeated_batches(num_microbatches=4, micro_batch_size=2, seed=3)
    batches = with_hash_ids(plain, layer_ids)

    init(ParallelSizes(), seed=11)
    root = shared_tmpdir()
    model = build(engram_config(ParallelSizes(), layer_ids))
    result[f"{tag}_pp1"] = evaluate(model, batches, SEQ, 2)
    # Plain input_ids: the model hashes them itself, through the same [L, B, S, K] route.
    result[f"{tag}_pp1_in_model_hashing"] = evaluate(model, plain, SEQ, 2)
    save_checkpoint(root, 1, model)

    for name, layout, sp in (
        ("pp2", ParallelSizes(pipeline=2), False),
        ("tp2", ParallelSizes(tensor=2), False),
        ("tp2sp", ParallelSizes(tensor=2), True),
        ("tp2pp2sp", ParallelSizes(tensor=2, pipeline=2), True),
    ):
        init(layout, seed=99)
        model = build(engram_config(layout, layer_ids, sp=sp))
        load_checkpoint(root, model)
        result[f"{tag}_{name}"] = evaluate(model, batches, SEQ, 2)


def grads_after_step(model, batches):
    for chunk in model:
        chunk.zero_grad_buffer()
        for p in chunk.parameters():
            p.grad = None
    losses = run_forward_backward(model, batches, SEQ, 2)
    grads = {}
    for i, chunk in enumerate(model):
        for name, p in chunk.named_parameters():
            # Engram tables are outside megatron DDP: autograd's .grad, not a DDP main_grad.
            grad = getattr(p, "main_grad", None)
            grads[f"{i}.{name}"] = (p.grad if grad is None else grad).detach().clone()
    loss = None
    if losses:
        total = torch.stack([d["lm loss"] for d in losses]).sum(0)
        loss = (total[0] / total[1]).item()
    return loss, grads


def check_recompute(result):
    layout = ParallelSizes(pipeline=2)
    batches = with_hash_ids([repeated_batches(1, 2, seed=100 + i)[0] for i in range(4)], [1, 3])
    init(layout, seed=5)
    root = shared_tmpdir()
    base = build(engram_config(layout, [1, 3]))
    save_checkpoint(root, 1, base)
    loss_plain, grads_plain = grads_after_step(base, batches)
    init(layout, seed=6)
    recomputed = build(engram_config(layout, [1, 3], recompute_granularity="full",
                                     recompute_method="uniform", recompute_num_layers=1))
    load_checkpoint(root, recomputed)
    loss_rc, grads_rc = grads_after_step(recomputed, batches)
    result["recompute_loss"] = [loss_plain, loss_rc]
    result["recompute_grad_names_equal"] = sorted(grads_plain) == sorted(grads_rc)
    result["recompute_grads_mismatch"] = [k for k in grads_plain if not torch.equal(grads_plain[k], grads_rc[k])]
    table_grads = [g for k, g in grads_plain.items() if "multi_head_embedding.weight" in k]
    result["recompute_num_tables"] = len(table_grads)
    result["recompute_table_grads_nonzero"] = all(g.abs().sum().item() > 0 for g in table_grads)


def check_virtual_pipeline(result):
    """PP2 vs PP2 x VPP2 (one layer per model chunk) from the same weights: one optimizer step
    (its global grad norm) and the loss after it must agree. Backward runs the interleaved
    schedule's p2p, where an activation/gradient mix-up would show."""
    from megatron.core.optimizer import OptimizerConfig

    from engram_train.training.optimizer import build_optimizer
    from engram_train.training.step import train_step

    batches = with_hash_ids([repeated_batches(1, 2, seed=200 + i)[0] for i in range(4)], [1, 3])
    root = None
    for name, layout in (("pp2", ParallelSizes(pipeline=2)), ("vpp2", ParallelSizes(pipeline=2, virtual_pipeline=2))):
        init(layout, seed=7 if name == "pp2" else 8)
        if root is None:
            root = shared_tmpdir()
        cfg = engram_config(layout, [1, 3], virtual_pipeline_model_parallel_size=layout.virtual_pipeline)
        model = build(cfg)
        if name == "pp2":
            save_checkpoint(root, 1, model)
        else:
            load_checkpoint(root, model)
        cfg.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
        optimizer = build_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3), model, cfg)
        first = train_step(model, optimizer, batches, SEQ, 2)
        second = train_step(model, optimizer, batches, SEQ, 2)
        result[f"vpp_{name}"] = [first.grad_norm, first.lm_loss, second.lm_loss]


def main():
    args = parse_args()
    result = {}
    check_plain_equals_gpt(result)
    check_layouts(result, [1, 3], "both_stages")
    check_layouts(result, [2, 3], "second_stage")
    check_recompute(result)
    check_virtual_pipeline(result)
    write_result(args.out, result)


if __name__ == "__main__":
    main()

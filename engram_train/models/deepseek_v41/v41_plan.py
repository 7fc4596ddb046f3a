"""DeepSeek-V4.1 in the plan (``engram-plan``, ``memory_plan/``; this family's `PlanTerms`,
`TERMS`): its parameters by category and rank share, its layer's activations, and its layout
check (docs/deepseek-v41.md 'Continued training, planned').

Parameters come from ``DeepseekV41GPTModel`` built on the meta device (``layers.{i}.attn.*``,
``.ffn.experts.*``, ...), with their own dtypes: under bf16 the mHC mappings, the sinks, the
compressors' projections, the Engram ``wkv`` and the output layer stay float32, and the
indexer is frozen (no gradient, no optimizer state).

How a rank shares them, as megatron would split V4.1 (where the trainer refuses a layout
today, ``training/run_config.py``, the plan is still made and its ``notes`` quote the
refusal): routed experts over EP, replicated over TP as the model places them (expert-TP 1:
the V4.1 MoE has no expert tensor parallelism; their optimizer state sharded over the expert
data-parallel group of world / (EP x TP x PP) ranks, each TP rank a replica); the query up-projection ``wq_b``, the sinks,
``wo_a`` (per group of heads), ``wo_b``'s input and the shared expert over TP; the shared K=V head ``wkv``, the query down-projection, the compressor,
the indexer, the router, norms and mHC mappings replicated; the tables over the Engram
embedding-parallel size.

Activations of one layer, bytes per token (``a`` the activation dtype's bytes, ``n`` mHC
streams, ``h`` hidden as held between layers (``h / TP`` under sequence parallelism), ``H``
heads / TP, ``d`` head_dim, ``G`` o_groups / TP, ``f`` moe_intermediate_size, ``k`` top-k):

- mHC, per sublayer (single pass, the mapping and collapse recomputed): the streams X and the
  sublayer output y in ``a`` and the float32 ``pre``, ``post``, ``comb``:
  ``(n + 1) h a + (2 n + n^2) 4``;
- attention (fused kernel over the window and the selected compressed keys: no
  ``[heads, s, keys]`` probabilities kept): norm in/out ``a (h + h_full)``, the query latent
  and its norm ``2 a q_lora``, the float32 query ``4 H d`` and the float32 K=V ``4 d`` the
  attention reads, the K=V projection and its norm ``2 a d``, the attention output and
  ``wo_a``'s output ``a (H d + G o_lora)``, the float32 log-sum-exp ``4 H``; a layer with a
  compressed branch adds its compressed keys ``4 d / r`` and, where it has a compressor, the
  compressor's float32 projections ``2 x 4 d`` (``wkv`` and ``wgate``);
- MoE: norm in/out, the router's float32 logits, scores and probabilities ``3 x 4 E``, per
  routed copy what the grouped experts keep (``v41_grouped_experts``: the dispatched row
  ``a h_full`` and the expert's output row the weighted combine keeps ``a h_full``, the gate
  and up GEMM outputs ``2 a f``, the float32 routing weight and the int64 pair indices, ``ROUTED_PAIR_BYTES``; the rest recomputed in their backward), divided
  by TP under sequence parallelism (each TP rank routes its own sequence slice to whole
  experts); the shared expert's clamped SwiGLU (gate and up in ``a``, its float32 product,
  the rounded input of ``w2``) ``(3 a + 12) f / TP``;
- Engram (V4.1 branch): the gathered rows in the table dtype and as the float32 input of
  ``wkv`` (``(t + 4) M``, ``M`` = (N - 1) x the per-order width), the float32 keys and value
  ``4 (G_e + 1) h_full`` and the gate's float32 normalised keys and gated value
  ``2 x 4 G_e h_full`` (``G_e`` its streams);
- under bf16, the float32 copies a float32 forward shares with its inputs (``BF16_*``).

The frozen indexer builds nothing autograd keeps (its output, the selection, is integer);
while one layer runs it scores ``[b, index heads, s, s / r]`` in float32, counted with the
backward's working set. On the CPU the project's reference attention is unfused: its float32
``[b, H, s, s + s / r]`` logits and probabilities are counted (``cpu_scores_per_layer``).
"""

from __future__ import annotations

import re

from engram_train.errors import ConfigError
from engram_train.models.model_family import PlanTerms

LAYER = re.compile(r"^layers\.(\d+)\.")
# Under bf16 the V4.1 forward's casts to float32 (the RoPE's complex product, the clamped
# SwiGLU, the router's input) keep copies that a float32 forward shares with its inputs;
# bytes per unit, measured with saved-tensor hooks on deepseek_v41_tiny (hidden 64 and 128,
# moe_intermediate_size 32 and 64: docs/deepseek-v41.md 'Continued training, planned').
BF16_ATTENTION_HD = 4  # per head x head_dim: the inverse RoPE's float32 input
BF16_ATTENTION_D = 4  # per head_dim: the K=V RoPE's float32 input
BF16_COMPRESSED_D = 12  # per head_dim, on a layer with a compressed branch
BF16_SWIGLU_F = 7  # per intermediate unit of each SwiGLU (routed copy or shared expert)
BF16_MOE_H = 6  # per hidden unit: the router's float32 input and the combine
# Per routed copy besides its row and its SwiGLU's gate and up: the float32 routing weight and
# the int64 pair indices the grouped experts keep (models/deepseek_v41/v41_grouped_experts.py).
ROUTED_PAIR_BYTES = 4 + 3 * 8
CPU_HEAP_HOLE_FRACTION = 0.67
"""V4.1's glibc heap holes per byte of its heap-placed activations (cpu_heap.py; DeepSeek-V3's
fraction is 0.4), from two runs of the tiny preset at sequence 16384, 3 steps, each measured
with glibc's default and with every block above 64 KiB returned at free
(``MALLOC_MMAP_THRESHOLD_=65536``): 2488 against 1942 MiB (546 MiB of holes over the plan's
1341 MiB of heap-placed activations after 3 passes: 0.77) and, after the combine began keeping
the experts' output rows, 2425 against 1998 MiB (427 over 1405: 0.58); the mean. The holes of
one configuration move by a quarter between runs. The plan's other items matched the fixed-
threshold peaks within 4-7% at 4096 and 16384 tokens. Held out: the tiny preset at 4096, hidden
128 in bf16 at 4096, CP2 with packed documents at 16384, hidden 96 at 8192 and TP2 with SP at
8192 (benchmarks/measure_memory_plan.py ``--set v41_long``)."""
SELECTION_BYTES = 8  # per selected compressed key of a token: the int64 selection
# Split over TP as megatron would split them (module docstring); the rest of a layer replicated.
_TP_SPLIT = re.compile(r"\.attn\.(wq_b|wo_a|wo_b|attn_sink)\b|\.ffn\.shared_experts\.")


def category(name: str, param) -> str:
    """The plan's category of a V4.1 parameter (``model_bytes.GROUP``)."""
    if getattr(param, "is_engram_table", False):
        return "engram_tables"
    if ".engram." in name:
        return "engram_branch"
    if name.startswith("embedding."):
        return "embedding"
    if name.startswith("output_layer."):
        return "output_layer"
    if ".ffn.experts." in name:
        return "routed_experts"
    if ".ffn.shared_experts." in name:
        return "shared_experts"
    if ".ffn.gate." in name:
        return "router"
    if "_hc." in name:
        return "mhc"
    if ".attn." in name:
        return "attention"
    return "norms"


def tp_split(name: str) -> bool:
    return bool(_TP_SPLIT.search(name))


def _args(config):
    return config.deepseek_v41


def sparse(config) -> bool:
    """The attention runs `v41_sparse_attention` (else the dense reference scores)."""
    return _args(config).attention_impl == "sparse"


def attention_per_token(config, layer: int, h: int, h_full: int, tp: int, a: int,
                        seq_length: int, cp: int) -> int:
    """Bytes per local token; under context parallelism (`cp`) the K=V and the compressed keys
    the core keeps are the whole sequence's (gathered), `cp` times the local tokens'."""
    args = _args(config)
    heads, d = args.num_attention_heads // tp, args.head_dim
    groups = max(args.o_groups // tp, 1)
    # the query and K=V the core reads: as they are (sparse) or as float32 copies (dense)
    core = a if sparse(config) else 4
    out = a * (h + h_full) + 2 * a * args.q_lora_rank + core * heads * d + core * d * cp
    out += 2 * a * d
    out += a * (heads * d + groups * args.o_lora_rank) + 4 * heads
    ratio = args.compress_ratios[layer]
    # the sparse core keeps the compressed keys as the full layer made them (one tensor for
    # every layer that reads them); the dense one concatenates a float32 copy per layer
    own_keys = ratio and (layer in args.kv_source_layer_ids or not sparse(config))
    if ratio:
        out += core * d * cp // ratio if own_keys else 0
        if layer in args.kv_source_layer_ids:
            out += 2 * 4 * d
        if layer in args.index_source_layer_ids:  # the int64 selection the core keeps
            out += SELECTION_BYTES * min(args.index_topk, seq_length // ratio)
    if a < 4:  # float32 copies a float32 forward does not make (measured, module docstring)
        out += BF16_ATTENTION_HD * heads * d + BF16_ATTENTION_D * d + (BF16_COMPRESSED_D * d if own_keys else 0)
    return out


def moe_per_token(config, h: int, h_full: int, tp: int, share: int, a: int) -> int:
    args = _args(config)
    f, k, e = args.moe_intermediate_size, args.num_experts_per_tok, args.n_routed_experts
    swiglu = 3 * a + 12 + (BF16_SWIGLU_F if a < 4 else 0)
    # the dispatched row and the expert's output row the weighted combine keeps
    routed = k * (2 * a * h_full + 2 * a * f + ROUTED_PAIR_BYTES) // share  # `routed_token_share`
    shared = args.n_shared_experts * swiglu * f // tp
    extra = BF16_MOE_H * h_full if a < 4 else 0
    return a * (h + h_full) + 3 * 4 * e + routed + shared + extra


def routed_token_share(layout) -> int:
    """The TP ranks a token's routed copies and Engram branch are spread over: TP under
    sequence parallelism (each rank routes its own slice of the sequence to whole experts and
    runs the Engram branch on it), else 1."""
    return layout.tp if layout.sequence_parallel else 1


def engram_per_token(config, h_full: int) -> int:
    memory = (config.max_ngram_size - 1) * config.n_embed_per_ngram
    g = config.engram_hc_mult
    table = 4 if config.engram_table_dtype == "fp32" else 2
    return (table + 4) * memory + 4 * (g + 1) * h_full + 2 * 4 * g * h_full


def mhc_per_token(config, h: int, a: int) -> int:
    n = _args(config).hc_mult
    return 2 * ((n + 1) * h * a + (2 * n + n * n) * 4)


def layer_per_token(config, layout, a: int, layer: int) -> dict[str, int]:
    """Bytes per token of V4.1 layer ``layer`` on one rank, by part."""
    h_full = config.hidden_size
    h = h_full // layout.tp if layout.sequence_parallel else h_full
    parts = {"attention": attention_per_token(config, layer, h, h_full, layout.tp, a,
                                              layout.seq_length, layout.cp),
             "moe": moe_per_token(config, h, h_full, layout.tp, routed_token_share(layout), a),
             "mhc": mhc_per_token(config, h, a)}
    if config.use_engram and layer in config.engram_layer_ids:
        # the branch runs on the rank's slice of the sequence under sequence parallelism
        parts["engram"] = engram_per_token(config, h_full) // routed_token_share(layout)
    return parts


def indexer_transient(config, layout, layer: int) -> int:
    """The frozen indexer's working set while layer ``layer`` runs (nothing kept): a block of
    queries' float32 products ``[Q, b, index heads, t]`` (the einsum, its relu and the
    weighted copy) and the block's scores, their int64 sort keys and visibility ``[Q, b, t]``
    (`v41_csa.DeepseekV41Indexer.query_block`); the index heads are replicated over TP."""
    from engram_train.models.deepseek_v41.v41_csa import INDEX_WORKING_SET_BYTES

    args = _args(config)
    ratio = args.compress_ratios[layer]
    if not ratio or layer not in args.index_source_layer_ids:
        return 0
    b, t = layout.micro_batch_size, layout.seq_length // ratio
    per_query = 4 * b * args.index_n_heads * t
    queries = max(1, min(256, INDEX_WORKING_SET_BYTES // max(per_query, 1), layout.seq_length))
    return queries * (3 * per_query + b * t * (4 + 8 + 1 + 4))


def attention_transient(config, layout, layer: int, a: int) -> int:
    """The sparse attention's backward working set of layer ``layer`` (nothing kept): the
    float32 gradients of the query, the K=V and the compressed keys for the whole sequence,
    their casts to the model dtype, and one block of queries' scores, probabilities and their
    gradients ``[b, H, Q, Q + window + k]`` with the gathered keys and their gradients
    (`v41_sparse_attention.query_block`)."""
    from engram_train.models.deepseek_v41.v41_sparse_attention import query_block

    if not sparse(config):
        return 0
    args = _args(config)
    ratio = args.compress_ratios[layer]
    b, s = layout.micro_batch_size, layout.seq_length
    heads, d, window = args.num_attention_heads // layout.tp, args.head_dim, args.sliding_window
    k = min(args.index_topk, s // ratio) if ratio else 0
    block = query_block(b, heads, window, k, s // layout.cp)
    # the query's gradient for the rank's tokens, the keys' for the whole (gathered) sequence
    whole = b * (s // layout.cp * heads * d + s * (d + (d // ratio if ratio else 0)))
    whole *= 4 + (a if a < 4 else 0)
    return whole + 5 * 4 * b * heads * block * (block + window + k) + 2 * 4 * b * block * k * d


def cpu_scores_per_layer(config, layout, layer: int) -> int:
    """The dense reference attention's float32 logits and probabilities ``[b, H, s, s + s /
    r]`` (``attention_impl: dense``, on any device; 0 for the sparse attention)."""
    if sparse(config):
        return 0
    args = _args(config)
    ratio = args.compress_ratios[layer]
    keys = layout.seq_length + (layout.seq_length // ratio if ratio else 0)
    heads = args.num_attention_heads // layout.tp
    return 2 * layout.micro_batch_size * heads * (layout.seq_length // layout.cp) * keys * 4


def logits_bytes_per_entry(a: int) -> int:
    """The float32 output layer's logits at the forward's end: megatron's vocab-parallel cross
    entropy keeps one float32 copy (the exponentiated, shifted logits, turned into their
    gradient in place); the logits themselves are freed when the model's forward returns.
    Measured at the forward's end with every heap block returned at free (the tiny preset at
    sequence 4096 and 16384: 66 and 262 MiB after the layers, 64 and 256 MiB of them logits)."""
    return 4


def backward_beyond_logits(working_set: int, logits: int) -> int:
    """The last stage's backward working set above its forward-end peak: the output layer's
    backward frees the logits' gradient before the last layer's backward starts, so the
    layers' working set takes the logits' place (measured: the tiny preset's peak is at the
    forward's end at 4096 and 16384 tokens, the backward stays below it)."""
    return max(0, working_set - logits)


NOT_TRAINABLE_YET = "planned as megatron would split DeepSeek-V4.1"


def validation_cfg(cfg):
    """A copy of ``cfg`` with the sizes the trainer refuses for V4.1 today at 1, so that every
    other rule of ``validate_run_config`` still runs; the layout itself is checked apart."""
    from omegaconf import OmegaConf

    plain = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                "expert_model_parallel_size", "context_parallel_size"):
        plain.system[key] = 1
    plain.system.virtual_pipeline_model_parallel_size = None
    plain.system.recompute_granularity = None
    if "engram_embedding_parallel_size" in plain.model:
        plain.model.engram_embedding_parallel_size = 1
    return plain


def check_layout(cfg, config, world: int, p) -> None:
    """The layout rules ``validate_run_config`` skipped for V4.1 (``validation_cfg``); `p`:
    the run config's ``ParallelSizes``."""
    p.validate(world)
    dp = world // (p.tensor * p.pipeline * p.context)
    t = cfg.train
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise ConfigError(f"train.global_batch_size={t.global_batch_size} must be divisible by "
                          f"train.micro_batch_size={t.micro_batch_size} x data-parallel size {dp}")
    if config.num_layers % p.pipeline:
        raise ConfigError(f"{config.num_layers} layers are not divisible by "
                          f"system.pipeline_model_parallel_size={p.pipeline}")
    if config.num_moe_experts % p.expert:
        raise ConfigError(f"{config.num_moe_experts} experts are not divisible by "
                          f"system.expert_model_parallel_size={p.expert}")


def with_recompute(cfg, config):
    """``config`` with ``cfg``'s recompute granularity (the validated copy has none): a
    shallow copy, the cached config is shared between layouts."""
    import copy

    if cfg.system.recompute_granularity == config.recompute_granularity:
        return config
    config = copy.copy(config)
    config.recompute_granularity = cfg.system.recompute_granularity
    return config


def layout_sizes(config, layout, p):
    """``layout`` (made from the validated copy) with the sizes of the run config (`p`, its
    ``ParallelSizes``): the Engram table shards, and the experts' tensor-parallel size: 1, the
    routed experts whole on every TP rank (as ``DeepseekV41Experts`` places them; the expert
    data-parallel group still spans world / (EP x TP x PP) ranks, as megatron's with
    expert-TP = TP)."""
    from dataclasses import replace

    shards = 1
    if config.use_engram:
        shards = p.tensor if config.engram_embedding_parallel_method == "allreduce" else p.engram_embedding
    return replace(layout, table_shards=shards, etp=1,
                   expert_dp=layout.world // (p.expert * p.tensor * p.pipeline))


def layer_transient(config, layout, layer: int, a: int) -> int:
    """The indexer's and the sparse attention's blocks while layer ``layer`` runs."""
    return indexer_transient(config, layout, layer) + attention_transient(config, layout, layer, a)


def residual_streams(config) -> int:
    return _args(config).hc_mult


TERMS = PlanTerms(
    category=category, layer_pattern=LAYER, tp_split=tp_split, layer_per_token=layer_per_token,
    residual_streams=residual_streams, layer_transient=layer_transient,
    scores_per_layer=cpu_scores_per_layer, logits_bytes_per_entry=logits_bytes_per_entry,
    backward_beyond_logits=backward_beyond_logits, cpu_heap_hole_fraction=CPU_HEAP_HOLE_FRACTION,
    validation_cfg=validation_cfg, check_layout=check_layout, layout_sizes=layout_sizes,
    with_recompute=with_recompute, not_trainable=NOT_TRAINABLE_YET)

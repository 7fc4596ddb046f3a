"""The Engram variants behind one config: ``engram_variant`` picks the hash mapping and the
branch module, and every caller (the trainer's plan, the model, the layer specs, the export)
builds them here rather than naming a class.

- ``paper``: `NgramHashMapping` and `Engram` (DeepSeek's Engram paper).
- ``deepseek_v41``: `DeepseekV41NgramHashMapping` and `DeepseekV41Engram`, with the
  `EngramConfig` fields mapped onto V4.1's (`v41_engram_args`, docs/deepseek-v41.md):

  ==========================  ===================================================
  EngramConfig                DeepseekV41EngramArgs
  ==========================  ===================================================
  engram_layer_ids            engram_layer_ids
  max_ngram_size              engram_max_ngram_size
  n_head_per_ngram            engram_n_heads
  n_embed_per_ngram           engram_n_heads x engram_head_dim
  engram_vocab_size (N-1)     engram_vocab_size (one value; equal entries required)
  engram_pad_id               engram_pad_token_id
  engram_hc_mult              hc_mult
  engram_gate_eps / backbone  rms_norm_eps (None: the backbone's layernorm_epsilon)
  engram_init_std             initializer_range
  ==========================  ===================================================

  ``engram_reset_at_eos`` + ``engram_eos_id`` give V4.1's document starts
  (`document_ids`); ``engram_seed`` seeds the tables' init only (V4.1's hash multipliers are
  its fixed ones, seed 0).
"""

from __future__ import annotations

from engram_train.engram.engram_module import Engram
from engram_train.engram.ngram_hash import NgramHashMapping
from engram_train.engram.v41_engram_module import DeepseekV41Engram
from engram_train.engram.v41_ngram_hash import DeepseekV41EngramArgs, DeepseekV41NgramHashMapping

V41 = "deepseek_v41"
V41_DEFAULT_GATE_EPS = DeepseekV41EngramArgs.rms_norm_eps  # for a config without a backbone


def is_v41(config) -> bool:
    """``engram_variant=deepseek_v41`` (a config without the field is the paper variant)."""
    return getattr(config, "engram_variant", "paper") == V41


def v41_engram_args(config) -> DeepseekV41EngramArgs:
    """The V4.1 fields of an `EngramConfig` (or a model config composed with it; module
    docstring). Validation ran with the config: equal table sizes, no conv settings."""
    eps = config.engram_gate_eps
    if eps is None:
        eps = getattr(config, "layernorm_epsilon", None) or V41_DEFAULT_GATE_EPS
    heads = int(config.n_head_per_ngram)
    return DeepseekV41EngramArgs(
        engram_layer_ids=tuple(config.engram_layer_ids),
        engram_max_ngram_size=int(config.max_ngram_size),
        engram_n_heads=heads,
        engram_head_dim=int(config.n_embed_per_ngram) // heads,
        engram_vocab_size=int(config.engram_vocab_size[0]),
        engram_pad_token_id=int(config.engram_pad_id),
        hc_mult=int(config.engram_hc_mult),
        rms_norm_eps=float(eps),
        initializer_range=float(config.engram_init_std),
    )


def build_hash_mapping(config, tokenizer=None, num_threads: int = 1) -> NgramHashMapping:
    """The hash mapping of ``config``'s variant. ``tokenizer``: a `CompressedTokenizer` or its
    lookup array (default: ``engram_tokenizer_name_or_path``). Its ``hash_block`` is what the
    model takes for a micro-batch (the data path calls it with the tokens)."""
    if not is_v41(config):
        return NgramHashMapping(config, tokenizer, num_threads=num_threads)
    if tokenizer is None:
        tokenizer = config.engram_tokenizer_name_or_path
    eos = config.engram_eos_id if config.engram_reset_at_eos else None
    return DeepseekV41NgramHashMapping(v41_engram_args(config), tokenizer,
                                       num_threads=num_threads, eos_id=eos)


class DeepseekV41EngramBranch(DeepseekV41Engram):
    """`DeepseekV41Engram` built from the model config, with the paper module's constructor
    (``config, hidden_size, layer_id, **options``), so that the Engram layer and the export
    build either variant alike: the table's seed (``engram_seed``) and placement
    (``engram_table_placement``) come from the config, the rest as the paper module takes
    them (``embedding_parallel``, ``row_start``/``row_end``, ``device``, ``dtype``,
    ``table_dtype``, ``table``)."""

    def __init__(self, config, hidden_size: int, layer_id: int, **options) -> None:
        options.setdefault("seed", config.engram_seed)
        options.setdefault("placement", config.engram_table_placement)
        if options.get("table_dtype") is None and options.get("dtype") is None:
            from engram_train.config import engram_table_dtype

            options["table_dtype"] = engram_table_dtype(config)
        super().__init__(v41_engram_args(config), hidden_size, layer_id, **options)


def engram_branch_class(config) -> type:
    """The Engram branch module of ``config``'s variant; both take ``(config, hidden_size,
    layer_id, **options)``."""
    return DeepseekV41EngramBranch if is_v41(config) else Engram

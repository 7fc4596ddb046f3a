"""A DeepSeek-V4.1 ``config.json`` <-> a V4.1 model preset.

The folder's ``config.json`` is the composite one NeMo Automodel's ``DeepseekV41Config`` saves
(``model_type: deepseek_v41``, the language model's fields in ``text_config``, the vision
tower's in ``vision_config``). Import (`v41_preset_from_hf`): every ``text_config`` field is a
preset field (the backbone's under V4.1's names, the Engram fields under the project's, as
``engram/variant.py`` maps them), a required value (``num_key_value_heads`` 1, ...), or not
part of the text model (metadata, the DSpark draft, the vision side); an unknown field is
refused in one line. Export (`v41_hf_config`): the preset back into that composite document,
the vision tower absent (``num_hidden_layers`` 0) and no draft (``num_nextn_predict_layers``
0).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engram_train.models.hf_mapping import NOT_THE_MODEL, HFConfigError

MODEL_TYPE = "deepseek_v41"
TEXT_MODEL_TYPE = "deepseek_v41_text"
ARCHITECTURE = "DeepseekV41ForCausalLM"
_REQUIRED = (("num_key_value_heads", 1, "V4.1 attends with one shared K=V head"),
             ("hidden_act", "silu", "V4.1's experts are SwiGLU"),
             ("attention_bias", False, "V4.1's projections have no bias"),
             ("topk_method", "noaux_tc", "V4.1 routes with noaux_tc"),
             ("tie_word_embeddings", False, "V4.1's head is untied"))
_ENGRAM = ("engram_layer_ids", "engram_num_embeddings", "engram_max_ngram_size",
           "engram_vocab_size", "engram_n_heads", "engram_head_dim", "engram_pad_token_id",
           "engram_compressed_vocab_size")
# text_config fields outside the text model: metadata, the draft's, the vision side's
_OUTSIDE = set(NOT_THE_MODEL) | {
    "vocab_size", "num_nextn_predict_layers", "dspark_block_size", "dspark_noise_token_id",
    "dspark_target_layer_ids", "dspark_markov_rank", "dspark_n_routed_experts",
    "dspark_num_experts_per_tok", "image_token_id"}


TRAINING_ONLY = ("fake_quantize", "attention_impl", "document_eos_id",
                 "moe_router_bias_update_rate")
"""`DeepseekV41BackboneArgs` fields of the project's runs, not of the model: never read from a
``config.json`` nor written to one."""


def is_v41(doc: dict) -> bool:
    """Whether a ``config.json`` is a DeepSeek-V4.1 one (composite or its text part)."""
    return doc.get("model_type") in (MODEL_TYPE, TEXT_MODEL_TYPE)


def _refuse(field: str, value: Any, why: str) -> None:
    raise HFConfigError(f"config.json text_config.{field}={value!r}: {why}")


def text_config(doc: dict) -> dict:
    """The language model's fields of a V4.1 ``config.json``."""
    if doc.get("model_type") == TEXT_MODEL_TYPE:
        return dict(doc)
    text = doc.get("text_config")
    if not isinstance(text, dict):
        raise HFConfigError("config.json model_type='deepseek_v41' without a text_config: give "
                            "the composite config NeMo Automodel's DeepseekV41Config saves")
    return dict(text)


def _rope_scaling(text: dict) -> dict | None:
    params = dict(text.get("rope_scaling") or text.get("rope_parameters") or {})
    kind = params.pop("rope_type", params.pop("type", "default"))
    if kind in ("default", None):
        return None
    if kind != "yarn":
        _refuse("rope_parameters.rope_type", kind, "V4.1's compressed layers take 'yarn' or none")
    params.pop("rope_theta", None)
    keep = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")
    extra = sorted(set(params) - set(keep))
    if extra:
        _refuse("rope_parameters", {k: params[k] for k in extra}, "fields V4.1's frequency-only "
                "YaRN does not have")
    return {k: params[k] for k in keep if k in params}


def _check_table_rows(text: dict, layers: list, n: int, heads: int) -> None:
    """``engram_num_embeddings`` (when given) is each layer's sum of primes: the table rows the
    hash addresses, which the import builds and the export writes back."""
    given = text.get("engram_num_embeddings")
    if given is None:
        return
    from engram_train.engram.ngram_hash import engram_head_vocab_sizes

    primes = engram_head_vocab_sizes([int(text["engram_vocab_size"])] * (n - 1), n, heads,
                                     layers)
    rows = [sum(sum(order) for order in primes[int(i)]) for i in layers]
    if not isinstance(given, list) or [int(r) for r in given] != rows:
        _refuse("engram_num_embeddings", given, f"the hash of engram_layer_ids={layers} "
                f"addresses exactly {rows} rows (each layer's sum of primes above "
                f"engram_vocab_size={text['engram_vocab_size']}); set it to {rows}")


def _engram_section(text: dict) -> dict:
    layers = list(text.get("engram_layer_ids") or [])
    if not layers:
        return {"use_engram": False}
    n, heads = int(text["engram_max_ngram_size"]), int(text["engram_n_heads"])
    _check_table_rows(text, layers, n, heads)
    return {"use_engram": True, "engram_variant": "deepseek_v41",
            "engram_tokenizer_name_or_path": "${data.tokenizer}",
            "engram_layer_ids": layers, "max_ngram_size": n, "n_head_per_ngram": heads,
            "n_embed_per_ngram": heads * int(text["engram_head_dim"]),
            "engram_vocab_size": [int(text["engram_vocab_size"])] * (n - 1),
            "engram_pad_id": int(text["engram_pad_token_id"]),
            "engram_init_std": float(text.get("initializer_range", 0.02))}


def v41_preset_from_hf(doc: dict) -> dict:
    """The V4.1 model section of a ``config.json`` (`HFConfigError` naming the field)."""
    from engram_train.models.deepseek_v41.v41_config import V41_FIELDS

    text = text_config(doc)
    for field, want, why in _REQUIRED:
        if text.get(field, want) != want:
            _refuse(field, text[field], why)
    backbone = {k: text[k] for k in V41_FIELDS
                if k in text and k != "rope_scaling" and k not in TRAINING_ONLY}
    backbone["rope_scaling"] = _rope_scaling(text)
    backbone["fake_quantize"] = True  # the released caches' rounding (false: layout checks)
    missing = sorted({"hidden_size", "num_hidden_layers", "moe_intermediate_size"} - set(backbone))
    if missing:
        raise HFConfigError(f"config.json text_config has no {missing[0]} (a V4.1 size)")
    known = set(V41_FIELDS) | set(_ENGRAM) | {f for f, _, _ in _REQUIRED} | _OUTSIDE | {
        "rope_parameters"}
    unknown = sorted(set(text) - known)
    if unknown:
        _refuse(unknown[0], text[unknown[0]], f"not a DeepSeek-V4.1 field this import knows (all "
                f"unknown: {unknown}); remove it if it does not change the model")
    return {"model_family": MODEL_TYPE, **backbone, **_engram_section(text)}


def _text_fields(args) -> dict:
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)
              if f.name != "rope_scaling" and f.name not in TRAINING_ONLY}
    fields = {k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()}
    rope = {"rope_type": "default", "rope_theta": float(args.rope_theta)}
    if args.rope_scaling is not None:
        rope = {"rope_type": "yarn", "rope_theta": float(args.rope_theta),
                **dataclasses.asdict(args.rope_scaling)}
    fields["rope_parameters"] = rope
    fields.update({field: want for field, want, _ in _REQUIRED})
    return fields


def v41_hf_config(model: dict, vocab_size: int, engram_rows: list[int],
                  compressed_vocab_size: int | None, dtype: str) -> dict:
    """The composite ``config.json`` of a V4.1 model section: `vocab_size` the released rows of
    the embedding and head, `engram_rows` each Engram layer's table rows."""
    from engram_train.config import EngramConfig
    from engram_train.models.deepseek_v41.v41_config import split_v41_preset

    args, rest = split_v41_preset(model)
    text = _text_fields(args)
    text.update(vocab_size=int(vocab_size), num_nextn_predict_layers=0, dtype=dtype,
                model_type=TEXT_MODEL_TYPE, engram_layer_ids=[], engram_num_embeddings=[])
    if rest.get("use_engram"):
        defaults = {f.name: f.default if f.default is not dataclasses.MISSING
                    else f.default_factory() for f in dataclasses.fields(EngramConfig)}
        text.update(_engram_fields({**defaults, **rest}), engram_num_embeddings=[int(r) for r in engram_rows],
                    engram_compressed_vocab_size=int(compressed_vocab_size))
    return {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "dtype": dtype,
            "tie_word_embeddings": False, "text_config": text,
            "vision_config": {"model_type": "deepseek_v41_vision", "num_hidden_layers": 0}}


def _engram_fields(rest: dict) -> dict:
    heads = int(rest["n_head_per_ngram"])
    sizes = {int(v) for v in rest["engram_vocab_size"]}
    if len(sizes) != 1:
        raise HFConfigError(f"model.engram_vocab_size={list(rest['engram_vocab_size'])}: V4.1 "
                            "has one engram_vocab_size for every n-gram order")
    return {"engram_layer_ids": [int(i) for i in rest["engram_layer_ids"]],
            "engram_max_ngram_size": int(rest["max_ngram_size"]),
            "engram_vocab_size": sizes.pop(), "engram_n_heads": heads,
            "engram_head_dim": int(rest["n_embed_per_ngram"]) // heads,
            "engram_pad_token_id": int(rest["engram_pad_id"])}

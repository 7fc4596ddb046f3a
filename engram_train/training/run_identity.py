"""The run identity: what a checkpoint records so that a resume cannot silently change meaning.

Three parts, each compared on resume with a clear error that names the config key, both values
and the override that accepts the change:

- ``engram``: everything that decides which table row a token's n-gram reads (seed, the
  compressed tokenizer's digest and size, N, H, layer ids, the table primes, the pad id, the
  hash multipliers) and the Engram shapes. A change re-hashes tokens into rows trained for other
  n-grams. Override: ``checkpoint.load_engram=false`` (keep the backbone, start Engram afresh).
- ``engram_optimizer_state``: the layout of the table optimizer's state, ``elementwise``
  (``sparse_adam``, ``adam``: two moments per element, interchangeable) or ``rowwise``
  (``rowwise_adam``: a second moment per row). A checkpoint resumes only into the same layout;
  same override.
- ``engram_table_storage``: the tables' dtype and whether a float32 master is saved beside
  them (``engram_table_dtype``, ``engram_master_weights``). The saved keys and values follow
  them (a bf16 table with a master saves ``optimizer.state.fp32_param``, an fp32 table is its
  own master, a table without master saves rounded values only), so a change does not load
  (or would round the values); same override.
- ``model``: the backbone fields that decide parameter shapes. No override: a checkpoint's
  shapes cannot change.
- the LR schedule (megatron's ``OptimizerParamScheduler`` state, saved in every checkpoint).
  As in Megatron-LM: ``checkpoint.override_opt_param_scheduler`` takes this run's schedule,
  ``checkpoint.use_checkpoint_opt_param_scheduler`` keeps the checkpoint's; without either a
  difference is an error (a longer ``train_iters`` would otherwise run at ``min_lr``).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

import numpy as np

from engram_train.errors import EngramError, InputError

# Backbone config fields that decide parameter shapes (those a config lacks are recorded as None).
SHAPE_FIELDS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "multi_latent_attention",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_head_dim",
    "qk_pos_emb_head_dim",
    "v_head_dim",
    "num_moe_experts",
    "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size",
    "moe_layer_freq",
    "gated_linear_unit",
    "add_bias_linear",
    "add_qkv_bias",
    "normalization",
    "qk_layernorm",
    "mtp_num_layers",
    "enable_hyper_connections",
    "num_residual_streams",
)
# Shape fields recorded after checkpoints already existed: their value in an older checkpoint.
SHAPE_FIELD_DEFAULTS = {"enable_hyper_connections": False, "num_residual_streams": None}
ENGRAM_FIELDS = (
    "engram_variant",
    "engram_seed",
    "engram_layer_ids",
    "max_ngram_size",
    "n_head_per_ngram",
    "n_embed_per_ngram",
    "engram_vocab_size",
    "engram_pad_id",
    "engram_kernel_size",
    "engram_hc_mult",
    "engram_reset_at_eos",
    "engram_eos_id",
)
# Engram fields recorded after checkpoints already existed: their value in an older checkpoint.
ENGRAM_FIELD_DEFAULTS = {"engram_variant": "paper"}
# What each derived Engram entry depends on, for the error message.
ENGRAM_DERIVED = {
    "tokenizer": "model.engram_tokenizer_name_or_path (the compressed vocabulary)",
    "primes": "the table primes (from model.engram_vocab_size, n_head_per_ngram, engram_layer_ids)",
    "multipliers_sha256": "the hash multipliers (from model.engram_seed, engram_layer_ids and the "
    "compressed vocabulary size)",
    "compressed_pad_id": "the compressed pad id (model.engram_pad_id through the tokenizer)",
}
# megatron OptimizerParamScheduler.state_dict() entries -> the train keys that set them.
SCHEDULE_KEYS = {
    "max_lr": "train.lr",
    "min_lr": "train.min_lr",
    "lr_warmup_steps": "train.lr_warmup_iters",
    "lr_decay_steps": "train.lr_decay_iters",
    "lr_decay_style": "train.lr_decay_style",
    "start_wd": "train.weight_decay",
    "end_wd": "train.weight_decay",
    "wd_incr_steps": "train.lr_decay_iters",
    "wd_incr_style": "train.weight_decay",
}
_IN_SAMPLES = ("lr_warmup_steps", "lr_decay_steps", "wd_incr_steps")


class ResumeMismatchError(EngramError, ValueError):
    """A checkpoint does not match this run; the message names each key and the override.

    ``overrides``: the settings that accept every listed difference (empty when one of them
    cannot be accepted, e.g. a parameter shape)."""

    def __init__(self, message: str, overrides: tuple[str, ...] = ()):
        super().__init__(message)
        self.overrides = tuple(overrides)


def combine_mismatches(errors: list[ResumeMismatchError]) -> ResumeMismatchError:
    """One error listing every mismatch of ``errors`` (run identity, LR schedule), ending with
    the one relaunch that accepts them all when every part has an override."""
    if len(errors) == 1:
        return errors[0]
    overrides = tuple(o for e in errors for o in e.overrides)
    message = "\n".join(str(e) for e in errors)
    if all(e.overrides for e in errors):
        message += ("\nTo accept every difference above in one relaunch, add: " + " ".join(overrides))
    return ResumeMismatchError(message, overrides if all(e.overrides for e in errors) else ())


def _plain(value: Any) -> Any:
    """JSON-comparable form (lists, not tuples/ListConfig; ints, not numpy ints)."""
    return json.loads(json.dumps(value, default=lambda v: v.tolist() if hasattr(v, "tolist") else list(v)))


def engram_identity(config, mapping) -> dict:
    """The Engram hash identity of ``config``, read from the `NgramHashMapping` the run uses."""
    multipliers = np.stack([mapping.multipliers[layer] for layer in mapping.layer_ids])
    return _plain(
        {
            **{name: getattr(config, name) for name in ENGRAM_FIELDS},
            "tokenizer": {
                "lookup_sha256": hashlib.sha256(
                    np.ascontiguousarray(mapping.lookup, dtype="<i8").tobytes()
                ).hexdigest(),
                "compressed_vocab_size": int(mapping.compressed_vocab_size),
                "raw_vocab_size": int(mapping.num_raw_ids),
            },
            "compressed_pad_id": int(mapping.pad_id),
            "primes": {str(layer): mapping.primes[layer].tolist() for layer in mapping.layer_ids},
            "multipliers_sha256": hashlib.sha256(
                np.ascontiguousarray(multipliers, dtype="<i8").tobytes()
            ).hexdigest(),
        }
    )


def engram_identity_changes(saved: Mapping, current: Mapping) -> list[tuple[str, Any, Any]]:
    """(key, saved, current) for every Engram identity entry that differs, reduced to what a
    user changed: a changed ``engram_variant`` alone (every other difference follows from it),
    else the changed settings and tokenizer without what they derive. A field an identity
    lacks (recorded after it was saved) counts at its `ENGRAM_FIELD_DEFAULTS` value."""
    changes = _diff({**ENGRAM_FIELD_DEFAULTS, **saved}, {**ENGRAM_FIELD_DEFAULTS, **current})
    variant = [c for c in changes if c[0] == "engram_variant"]
    if variant:
        return variant
    if any(key in ENGRAM_FIELDS or key == "tokenizer" for key, _, _ in changes):
        changes = [c for c in changes if c[0] in ENGRAM_FIELDS or c[0] == "tokenizer"]
    return changes


def model_identity(config, padded_vocab_size: int) -> dict:
    shape = {name: getattr(config, name, None) for name in SHAPE_FIELDS}
    shape["enable_hyper_connections"] = bool(shape["enable_hyper_connections"])
    if not shape["enable_hyper_connections"]:
        shape["num_residual_streams"] = None  # one stream: the option does not apply
    shape["padded_vocab_size"] = int(padded_vocab_size)
    return _plain(shape)


def optimizer_state_layout(config) -> str:
    """``rowwise`` for ``engram_optimizer: rowwise_adam``, else ``elementwise``."""
    return "rowwise" if config.engram_optimizer == "rowwise_adam" else "elementwise"


def table_storage(config) -> dict:
    """``{"dtype": engram_table_dtype, "master": bool}``: ``master`` when a float32 master of a
    low-precision table is kept and saved (the optimizer's ``mixed_precision``); fp8 tables
    (never a master) add ``"frozen"``: frozen ones save no optimizer state."""
    dtype = str(config.engram_table_dtype)
    if dtype == "fp8_e4m3":
        return {"dtype": dtype, "master": False, "frozen": bool(config.engram_freeze_tables)}
    master = dtype != "fp32" and bool(config.engram_master_weights)
    return {"dtype": dtype, "master": master}


def run_identity(config, padded_vocab_size: int, mapping=None) -> dict:
    """``{"model": ..., "use_engram": bool, "engram": ... or None, "engram_optimizer_state":
    ... or None, "engram_table_storage": ... or None}`` for a manifest."""
    use = bool(config.use_engram)
    if use and mapping is None:
        raise InputError("run_identity: an Engram run needs its NgramHashMapping")
    return {
        "model": model_identity(config, padded_vocab_size),
        "use_engram": use,
        "engram": engram_identity(config, mapping) if use else None,
        "engram_optimizer_state": optimizer_state_layout(config) if use else None,
        "engram_table_storage": table_storage(config) if use else None,
    }


def _show(value: Any, limit: int = 60) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _diff(saved: Mapping, current: Mapping) -> list[tuple[str, Any, Any]]:
    return [(k, saved.get(k), current.get(k)) for k in sorted(set(saved) | set(current))
            if saved.get(k) != current.get(k)]


def check_run_identity(saved: Mapping | None, current: Mapping, *, load_engram: bool, where: str) -> None:
    """Raise `ResumeMismatchError` listing every difference (a no-op for ``saved`` None:
    checkpoints saved before identities were recorded)."""
    if not saved:
        return
    lines: list[str] = []
    overrides: list[str] = []
    shape_changed = False
    saved_model = {**SHAPE_FIELD_DEFAULTS, **(saved.get("model") or {})}
    for key, old, new in _diff(saved_model, current["model"]):
        if key == "padded_vocab_size":
            what = "data.tokenizer (vocabulary size, padded to a multiple of 128 x tensor parallel)"
        elif key == "enable_hyper_connections":
            what = (f"model.enable_hyper_connections (mHC): the checkpoint's backbone has "
                    f"{'n residual streams and their mapping parameters' if old else 'one residual stream'}, "
                    f"this run's {'has' if new else 'has not'}")
        else:
            what = f"model.{key}"
        lines.append(
            f"{what}: {_show(old)} in the checkpoint, {_show(new)} here. Parameter shapes cannot "
            f"change on resume: use the checkpoint's value, or start a new run"
        )
        shape_changed = True
    was, now = bool(saved.get("use_engram")), bool(current.get("use_engram"))
    if not load_engram:
        pass
    elif was != now:
        overrides.append("checkpoint.load_engram=false")
        if now:
            lines.append(
                "model.use_engram: the checkpoint was saved without Engram, this run has "
                "use_engram=true. To add Engram to this model (backbone weights and optimizer "
                "state loaded, Engram initialised afresh, schedule continued) set "
                "checkpoint.load_engram=false (docs/engram-integration.md, continued pretraining)"
            )
        else:
            lines.append(
                "model.use_engram: the checkpoint has Engram, this run has use_engram=false. To "
                "drop Engram and keep the backbone set checkpoint.load_engram=false"
            )
    elif now:
        changes = engram_identity_changes(saved.get("engram") or {}, current["engram"])
        if changes:
            overrides.append("checkpoint.load_engram=false")
        for key, old, new in changes:
            what = ENGRAM_DERIVED.get(key, f"model.{key}")
            if key == "engram_variant":
                lines.append(
                    f"model.engram_variant: {_show(old)} in the checkpoint, {_show(new)} here. The "
                    "variants' Engram branches have other parameters and hash differently: resume "
                    f"with model.engram_variant={_show(old)}, or set checkpoint.load_engram=false "
                    "to keep the backbone and start Engram afresh")
                continue
            if key == "engram_hc_mult":  # follows the backbone's residual streams (config/mhc.py)
                fix = (f"it follows the backbone's residual streams: resume with the checkpoint's "
                       f"model.enable_hyper_connections and model.num_residual_streams={_show(old)}"
                       if old != 1 else "resume with model.enable_hyper_connections=false")
            elif key in ENGRAM_FIELDS:
                fix = f"resume with model.{key}={_show(old)}"
            else:
                fix = "resume with the checkpoint's Engram settings"
            lines.append(
                f"{what}: {_show(old)} in the checkpoint, {_show(new)} here. Tokens would hash to "
                f"rows trained for other n-grams: {fix}, or set checkpoint.load_engram=false to "
                "keep the backbone and start Engram afresh"
            )
    if load_engram and was and now:
        state = _table_state_changes(saved, current)
        if state and "checkpoint.load_engram=false" not in overrides:
            overrides.append("checkpoint.load_engram=false")
        lines += state
    if lines:
        raise ResumeMismatchError(
            f"checkpoint {where} does not match this run:\n  - " + "\n  - ".join(lines),
            () if shape_changed else tuple(overrides),
        )


def _table_state_changes(saved: Mapping, current: Mapping) -> list[str]:
    """Lines for a table optimizer state layout or a table storage that changed (both Engram
    runs, Engram loaded)."""
    lines = []
    # checkpoints saved before layouts were recorded hold sparse_adam/adam state
    old = saved.get("engram_optimizer_state") or "elementwise"
    new = current.get("engram_optimizer_state")
    if new is not None and old != new:
        saved_as = ("rowwise_adam (a second moment per row)" if old == "rowwise" else
                    "sparse_adam or adam (two moments per element)")
        lines.append(
            f"model.engram_optimizer: the checkpoint's table optimizer state is {old}, saved "
            f"by {saved_as}; this run's is {new}. The moments do not convert: resume with "
            f"model.engram_optimizer={'rowwise_adam' if old == 'rowwise' else 'sparse_adam'}, "
            "or set checkpoint.load_engram=false to keep the backbone and start Engram afresh"
        )
    storage = _storage_change(saved.get("engram_table_storage"), current.get("engram_table_storage"))
    return lines + ([storage] if storage else [])


def _describe_storage(storage: Mapping) -> str:
    if storage["dtype"] == "fp32":
        return "fp32 tables (their own master)"
    if "frozen" in storage:
        return f"{storage['dtype']} tables " + ("frozen (no optimizer state)" if storage["frozen"]
                                                else "trained without float32 master")
    return f"{storage['dtype']} tables " + ("with" if storage["master"] else "without") + " float32 master"


def _storage_change(old: Mapping | None, new: Mapping | None) -> str | None:
    """The line refusing a change of the tables' dtype or master (None: unchanged, or a
    checkpoint saved before the storage was recorded)."""
    if not old or not new or dict(old) == dict(new):
        return None
    if old["dtype"] == new["dtype"] and old.get("frozen") != new.get("frozen"):  # fp8 both
        was, now = str(old["frozen"]).lower(), str(new["frozen"]).lower()
        return (f"model.engram_freeze_tables: {was} in the checkpoint, {now} here. The "
                f"checkpoint holds {_describe_storage(old)}, this run keeps "
                f"{_describe_storage(new)}: resume with model.engram_freeze_tables={was}, or set "
                "checkpoint.load_engram=false to keep the backbone and start Engram afresh")
    # engram_master_weights as set: an fp32 table ignores it (true), a bf16 one keeps it iff true
    want = bool(old["master"]) if old["dtype"] != "fp32" else True
    have = bool(new["master"]) if new["dtype"] != "fp32" else True
    settings = [f"model.engram_table_dtype={old['dtype']}"] if old["dtype"] != new["dtype"] else []
    if want != have:
        settings.append(f"model.engram_master_weights={str(want).lower()}")
    if old["dtype"] != new["dtype"]:
        shown = f"model.engram_table_dtype: {old['dtype']} in the checkpoint, {new['dtype']} here"
    else:
        shown = (f"model.engram_master_weights: {str(want).lower()} in the checkpoint, "
                 f"{str(have).lower()} here")
    return (f"{shown}. The checkpoint holds {_describe_storage(old)}, this run keeps "
            f"{_describe_storage(new)}; the table state does not convert on load: resume with "
            f"{' '.join(settings)} (the checkpoint's), or set checkpoint.load_engram=false to keep "
            "the backbone and start Engram afresh")


def check_schedule(
    saved: Mapping | None,
    current: Mapping,
    *,
    override: bool,
    use_checkpoint: bool,
    global_batch_size: int,
    lr_decay_iters_set: bool,
    where: str,
) -> None:
    """Compare two megatron ``OptimizerParamScheduler.state_dict()``s (``num_steps`` aside).

    Megatron-LM's rule: with ``override`` this run's values win, with ``use_checkpoint`` the
    checkpoint's; with neither they must be equal, else `ResumeMismatchError` names the key.
    """
    if not saved or override or use_checkpoint:
        return
    lines = []
    named = set()
    for key, old, new in _diff({k: v for k, v in saved.items() if k != "num_steps"},
                               {k: v for k, v in current.items() if k != "num_steps"}):
        name = SCHEDULE_KEYS.get(key, f"scheduler {key}")
        if key in ("lr_decay_steps", "wd_incr_steps") and not lr_decay_iters_set:
            name = "train.train_iters (the LR decays over train_iters while train.lr_decay_iters is null)"
        if name in named:  # one line per key (weight decay and its steps follow lr/decay)
            continue
        named.add(name)
        if key in _IN_SAMPLES and isinstance(old, (int, float)) and isinstance(new, (int, float)):
            shown = (
                f"{old:g} samples (~{old / global_batch_size:g} iterations of {global_batch_size}) in "
                f"the checkpoint, {new:g} (~{new / global_batch_size:g}) here"
            )
        else:
            shown = f"{_show(old)} in the checkpoint, {_show(new)} here"
        lines.append(f"{name}: {shown}")
    if lines:
        raise ResumeMismatchError(
            f"checkpoint {where} was saved with another LR schedule:\n  - " + "\n  - ".join(lines)
            + "\nChoose: checkpoint.override_opt_param_scheduler=true follows this run's schedule "
            "from the checkpoint's sample count on (the LR moves to where the new schedule is "
            "there); checkpoint.use_checkpoint_opt_param_scheduler=true keeps the checkpoint's "
            "(iterations past its decay length run at its min_lr); or resume with the old values.",
            ("checkpoint.override_opt_param_scheduler=true",),
        )

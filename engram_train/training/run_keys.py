"""Rules on ``train`` and ``data`` keys that need nothing but their own section: the LR
schedule's values and the data keys read without a file. Part of the run config's rules
(``training/run_config.py`` calls them from ``validate_run_config``), kept in their own module
so each stays small.
"""

from __future__ import annotations

import math
import re

from engram_train.errors import ConfigError


def check_schedule(t) -> None:
    """The LR schedule's values megatron's ``OptimizerParamScheduler`` asserts without a
    message (``lr`` at least ``min_lr``, ``min_lr`` and the weight decay not negative), each
    refused naming the ``train.*`` fields, their values and the fix. (A warm-up longer than the
    decay is accepted: ``training/optimizer.build_lr_scheduler`` lengthens the decay.)"""
    if not t.min_lr >= 0:
        raise ConfigError(f"train.min_lr={t.min_lr:g} must be >= 0 (the LR the schedule decays "
                          "to)")
    if not t.lr >= t.min_lr:
        raise ConfigError(f"train.lr={t.lr:g} is below train.min_lr={t.min_lr:g}: the schedule "
                          "decays from lr to min_lr; raise train.lr or lower train.min_lr "
                          f"(e.g. train.min_lr={t.lr / 10:g})")
    if not t.weight_decay >= 0:
        raise ConfigError(f"train.weight_decay={t.weight_decay:g} must be >= 0")


def check_data_keys(d, family) -> None:
    """The ``data`` keys that need no file: the split, the attention mask, the hash threads;
    `family` is the model's (``models/families.ModelFamily``), whose way to packed documents
    the message names (its ``packed_documents``)."""
    check_split(d.split)
    if d.reset_attention_mask and family.packed_documents is not None:
        raise ConfigError("data.reset_attention_mask=true is not supported: "
                          f"{family.packed_documents}")
    if d.reset_attention_mask:
        raise ConfigError(
            "data.reset_attention_mask=true is not supported: the trainer's attention (local and "
            "Transformer Engine) runs causal without a per-document mask, so documents would "
            "still attend to earlier ones. Set data.reset_attention_mask=false; for Engram's "
            "document boundaries set model.engram_reset_at_eos=true (with model.engram_eos_id)")
    if d.hash_threads < 1:
        raise ConfigError(f"data.hash_threads={d.hash_threads!r} must be an int >= 1")


def check_split(split) -> None:
    """``data.split`` as megatron reads it: up to three non-negative shares (train, valid,
    test) separated by ``,`` or ``/``, not all zero."""
    parts = re.split(r"[,/]", str(split))
    try:
        shares = [float(p) for p in parts]
    except ValueError:
        shares = []
    if not (1 <= len(shares) <= 3 and all(math.isfinite(x) and x >= 0 for x in shares) and sum(shares) > 0):
        raise ConfigError(
            f"data.split={split!r} must be up to three non-negative train,valid,test shares, not all "
            'zero, e.g. data.split="90,10,0"'
        )
    if shares[0] == 0:
        raise ConfigError(
            f"data.split={split!r} gives training no share of the data (the first of train,valid,"
            'test): give it one, e.g. data.split="90,10,0"'
        )

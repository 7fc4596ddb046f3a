"""What the shared commands need of a model family: `ModelFamily`, the interface each family
folder fills in (``<family>/<x>_family.py``'s ``FAMILY``) and ``families.py`` registers by name
(docs/architecture.md "Adding a model family")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelFamily:
    """What the trainer, ``engram-import-hf``, ``engram-export``, ``engram-logits`` and
    ``engram-plan`` need of a model family. Hooks take the model section as a plain dict (a
    preset's ``model`` keys, resolved) or the family's built config."""

    name: str
    """The model config's ``model_family``."""
    description: str
    """One line for the error that lists the families."""
    build_model: Callable[..., Any]
    """``(config, *, use_te, vp_stage, **gpt_kwargs)`` -> one model chunk of this rank (the
    kwargs: vocab_size, max_sequence_length, pre_process, post_process, ... of megatron's
    GPTModel)."""
    transformer_config: Callable[[dict, dict], Any]
    """``(model section, system fields)`` -> the family's megatron config (its own rules
    raise `ConfigError`)."""
    backbone_fields: Callable[[dict], dict]
    """model section -> the fields its megatron config sees, defaults included (unresolved):
    what the run-config rules read before the config is built."""
    presets: tuple[str, ...] = ()
    """Its shipped presets (``conf/model/<name>.yaml``)."""
    check_model_keys: Callable[[dict], None] | None = None
    """Refuses model-section keys its config has no field for (None: its config does)."""
    check_run: Callable[[Any, Any, bool], None] | None = None
    """``(run config, ParallelSizes, sequence parallel)``: the family's rules on a run's
    layout (``training/run_config.validate_run_config`` calls it)."""
    hf: Any = None
    """Its Hugging Face side (`engram_train.models.hf_mapping.HFMapping`), or None."""
    plan: Any = None
    """Its ``engram-plan`` terms, or None (the generic megatron terms)."""
    reads_padding_mask: bool = False
    """Whether its model reads a micro-batch's ``padding_mask`` (``engram-logits`` marks the
    positions it adds past a sequence under sequence parallelism)."""

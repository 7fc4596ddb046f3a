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
    """Its ``engram-plan`` terms (`PlanTerms`), or None (megatron's generic terms)."""
    packed_documents: str | None = None
    """How its model takes packed documents, said where it refuses megatron's per-document
    mask (``data.reset_attention_mask``; None: the trainer's own message)."""
    reads_padding_mask: bool = False
    """Whether its model reads a micro-batch's ``padding_mask`` (``engram-logits`` marks the
    positions it adds past a sequence under sequence parallelism)."""


@dataclass(frozen=True)
class PlanTerms:
    """A family's own terms in ``engram-plan`` (``memory_plan/``), where megatron's generic
    ones (``model_bytes.category``, ``activations.layer_per_token``, ...) do not describe its
    model: its parameters' categories and rank shares, its layers' activations and transients,
    and the layout the trainer does not run yet but the plan still plans."""

    category: Callable[[str, Any], str]
    """(parameter name, parameter) -> the plan's category (``model_bytes.GROUP``)."""
    layer_pattern: Any
    """The compiled pattern whose first group is a parameter's layer id."""
    tp_split: Callable[[str], bool]
    """Whether an attention or shared-expert parameter is split over tensor parallelism."""
    layer_per_token: Callable[..., dict]
    """(config, layout, activation bytes, layer) -> bytes per token kept, by part."""
    residual_streams: Callable[[Any], int]
    """config -> the residual streams a layer's input holds."""
    layer_transient: Callable[..., int]
    """(config, layout, layer, activation bytes) -> a layer's working set beyond what it keeps."""
    scores_per_layer: Callable[..., int]
    """(config, layout, layer) -> unfused attention scores a layer keeps (0: fused)."""
    logits_bytes_per_entry: Callable[[int], int]
    """activation bytes -> bytes per logit entry at the forward's end."""
    backward_beyond_logits: Callable[[int, int], int]
    """(backward working set, logits bytes) -> what the backward adds above the logits."""
    cpu_heap_hole_fraction: float
    """glibc heap holes per byte of heap-placed activations (``memory_plan/cpu_heap.py``)."""
    validation_cfg: Callable[[Any], Any]
    """run config -> the copy the trainer's rules validate (layout sizes it refuses today at 1)."""
    check_layout: Callable[..., None]
    """(run config, config, world, ParallelSizes): the layout rules the copy skipped."""
    layout_sizes: Callable[..., Any]
    """(config, layout, ParallelSizes) -> the layout with the run config's own shares."""
    with_recompute: Callable[[Any, Any], Any]
    """(run config, validated config) -> the config with the run's recompute."""
    not_trainable: str
    """The note a plan of a layout the trainer refuses today starts with."""

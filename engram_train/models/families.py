"""The model families and what the shared commands need of one (docs/architecture.md "Adding
a model family").

A family is one folder under ``models/`` (``deepseek_v3/``, ``deepseek_v41/``) whose
``<x>_family.py`` defines a `ModelFamily` (``model_family.py``) named as the model config's
``model_family``: the trainer builds its config and model through it
(``training/run_config.py``, ``models/builder.py``), ``engram-import-hf`` and ``engram-export
--format hf`` reach its Hugging Face side (`HFMapping`, ``models/hf_mapping.py``),
``engram-plan`` its memory terms (``PlanTerms``), ``engram-logits`` its padding rule. The
shared packages ask this registry for the family by name and never import a family's folder;
the built-in families are imported and registered on first use (importing megatron-core takes
seconds), another one registers itself with `register` from its own folder.
"""

from __future__ import annotations

import importlib

from engram_train.config.family import DEEPSEEK_V3, declare_model_family, model_family, preset_family
from engram_train.errors import ConfigError
from engram_train.models.model_family import ModelFamily

# name -> ``module:FAMILY`` of a built-in family (imported and registered on first use)
BUILT_IN = {
    "deepseek_v3": "engram_train.models.deepseek_v3.v3_family:FAMILY",
    "deepseek_v41": "engram_train.models.deepseek_v41.v41_family:FAMILY",
}

_FAMILIES: dict[str, ModelFamily] = {}


def register(family: ModelFamily) -> ModelFamily:
    """Make `family` known by its name (to the model config's rule too); returns it."""
    _FAMILIES[family.name] = family
    declare_model_family(family.name, family.description)
    return family


def get_family(name: str) -> ModelFamily:
    """The family named `name` (a built-in one is imported on first use)."""
    if name not in _FAMILIES and name in BUILT_IN:
        module, attribute = BUILT_IN[name].split(":")
        register(getattr(importlib.import_module(module), attribute))
    if name not in _FAMILIES:
        known = ", ".join(sorted({*_FAMILIES, *BUILT_IN}))
        raise ConfigError(f"model_family={name!r} is not a registered model family ({known})")
    return _FAMILIES[name]


def families() -> list[ModelFamily]:
    """Every family: the built-in ones, then those registered since, in that order."""
    for name in BUILT_IN:
        get_family(name)
    return list(_FAMILIES.values())


def family_of(config) -> ModelFamily:
    """The family of a built config (megatron's own config: DeepSeek-V3's)."""
    return get_family(model_family(config))


def family_of_section(model) -> ModelFamily:
    """The family of a model section (a dict or DictConfig; default DeepSeek-V3), its name
    checked against the model config's rule (`config.family.preset_family`)."""
    return get_family(preset_family(model))


def hf_family(doc: dict) -> ModelFamily:
    """The family that reads a Hugging Face ``config.json``: the first whose `HFMapping`
    claims it, else DeepSeek-V3's (whose import names what it refuses)."""
    for family in families():
        if family.hf is not None and family.hf.reads(doc):
            return family
    return get_family(DEEPSEEK_V3)

"""Which model family a model config builds (``model_family``): the one rule on its value and
the one reading of it. The builder (``models/builder.py``) chooses the family's model by it and
``training/run_config.py`` the family's config; a preset without the key is DeepSeek-V3.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engram_train.errors import ConfigError

DEEPSEEK_V3 = "deepseek_v3"
DEEPSEEK_V41 = "deepseek_v41"
MODEL_FAMILIES = {
    DEEPSEEK_V3: "DeepSeek-V3's backbone (MLA, MoE; models/deepseek_v3/, megatron's GPTModel)",
    DEEPSEEK_V41: "DeepSeek-V4.1's backbone (shared-KV attention with CSA2, single-pass mHC; "
                  "models/deepseek_v41/, docs/deepseek-v41.md)",
}


def declare_model_family(name: str, description: str) -> None:
    """Accept `name` as a ``model_family`` (``models/families.register`` calls it for each
    family it registers, the built-in ones above included)."""
    MODEL_FAMILIES[name] = description


@dataclass
class ModelFamilyConfig:
    """The ``model_family`` field of the project's model configs."""

    model_family: str = DEEPSEEK_V3
    """The backbone the config builds: 'deepseek_v3' or 'deepseek_v41' (`MODEL_FAMILIES`)."""


def check_model_family(value: Any) -> str:
    """`value` when it names a family; else a ConfigError listing them."""
    if value not in MODEL_FAMILIES:
        known = ", ".join(f"'{k}' ({v})" for k, v in MODEL_FAMILIES.items())
        raise ConfigError(f"model_family={value!r} is not a model family; choose one of {known}.")
    return value


def model_family(config: Any) -> str:
    """The family of a model config: its ``model_family`` (megatron's own config, which the
    builder also accepts, is DeepSeek-V3's)."""
    return config.model_family if isinstance(config, ModelFamilyConfig) else DEEPSEEK_V3


def preset_family(model: Any) -> str:
    """The validated family of a model section (a dict or DictConfig; default 'deepseek_v3')."""
    return check_model_family(model.get("model_family", DEEPSEEK_V3))


def check_family_fields(model: Any) -> None:
    """A model section gives no field its family does not have: DeepSeek-V4.1 always runs its
    own single-pass mHC over ``hc_mult`` streams, so the project mHC's fields
    (``enable_hyper_connections``, ...), true or false, would change nothing; refused by name."""
    if model.get("model_family", DEEPSEEK_V3) != DEEPSEEK_V41:
        return
    from engram_train.config.mhc import HyperConnectionConfig

    given = [f for f in HyperConnectionConfig.__dataclass_fields__ if f in model]
    if given:
        raise ConfigError(
            f"model.{given[0]}={model[given[0]]!r} with model_family=deepseek_v41: V4.1 always "
            "runs its own single-pass mHC (model.hc_mult streams), which the project mHC's "
            f"fields {given} do not change; drop them")

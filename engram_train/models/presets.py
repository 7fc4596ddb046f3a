"""The shipped model presets, one definition each: ``conf/model/<name>.yaml``.

The trainer composes them through Hydra (``model=<name>``); the parameter counter and the tests
read the same files through `model_preset` / `backbone_preset`, so a preset's sizes live in one
place.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engram_train.errors import ConfigError

CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")


def model_preset(name: str) -> dict[str, Any]:
    """The ``model`` section of preset ``name`` as a plain dict (interpolations unresolved).
    A preset that starts from another (Hydra's ``defaults: [base, _self_]``) is merged onto it,
    as Hydra composes it."""
    from omegaconf import OmegaConf

    path = Path(CONF_DIR, "model", f"{name}.yaml")
    if not path.is_file():
        known = sorted(p.stem for p in Path(CONF_DIR, "model").glob("*.yaml"))
        raise ConfigError(f"no model preset {name!r} (conf/model/{name}.yaml); presets: {known}")
    own = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    defaults = list(own.pop("defaults", None) or [])
    if "_self_" not in defaults:
        defaults.append("_self_")
    merged: dict[str, Any] = {}
    for base in defaults:
        merged.update(own if base == "_self_" else model_preset(base))
    return merged


def backbone_preset(name: str) -> dict[str, Any]:
    """The preset's megatron (backbone) fields only: its Engram fields dropped, and its mHC
    fields too when mHC is off (megatron-core's own configs have none; with mHC on they stay,
    for a composed config: ``engram_train.config``)."""
    import dataclasses

    from engram_train.config import EngramConfig, HyperConnectionConfig, resolve

    dropped = set(EngramConfig.field_names())
    preset = model_preset(name)
    if not resolve(preset)["enable_hyper_connections"]:
        dropped |= {f.name for f in dataclasses.fields(HyperConnectionConfig)}
    return {k: v for k, v in preset.items() if k not in dropped}

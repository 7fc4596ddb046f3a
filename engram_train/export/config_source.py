"""The run config an export is made with, and whether it matches the checkpoint.

The checkpoint holds weights only; the Engram hash constants come from the config it was
trained with. Searched in order: ``--config``; a ``run_config`` mapping in the checkpoint's
``extra`` state; ``CKPT_DIR/config.yaml``; ``CKPT_DIR/../config.yaml`` when its
``checkpoint.save`` is CKPT_DIR. The Engram hash identity the trainer stored in the manifest
must equal the one that config gives.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from engram_train.config import EngramConfig, resolve
from engram_train.errors import ConfigError
from engram_train.export.export_errors import ExportError
from engram_train.training.run_identity import (
    ENGRAM_DERIVED,
    engram_identity,
    engram_identity_changes,
)


def _changed(old: Any, new: Any) -> str:
    """Both values, or for mappings only the entries that differ."""
    if isinstance(old, dict) and isinstance(new, dict):
        keys = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
        return "; ".join(f"{k} {_short(old.get(k))} in the checkpoint, {_short(new.get(k))} in the run config"
                         for k in keys)
    return f"{_short(old)} in the checkpoint, {_short(new)} in the run config"


def _short(value: Any, limit: int = 70) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_run_identity(manifest: dict | None, engram, mapping, where: str, directory: Path,
                       log: Callable[[str], None] = lambda _: None) -> None:
    """The Engram hash identity the trainer stored in the manifest against the one the run
    config gives (training/run_identity.py): seed, tokenizer digest and sizes, N, H, layer ids,
    table sizes, pad id, primes, multipliers, conv and EOS settings. A difference would serve
    every n-gram from rows trained for another: `ExportError` naming each field, both values."""
    if manifest is None:
        return  # verify_files warned
    run = manifest.get("run")
    if not run:
        log(f"warning: {directory}/manifest.json records no run identity (saved by a tool, or "
            "before identities existed): the Engram hash seed, tokenizer, N, H, layer ids, primes "
            f"and multipliers could not be compared with {where}")
        return
    if not run.get("use_engram"):
        raise ExportError(f"{directory} was trained without Engram (its manifest says "
                          f"use_engram=false), but {where} has use_engram=true: there is no "
                          "Engram memory to export")  # fmt: skip
    changes = engram_identity_changes(run.get("engram") or {}, engram_identity(engram, mapping))
    if not changes:
        return
    lines = []
    for key, old, new in changes:
        what = ENGRAM_DERIVED.get(key, f"model.{key}")
        if key == "tokenizer":
            what = "model.engram_tokenizer_name_or_path (or --tokenizer): the compressed vocabulary"
        lines.append(f"{what}: {_changed(old, new)}")
    raise ExportError(
        f"{where} does not match the run identity stored with checkpoint {directory}:\n  - "
        + "\n  - ".join(lines)
        + "\nThe export would hash tokens to rows trained for other n-grams. Pass the run config "
        "this checkpoint was trained with (--config <experiment.exp_dir>/config.yaml), or set "
        "these fields in it to the checkpoint's values"
    )


def _read_yaml(path: Path, refuse_composable: bool = False) -> dict:
    """The YAML at ``path``, interpolations resolved. ``refuse_composable``: a config to compose
    (``conf/train.yaml``: a defaults list, no model section, interpolations into the structured
    config's sections) is refused by name before anything is resolved."""
    try:
        conf = OmegaConf.load(path)
        if (refuse_composable and OmegaConf.is_dict(conf) and "defaults" in conf
                and "model" not in conf):
            raise ExportError(
                f"--config {path} is a config to compose (it lists defaults and has no model "
                "section), not the resolved config of a run: pass <experiment.exp_dir>/config.yaml, "
                "which engram-train writes"
            )
        return OmegaConf.to_container(conf, resolve=True)
    except (OmegaConfBaseException, OSError, ValueError) as err:
        if isinstance(err, ExportError):
            raise
        raise ExportError(
            f"--config {path}: cannot read it as a resolved run config ({err}); give the "
            "config.yaml that engram-train writes into experiment.exp_dir"
        ) from None


def read_config_file(path: str | os.PathLike) -> dict:
    """``--config``: a run's resolved config, refused when missing or when it is a config to
    compose (``conf/train.yaml``)."""
    path = Path(path)
    if not path.is_file():
        raise ExportError(f"--config {path}: file does not exist")
    return _read_yaml(path, refuse_composable=True)


def find_run_config(config: str | os.PathLike | None, root: Path,
                    common: dict | None) -> tuple[dict, str]:
    """(run config mapping, where it came from); see the module docstring for the order."""
    if config is not None:
        path = Path(config)
        return read_config_file(path), str(path)
    extra = (common or {}).get("extra") or {}
    if isinstance(extra.get("run_config"), dict):
        return extra["run_config"], "the checkpoint's extra.run_config"
    candidate = root / "config.yaml"
    if candidate.is_file():
        return _read_yaml(candidate), str(candidate)
    candidate = root.parent / "config.yaml"
    if candidate.is_file():
        doc = _read_yaml(candidate)
        save = (doc.get("checkpoint") or {}).get("save")
        if save and _same_dir(save, root):
            return doc, str(candidate)
    raise ExportError(
        f"no run config for {root}: the checkpoint holds weights only, and the Engram hash "
        "constants come from the config it was trained with. Pass --config "
        "<experiment.exp_dir>/config.yaml (the resolved config engram-train writes)"
    )


def _same_dir(a: str | os.PathLike, b: Path) -> bool:
    try:
        return Path(a).resolve() == b.resolve()
    except OSError:
        return False


def engram_from_run_config(doc: dict, where: str):
    """(EngramConfig, hidden_size, model section) from a run config or a bare model section."""
    model = doc.get("model", doc) if isinstance(doc, dict) else None
    if not isinstance(model, dict):
        raise ExportError(f"{where}: no 'model' section")
    if not model.get("use_engram"):
        raise ExportError(
            f"{where}: model.use_engram is not true; there is no Engram memory to export"
        )
    # unset engram_hc_mult follows the backbone: Engram reads and writes every residual stream
    resolved = resolve(model)
    fields = {k: resolved[k] for k in EngramConfig.field_names()}
    try:
        engram = EngramConfig.from_dict(fields)
    except ConfigError as err:  # names the field; the export names the file
        raise ExportError(f"{where}: model section: {err}") from None
    hidden = model.get("hidden_size")
    if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1:
        raise ExportError(f"{where}: model.hidden_size={hidden!r} must be a positive int")
    return engram, hidden, model

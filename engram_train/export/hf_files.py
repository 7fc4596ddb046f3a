"""The files every ``engram-export --format hf`` folder has besides ``config.json``: the
safetensors shards' names, their index and the tokenizer (``hf_export.py``,
``hf_released.py``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

INDEX_FILE = "model.safetensors.index.json"
FILE_METADATA = {"format": "pt"}


def shard_file(index: int, count: int) -> str:
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def write_index(folder: Path, weight_map: dict[str, str], total: int) -> None:
    """``model.safetensors.index.json``: which shard holds each tensor, and their bytes."""
    (folder / INDEX_FILE).write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
        indent=2) + "\n")


def write_tokenizer(folder: Path, tokenizer_file: Path, eos_token: str | None = None) -> None:
    shutil.copyfile(tokenizer_file, folder / "tokenizer.json")
    config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    if eos_token:
        config["eos_token"] = eos_token
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")

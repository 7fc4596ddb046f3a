"""Inputs that must be refused with one clear message: files from outside a model folder, and
settings that used to fail late, with a traceback, or not at all."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engram_train.hf.source import HFFolder, HFSourceError


def _folder(root: Path, weight_map: dict[str, str]) -> Path:
    root.mkdir(parents=True)
    save_file({"w": torch.ones(2)}, str(root / "model.safetensors"))
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return root


def test_weight_files_outside_the_folder_are_refused(tmp_path):
    secret = tmp_path / "secret.safetensors"
    save_file({"w": torch.zeros(2)}, str(secret))
    cases = {
        "../secret.safetensors": "'w' -> '../secret.safetensors'",
        "../../../../" + str(secret).lstrip("/"): "'w' -> '../../../../",
        str(secret): f"'w' -> '{secret}'",
    }
    for i, (entry, named) in enumerate(cases.items()):
        folder = _folder(tmp_path / f"m{i}", {"w": entry})
        with pytest.raises(HFSourceError) as e:
            HFFolder(folder)
        assert f"model.safetensors.index.json: weight_map entry {named}" in str(e.value)
        assert f"resolves to {secret}, outside {folder}" in str(e.value)
    # A symlink inside the folder that points outside it, by the index or found by the glob.
    folder = _folder(tmp_path / "link", {"w": "model.safetensors", "v": "linked.safetensors"})
    os.symlink(secret, folder / "linked.safetensors")
    with pytest.raises(HFSourceError, match=r"'v' -> 'linked.safetensors' resolves to .*secret.safetensors, outside"):
        HFFolder(folder)
    (folder / "model.safetensors.index.json").unlink()
    with pytest.raises(HFSourceError, match=r"weight file 'linked.safetensors' resolves to .*, outside"):
        HFFolder(folder)
    # Inside: plain files, and a Hugging Face cache snapshot's links into its repository's blobs.
    assert HFFolder(_folder(tmp_path / "plain", {"w": "./model.safetensors"})).read("w").tolist() == [1.0, 1.0]
    repo = tmp_path / "models--x--y"
    (repo / "blobs").mkdir(parents=True)
    save_file({"w": torch.full((2,), 3.0)}, str(repo / "blobs" / "abc123"))
    snapshot = repo / "snapshots" / "rev"
    snapshot.mkdir(parents=True)
    os.symlink(repo / "blobs" / "abc123", snapshot / "model.safetensors")
    assert HFFolder(snapshot).read("w").tolist() == [3.0, 3.0]

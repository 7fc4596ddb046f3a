"""docs/architecture.md "Adding a model family", walked through: a third family
(tests/toy_family/, a few dense layers, registered from that one folder) goes through the
shared commands' Python entry points (tests/dist/toy_family_run.py): ``engram-import-hf`` of a
tiny folder it writes, one trainer step from the import, ``engram-export --format hf`` of both
checkpoints. Nothing outside its folder names it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from launch import REPO, torchrun
from safetensors.torch import load_file


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("toy_family")
    results = {}
    for phase in ("import", "train", "export"):
        results[phase] = torchrun("toy_family_run.py", 1, work / f"out_{phase}", "--phase", phase,
                                  "--work", str(work))[0]
    return work, results


def test_import_train_export_through_the_shared_commands(runs):
    work, results = runs
    source = load_file(str(work / "hf" / "model.safetensors"))
    back = {}
    for path in sorted((work / "hf_imported").glob("*.safetensors")):
        back.update(load_file(str(path)))
    assert sorted(back) == sorted(source)
    for name, value in source.items():  # the import, exported again: the folder's values
        assert torch.equal(back[name], value), name
    doc = json.loads((work / "hf_imported" / "config.json").read_text())
    assert doc["model_type"] == "toy_dense" and doc["num_hidden_layers"] == 2
    metrics = [json.loads(line) for line in (work / "exp" / "metrics.jsonl").read_text().splitlines()
               if '"lm_loss"' in line]
    assert [m["iteration"] for m in metrics] == [1]
    assert 0 < results["train"]["lm_loss"] < 20
    trained = {}
    for path in sorted((work / "hf_trained").glob("*.safetensors")):
        trained.update(load_file(str(path)))
    assert {k: v.shape for k, v in trained.items()} == {k: v.shape for k, v in source.items()}
    assert any(not torch.equal(trained[k], source[k]) for k in source)  # the step moved them


def test_no_other_package_names_the_toy_family():
    found = subprocess.run(["git", "grep", "-l", "toy_dense", "--", "engram_train", "conf"],
                           cwd=REPO, capture_output=True, text=True).stdout.split()
    assert found == []

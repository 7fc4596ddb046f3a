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
        "../" * 16 + str(secret).lstrip("/"): "'w' -> '../../../../",
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


def test_one_run_per_checkpoint_folder(tmp_path, caplog):
    """A second run is refused naming the holder's host and pid; a lock naming a process that is
    gone is taken over with a warning. (The holder is another process: a lock is per process.)"""
    import socket
    import subprocess
    import sys

    from engram_train.checkpoint.errors import CheckpointFolderInUseError
    from engram_train.checkpoint.lock import LOCK_FILE, lock_save_folder

    folder = tmp_path / "ckpt"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from engram_train.checkpoint.lock import lock_save_folder; "
         f"lock_save_folder({str(folder)!r}); print('locked', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1])))
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(CheckpointFolderInUseError) as e:
            lock_save_folder(folder)
        assert f"checkpoint.save={folder.resolve()} is in use by another run (host {socket.gethostname()}, " \
               f"pid {holder.pid}," in str(e.value)
    finally:
        holder.kill()
        holder.wait()
    # The holder was killed: its lock is free, the file still names it.
    assert json.loads((folder / LOCK_FILE).read_text())["pid"] == holder.pid
    with caplog.at_level("WARNING"):
        lock_save_folder(folder)
    assert f"taking over the lock of run pid {holder.pid}" in caplog.text
    assert json.loads((folder / LOCK_FILE).read_text())["pid"] == os.getpid()

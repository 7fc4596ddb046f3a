"""Inputs that must be refused with one clear message: files from outside a model folder, and
settings that used to fail late, with a traceback, or not at all."""

from __future__ import annotations

import json
import re
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engram_train.models.hf_folder import HFFolder, HFSourceError


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
    # without an index, model.safetensors alone is read (as transformers reads the folder): the
    # link beside it is ignored and named, never opened; without model.safetensors every
    # *.safetensors is read, and the link is refused
    assert HFFolder(folder).ignored == ["linked.safetensors"]
    (folder / "model.safetensors").rename(folder / "w.safetensors")
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

    from engram_train.checkpoint.checkpoint_errors import CheckpointFolderInUseError
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


def _cfg(*overrides):
    from hydra import compose, initialize_config_dir
    from engram_train.config import register

    register()  # the run config's schema (conf/train.yaml's defaults)
    with initialize_config_dir(config_dir=str(Path(__file__).parents[1] / "conf"), version_base=None):
        return compose(config_name="train", overrides=list(overrides))


@pytest.mark.parametrize("override, message", [
    ("data.split=abc", "data.split='abc' must be up to three non-negative train,valid,test shares"),
    ("data.split='0,0,0'", "data.split='0,0,0' must be up to three"),
    ("data.split='90,10,-1'", "data.split='90,10,-1' must be up to three"),
    ("data.split='0,0,100'", "data.split='0,0,100' gives training no share of the data"),
    ("train.seq_length=0", "train.seq_length=0 must be >= 1 (tokens per sample)"),
    ("system.context_parallel_size=2 train.seq_length=126",
     "train.seq_length=126 must be a multiple of 2 x system.context_parallel_size = 4"),
    ("system.tensor_model_parallel_size=2 system.sequence_parallel=true train.seq_length=127",
     "train.seq_length=127 must be a multiple of system.tensor_model_parallel_size=2: sequence "
     "parallelism splits"),
    ("model.moe_router_topk=9", "model.moe_router_topk=9 must be between 1 and model.num_moe_experts=4"),
    ("model.moe_router_topk=0", "model.moe_router_topk=0 must be between 1 and model.num_moe_experts=4"),
])
def test_bad_split_sequence_length_and_routing_fail_before_the_build(override, message):
    from engram_train.training.run_config import ConfigError, validate_run_config

    with pytest.raises(ConfigError, match=re.escape(message)):
        validate_run_config(_cfg(*override.split()), 2)
    validate_run_config(_cfg("data.split='98/2/0'"), 2)


def test_sweep_without_seeds_is_refused():
    from engram_train.sweep.sweep_cli import main

    with pytest.raises(SystemExit) as e:
        main(["--seeds", ""])
    assert str(e.value) == ("engram-sweep: --seeds names no seed, so nothing would be trained: give one or "
                            "more, e.g. --seeds 1,2")


def test_mhc_off_resume_advises_what_can_work():
    from engram_train.training.run_identity import ResumeMismatchError, check_run_identity

    saved = {"use_engram": True, "model": {"enable_hyper_connections": True, "num_residual_streams": 4},
             "engram": {"engram_hc_mult": 4}}
    current = {"use_engram": True, "model": {"enable_hyper_connections": False, "num_residual_streams": None},
               "engram": {"engram_hc_mult": 1}}
    with pytest.raises(ResumeMismatchError) as e:
        check_run_identity(saved, current, load_engram=True, where="ckpt/iter_0000002")
    message = str(e.value)
    assert "resume with model.engram_hc_mult=4" not in message, message
    assert ("it follows the backbone's residual streams: resume with the checkpoint's "
            "model.enable_hyper_connections and model.num_residual_streams=4") in message, message


def test_interrupt_names_the_last_complete_checkpoint(tmp_path):
    from engram_train.train import interrupted_message

    save = tmp_path / "ckpt"
    assert interrupted_message(_cfg()) == "interrupted; checkpoint.save is not set, so nothing was saved"
    cfg = _cfg(f"checkpoint.save={save}")
    assert interrupted_message(cfg) == f"interrupted; no complete checkpoint in {save} yet"
    (save / "iter_0000002").mkdir(parents=True)
    (save / "iter_0000002" / "manifest.json").write_text("{}")
    (save / "iter_0000004.tmp").mkdir()  # the save Ctrl-C cut short
    assert interrupted_message(cfg) == (f"interrupted; last complete checkpoint 2 ({save / 'iter_0000002'}); "
                                        f"resume with checkpoint.load={save}")

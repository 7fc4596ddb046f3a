"""Folder and data faults that used to end in a traceback: each now ends in one message naming
the path and the fix (an `EngramError`, which the trainer prints as one line), and no checkpoint
is lost. The lock, the save and the dataset checks are called in-process; three short trainer
runs show the command line's side (one line, no traceback)."""

from __future__ import annotations

import errno
import json
import struct
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engram_train.checkpoint.checkpoint_errors import CheckpointError, CheckpointFolderInUseError
from engram_train.checkpoint.layout import TRACKER, latest_iteration
from engram_train.checkpoint.lock import LOCK_FILE, lock_save_folder
from engram_train.checkpoint.manifest import check_checkpoint
from engram_train.data.datasets import (
    DEMO_DATA_PREFIX,
    DEMO_TOKENIZER,
    DatasetError,
    build_gpt_datasets,
)
from engram_train.errors import EngramError

REPO = Path(__file__).resolve().parents[1]
GARBAGE = b"\xff\xfe\x00\x80\x9c garbage \x00\xff"


def _snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` but the lock file, by relative path."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != LOCK_FILE}  # fmt: skip


def _folder_with_checkpoint(root: Path) -> dict[str, bytes]:
    (root / "iter_0000002").mkdir(parents=True)
    (root / "iter_0000002" / "manifest.json").write_text('{"files": {}}')
    (root / TRACKER).write_text("2")
    return _snapshot(root)


# -- the lock file ------------------------------------------------------------------------------


@pytest.mark.parametrize("content, warning", [
    (GARBAGE, "held unreadable content and no live process held it"),
    (b"[1, 2]", "held unreadable content and no live process held it"),  # JSON, not a holder
    (json.dumps({"pid": "abc", "host": socket.gethostname()}).encode(),  # this host: no int("abc")
     f"taking over the lock of run pid abc on {socket.gethostname()}, which is gone"),
])  # fmt: skip
def test_a_garbage_lock_is_taken_over_like_a_stale_one(tmp_path, caplog, content, warning):
    root = tmp_path / "ckpt"
    kept = _folder_with_checkpoint(root)
    (root / LOCK_FILE).write_bytes(content)
    with caplog.at_level("WARNING", logger="engram_train.checkpoint.lock"):
        assert lock_save_folder(root) == root.resolve() / LOCK_FILE
    assert warning in caplog.text
    holder = json.loads((root / LOCK_FILE).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    assert _snapshot(root) == kept


def test_a_garbage_lock_held_by_a_live_process_still_refuses(tmp_path):
    """Unreadable content names no holder, but the ``flock`` of a live process still counts."""
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / LOCK_FILE).write_bytes(GARBAGE)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'ab'); "
         "fcntl.flock(f, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)", str(root / LOCK_FILE)],
        stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(CheckpointFolderInUseError, match=r"is in use by another run \(host \?, pid \?"):
            lock_save_folder(root)
    finally:
        holder.kill()
        holder.wait()
    assert (root / LOCK_FILE).read_bytes() == GARBAGE  # refused: not rewritten


def test_a_lock_path_that_is_a_directory_is_named_with_the_fix(tmp_path):
    root = tmp_path / "ckpt"
    (root / LOCK_FILE).mkdir(parents=True)
    (root / LOCK_FILE / "note").write_text("x")
    kept = _folder_with_checkpoint(root)
    with pytest.raises(CheckpointError) as e:
        lock_save_folder(root)
    path = root.resolve() / LOCK_FILE
    assert str(e.value) == (
        f"checkpoint.save={root.resolve()}: the lock file {path} is a directory, so no run can take the "
        f"folder's lock. It is not part of any checkpoint: remove it (rm -r {path}) and start the run "
        "again, or choose another checkpoint.save"
    )
    assert isinstance(e.value, EngramError)
    assert _snapshot(root) == kept and (root / LOCK_FILE / "note").read_text() == "x"


# -- a save folder that turns unwritable --------------------------------------------------------


class _Tiny(torch.nn.Module):
    """The smallest model `save_checkpoint` takes: one parameter, one sharded tensor."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((6,), value))
        self.config = SimpleNamespace()

    def sharded_state_dict(self):
        from megatron.core.dist_checkpointing import ShardedTensor

        return {"w": ShardedTensor.from_rank_offsets("w", self.w.detach(), replica_id=0)}


def test_a_save_folder_turned_unwritable_fails_in_one_line_and_keeps_the_checkpoint(tmp_path, one_rank,
                                                                                  monkeypatch):
    """As root, ``chmod`` does not stop writes: then the save's ``mkdir`` is made to fail with
    the ``EACCES`` a read-only folder gives; otherwise the folder really is made read-only."""
    from engram_train.checkpoint import save as save_module
    from engram_train.checkpoint.save import save_checkpoint

    root = tmp_path / "ckpt"
    save_checkpoint(root, 2, [_Tiny(1.0)], check_space=False)
    kept = _snapshot(root)
    if os.geteuid() == 0:
        real_mkdir = Path.mkdir

        def refuse(self, *args, **kwargs):
            if self.parent == root:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
            return real_mkdir(self, *args, **kwargs)

        monkeypatch.setattr(Path, "mkdir", refuse)
    else:
        root.chmod(0o555)
    try:
        with pytest.raises(CheckpointError) as e:
            save_checkpoint(root, 4, [_Tiny(2.0)], check_space=False)
    finally:
        root.chmod(0o755)
        monkeypatch.undo()
    assert str(e.value) == (
        f"saving iteration 4 to {root} failed: Permission denied: {root / 'iter_0000004.tmp'}. The newest "
        f"complete checkpoint is still iter_0000002. Make {root} writable for this user (or point "
        f"checkpoint.save at a writable folder), then resume with checkpoint.load={root}"
    )
    assert _snapshot(root) == kept and check_checkpoint(root / "iter_0000002") == []

    # Denied while publishing (the manifest): the partial directory goes, the tracker stays.
    def denied(path, text):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    monkeypatch.setattr(save_module, "write_atomic", denied)
    with pytest.raises(CheckpointError) as e:
        save_checkpoint(root, 4, [_Tiny(2.0)], check_space=False)
    monkeypatch.undo()
    assert str(e.value) == (
        f"saving iteration 4 to {root} failed: Permission denied: {root / 'iter_0000004.tmp' / 'manifest.json'}. "
        f"The partial iter_0000004.tmp was removed; the newest complete checkpoint is still iter_0000002. "
        f"Make {root} writable for this user (or point checkpoint.save at a writable folder), then resume "
        f"with checkpoint.load={root}"
    )
    assert _snapshot(root) == kept and latest_iteration(root) == 2
    # Writable again: the next save works as if nothing happened.
    save_checkpoint(root, 4, [_Tiny(2.0)], check_space=False)
    assert latest_iteration(root) == 4 and check_checkpoint(root / "iter_0000004") == []
    assert check_checkpoint(root / "iter_0000002") == []


# -- data edge cases ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok():
    from engram_train.data import load_tokenizer

    return load_tokenizer(DEMO_TOKENIZER)


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory) -> str:
    """One document of 11 tokens (10 + end of document)."""
    from engram_train.data.preprocess import main as preprocess_main

    root = tmp_path_factory.mktemp("tiny_corpus")
    (root / "tiny.txt").write_text("Emma Woodhouse, handsome, clever, and rich.\n", encoding="utf-8")
    assert preprocess_main(["--input", str(root / "tiny.txt"), "--tokenizer", DEMO_TOKENIZER,
                            "--output-prefix", str(root / "tiny"), "--no-progress"]) == 0  # fmt: skip
    return str(root / "tiny_text_document")


def test_empty_or_damaged_dataset_files_are_named(tmp_path, tok, capfd):
    prefix = tmp_path / "empty_text_document"
    files = f"{prefix}.bin and {prefix}.idx"
    cases = {
        (b"", b""): f"data path: {files} are empty (0 bytes): no dataset to train on at '{prefix}'. "
                    f"Rebuild {files} with engram-preprocess from a non-empty corpus, or drop the prefix from "
                    "data.path.",
        (b"x" * 8, b""): f"data path: {prefix}.idx is empty (0 bytes): no dataset to train on",
        (b"x" * 8, b"not an index"): f"data path: cannot read {files} ({prefix}.idx is 12 bytes, shorter "
                                     "than an index header): they are damaged or not an indexed dataset; "
                                     "rebuild them with engram-preprocess.",
        (b"x" * 8, b"NOTANIDX!" + bytes(25)): f"data path: cannot read {files} ({prefix}.idx has no megatron "
                                             "index header (version 1))",
        (b"x" * 8, b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 1, 5, 6)): (  # a torn index
            f"data path: cannot read {files} ({prefix}.idx is 34 bytes, its header announces 142 "
            "(truncated))"),
    }  # fmt: skip
    for (data, index), message in cases.items():
        Path(f"{prefix}.bin").write_bytes(data)
        Path(f"{prefix}.idx").write_bytes(index)
        with pytest.raises(DatasetError) as e:
            build_gpt_datasets(str(prefix), tok, seq_length=8, num_samples=(1, 1, 1), cache_dir=tmp_path)
        assert str(e.value).startswith(message) and "\n" not in str(e.value)
        assert isinstance(e.value, EngramError) and isinstance(e.value, ValueError)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception ignored" not in err and "cannot mmap" not in err


def test_a_split_without_a_document_is_one_engram_error(tmp_path, tok, tiny_corpus):
    with pytest.raises(DatasetError) as e:
        build_gpt_datasets(tiny_corpus, tok, seq_length=8, num_samples=(1, 1, 1), split="90,10,0",
                           cache_dir=tmp_path)  # fmt: skip
    assert str(e.value) == (f"data.split='90,10,0' gives the valid split no document of '{tiny_corpus}' "
                            "(1 documents); give that split a larger share, or 0 to drop it.")
    assert isinstance(e.value, EngramError)


def _dataset_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "engram_train.data.datasets"]


def test_a_corpus_shorter_than_one_sample_is_warned_with_its_numbers(tmp_path, tok, tiny_corpus, caplog):
    with caplog.at_level("WARNING", logger="engram_train.data.datasets"):
        train, valid, test = build_gpt_datasets(
            tiny_corpus, tok, seq_length=64, num_samples=(16, 1, 1), split="100,0,0", cache_dir=tmp_path,
            global_batch_size=8,
        )  # fmt: skip
    assert valid is None and test is None and len(train) >= 16  # it trains: a warning, no refusal
    assert _dataset_warnings(caplog) == [
        f"data.path: the train split of '{tiny_corpus}' holds 11 tokens, fewer than one sample of 65 "
        "(train.seq_length=64 + 1): each sample repeats those tokens ~5.9 times, and a global batch of 8 "
        "samples (512 tokens) sees them ~47 times, so training memorizes them. Use a larger corpus, a "
        "shorter train.seq_length, or a larger train share of data.split"
    ]
    caplog.clear()
    with caplog.at_level("WARNING", logger="engram_train.data.datasets"):  # 494k tokens: no warning
        build_gpt_datasets(DEMO_DATA_PREFIX, tok, seq_length=64, num_samples=(16, 1, 1), split="100,0,0",
                           cache_dir=tmp_path, global_batch_size=8)  # fmt: skip
    assert _dataset_warnings(caplog) == []


# -- the command line: one line, no traceback ---------------------------------------------------


def test_trainer_ends_each_fault_in_one_line(tmp_path, tiny_corpus):
    """Three short single-process runs, side by side: an empty dataset, a lock path that is a
    directory (both refused before a step), and a run on the tiny corpus with no validation
    share, a garbage lock and a file in the way of its second save (after the first)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    for key in ("LOCAL_RANK", "WORLD_SIZE", "RANK"):
        env.pop(key, None)
    empty = tmp_path / "empty_text_document"
    Path(f"{empty}.bin").write_bytes(b"")
    Path(f"{empty}.idx").write_bytes(b"")
    locked = tmp_path / "locked"
    (locked / LOCK_FILE).mkdir(parents=True)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / LOCK_FILE).write_bytes(GARBAGE)
    (ckpt / "iter_0000002.tmp").write_text("in the way")
    runs = {
        "empty": [f"data.path={empty}"],
        "locked": [f"checkpoint.save={locked}"],
        "tiny": [f"data.path={tiny_corpus}", 'data.split="100,0,0"', f"checkpoint.save={ckpt}",
                 "checkpoint.save_interval=1"],
    }  # fmt: skip
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "engram_train.train", "train.train_iters=2", "train.lr_warmup_iters=1",
             f"experiment.exp_dir={tmp_path / ('exp_' + name)}", *overrides],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        for name, overrides in runs.items()
    }
    out = {name: p.communicate(timeout=600)[0] for name, p in procs.items()}
    for name, p in procs.items():
        assert p.returncode == 1 and "Traceback" not in out[name], out[name][-3000:]

    def said(name: str) -> list[str]:
        return [line for line in out[name].splitlines() if line.startswith("engram-train:")]

    files = f"{empty}.bin and {empty}.idx"
    assert said("empty") == [
        f"engram-train: data path: {files} are empty (0 bytes): no dataset to train on at '{empty}'. "
        f"Rebuild {files} with engram-preprocess from a non-empty corpus, or drop the prefix from data.path."
    ]
    path = locked.resolve() / LOCK_FILE
    assert said("locked") == [
        f"engram-train: checkpoint.save={locked.resolve()}: the lock file {path} is a directory, so no run "
        f"can take the folder's lock. It is not part of any checkpoint: remove it (rm -r {path}) and start "
        "the run again, or choose another checkpoint.save"
    ]
    tiny = out["tiny"]
    in_the_way = ckpt / "iter_0000002.tmp"
    assert said("tiny") == [
        f"engram-train: saving iteration 2 to {ckpt} failed: File exists: {in_the_way}. The newest complete "
        f"checkpoint is still iter_0000001. Move {in_the_way} out of the way (a save writes a directory of "
        f"that name), then resume with checkpoint.load={ckpt}"
    ]
    assert tiny.count("held unreadable content and no live process held it") == 1
    assert tiny.count("holds 11 tokens, fewer than one sample of 129 (train.seq_length=128 + 1)") == 1
    assert tiny.count("data.split='100,0,0' has no validation share: this run validates neither every "
                      "train.eval_interval=50 iterations nor at the end") == 1
    assert "validation loss" not in tiny
    assert latest_iteration(ckpt) == 1 and check_checkpoint(ckpt / "iter_0000001") == []
    assert in_the_way.read_text() == "in the way"

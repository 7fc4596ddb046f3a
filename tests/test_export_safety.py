"""What ``engram-export`` may write over: never a checkpoint (``--out`` that is, contains or lies
inside a checkpoint folder or the ``--load`` folder), ``--force`` only an earlier export; and the
publish step both formats share (temporary folder, marker, stale partial folders removed).

The refusals come before the checkpoint is read, so a folder laid out like a checkpoint serves;
every file is compared byte for byte afterwards.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from engram_train.export import main
from engram_train.export.publish import FORMATS, MARKER, publish

TRACKER = "latest_checkpointed_iteration.txt"


def fake_checkpoint(root: Path) -> Path:
    """A checkpoint.save folder: tracker, iter_0000002 with megatron's metadata and a manifest,
    optimizer shards included."""
    it = root / "iter_0000002"
    it.mkdir(parents=True)
    (root / TRACKER).write_text("2")
    for name, text in (("metadata.json", "{}"), ("manifest.json", "{}"), ("__0_0.distcp", "weights+optimizer"),
                       ("common.pt", "common")):
        (it / name).write_text(text)
    return root


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def cli_error(*argv) -> str:
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in argv])
    return str(exc.value)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_force_never_deletes_a_checkpoint(tmp_path, fmt):
    ckpt = fake_checkpoint(tmp_path / "run" / "ckpt")
    other = fake_checkpoint(tmp_path / "other")
    before, before_other = snapshot(tmp_path / "run"), snapshot(other)
    cases = {
        ckpt: f"--out {ckpt} is the checkpoint folder",
        ckpt / "iter_0000002": f"--out {ckpt / 'iter_0000002'} lies inside the checkpoint folder",
        ckpt / "export": f"--out {ckpt / 'export'} lies inside the checkpoint folder",
        tmp_path / "run": f"--out {tmp_path / 'run'} contains the checkpoint folder",
        other: f"--out {other} is a checkpoint folder; an export never writes there",
        other / "iter_0000002" / "x": f"lies inside the checkpoint folder {other}",
    }
    for out, message in cases.items():
        for load in (ckpt, ckpt / "iter_0000002"):
            error = cli_error("--load", load, "--out", out, "--format", fmt, "--force")
            assert message in error, (out, load, error)
            assert error.startswith("engram-export: error: ") and "\n" not in error
    assert snapshot(tmp_path / "run") == before and snapshot(other) == before_other


def test_force_replaces_only_an_earlier_export(tmp_path):
    ckpt = fake_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    for force in ((), ("--force",)):
        error = cli_error("--load", ckpt, "--out", out, *force)
        assert f"--out {out} is not empty and is not an earlier export (it has no {MARKER})" in error
    assert (out / "notes.txt").read_text() == "mine"
    # An earlier export holding a checkpoint folder is not replaced either.
    (out / MARKER).write_text("{}")
    fake_checkpoint(out / "kept")
    assert f"--out {out} contains the checkpoint folder {out / 'kept'}" in cli_error(
        "--load", ckpt, "--out", out, "--force")
    assert (out / "kept" / TRACKER).is_file()


def test_an_out_that_cannot_be_written_is_refused_before_loading(tmp_path):
    """A folder the process cannot write in (procfs accepts no new entries, root included) is
    named in one line before any checkpoint is read."""
    ckpt = fake_checkpoint(tmp_path / "ckpt")
    error = cli_error("--load", ckpt, "--out", "/proc/engram-export-out")
    assert error.startswith("engram-export: error: --out /proc/engram-export-out: cannot write in /proc (")
    assert "\n" not in error


def test_publish_is_atomic_marks_the_export_and_removes_stale_partials(tmp_path):
    out = tmp_path / "model"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()  # fmt: skip
    stale = [tmp_path / f".model.{dead}.abc123.partial", tmp_path / ".model.k2j4_x.partial",
             tmp_path / f".model.{dead}.zz.old"]
    live = tmp_path / ".model.1.abc.partial"  # pid 1 is alive: another export's, kept
    unrelated = tmp_path / f".model2.{dead}.abc.partial"
    for path in (*stale, live, unrelated):
        path.mkdir()
        (path / "part.safetensors").write_text("half")
    logged = []

    def fail(folder: Path) -> None:
        (folder / "a.bin").write_text("a")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        publish(out, "hf", fail, logged.append)
    assert not out.exists() and all(not p.exists() for p in stale) and live.exists() and unrelated.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, unrelated.name])
    assert sorted(logged) == sorted(f"removed {p}, left by an interrupted export" for p in stale)
    publish(out, "hf", lambda folder: (folder / "a.bin").write_text("a"), logged.append)
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "a.bin"]
    marker = json.loads((out / MARKER).read_text())
    assert {k: marker[k] for k in ("written_by", "format")} == {"written_by": "engram-export", "format": "hf"}
    assert marker["files"] == {"a.bin": {"size": 1, "sha256": hashlib.sha256(b"a").hexdigest()}}
    publish(out, "hf", lambda folder: (folder / "b.bin").write_text("b"), logged.append)  # replaced whole
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "b.bin"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, "model", unrelated.name])


def test_format_options_are_checked(tmp_path):
    ckpt = fake_checkpoint(tmp_path / "ckpt")
    assert "--table-dtype does not apply to --format hf" in cli_error(
        "--load", ckpt, "--out", tmp_path / "out", "--format", "hf", "--table-dtype", "bf16")
    assert set(FORMATS) == {"engram", "hf"} and FORMATS["engram"].options == ("table_dtype",)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_an_unresolved_training_config_is_named(tmp_path, fmt):
    from launch import REPO

    ckpt = fake_checkpoint(tmp_path / "ckpt")
    config = REPO / "conf" / "train.yaml"
    error = cli_error("--load", ckpt, "--out", tmp_path / "out", "--format", fmt, "--config", config)
    assert error == (f"engram-export: error: --config {config} is a config to compose (it lists defaults and "
                     "has no model section), not the resolved config of a run: pass "
                     "<experiment.exp_dir>/config.yaml, which engram-train writes")

"""Configuration and input errors that used to pass or end in a traceback: an unknown key added
with ``+`` to a typed section, a resume that changes the Engram tables' dtype or master, a
truncated safetensors file in an HF import, impossible mHC values with mHC off, and an HF export
folder whose files were changed after the export."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def compose(*overrides: str):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from engram_train.config import register

    register()  # the run config's schema (conf/train.yaml's defaults)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return hydra_compose(config_name="train", overrides=list(overrides))


# -- unknown keys added with `+` ----------------------------------------------------------------


@pytest.mark.parametrize("override, key, close", [
    ("+train.lrr=1e-3", "train.lrr", "train.lr"),
    ("++train.lrr=1e-3", "train.lrr", "train.lr"),
    ("+checkpoint.sav=x", "checkpoint.sav", "checkpoint.save"),
    ("+system.precison=bf16", "system.precison", "system.precision"),
    ("+trian.lr=1", "trian", "train"),
])
def test_plus_key_unknown_to_a_typed_section_is_refused(override, key, close):
    """Hydra adds a `+` key to a structured section silently; the trainer's first step and the
    planning tools' validation refuse it, naming the key and the closest known one."""
    from engram_train.config import typed_run_config
    from engram_train.errors import ConfigError, EngramError
    from engram_train.training.run_config import validate_run_config

    cfg = compose(override)  # Hydra itself lets it through
    for check in (typed_run_config, lambda c: validate_run_config(c, 1, check_data=False)):
        with pytest.raises(ConfigError) as info:
            check(cfg)
        message = str(info.value)
        assert message.startswith(f"{key}: ") and f"did you mean {close}?" in message
        assert "\n" not in message and isinstance(info.value, EngramError)


def test_known_keys_still_compose_and_validate():
    from engram_train.config import typed_run_config

    cfg = typed_run_config(compose("train.lr=1e-3", "checkpoint.save=/tmp/x", "model.use_engram=true"))
    assert cfg.train.lr == 1e-3 and cfg.checkpoint.save == "/tmp/x"
    with pytest.raises(Exception, match="Could not append to config. An item is already at 'train.lr'"):
        compose("+train.lr=1e-3")  # Hydra's own refusal of `+` on a known key stays


def test_trainer_refuses_plus_key_in_one_line(tmp_path):
    """The command line: exit 1 with one line naming the key, no traceback, nothing trained."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.pop("LOCAL_RANK", None)
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(
        [sys.executable, "-m", "engram_train.train", "+checkpoint.sav=" + str(tmp_path / "ckpt"),
         f"experiment.exp_dir={tmp_path / 'exp'}", "train.train_iters=2"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert [line for line in lines if "checkpoint.sav" in line] == [
        "engram-train: invalid configuration: checkpoint.sav: Key 'sav' not in 'CheckpointConfig': "
        "no part of the run reads it (a '+' does not add keys to a typed section); did you mean "
        "checkpoint.save? fix or drop the override (README 'Configuration reference' lists every key)"
    ]
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "exp" / "metrics.jsonl").exists()


# -- resume with another table dtype or master --------------------------------------------------

FOUR_BYTE = ("model.engram_table_dtype=bf16", "model.engram_optimizer=rowwise_adam",
             "model.engram_master_weights=false", "model.engram_optimizer_state_dtype=bf16")


@pytest.fixture(scope="module")
def identity():
    from engram_train.engram.ngram_hash import NgramHashMapping
    from engram_train.training.run_config import build_transformer_config
    from engram_train.training.run_identity import run_identity

    mapping = {}

    def make(*overrides):
        config = build_transformer_config(compose("model.use_engram=true", *overrides))
        if "m" not in mapping:  # the hash identity does not depend on the table storage
            mapping["m"] = NgramHashMapping(config)
        return run_identity(config, 4096, mapping["m"])

    return make


def _refusal(saved, current, **kwargs):
    from engram_train.training.run_identity import ResumeMismatchError, check_run_identity

    with pytest.raises(ResumeMismatchError) as info:
        check_run_identity(saved, current, load_engram=True, where="ckpt", **kwargs)
    return info.value


def test_table_storage_is_recorded(identity):
    assert identity()["engram_table_storage"] == {"dtype": "fp32", "master": False}
    assert identity("model.engram_table_dtype=bf16")["engram_table_storage"] == {"dtype": "bf16", "master": True}
    assert identity(*FOUR_BYTE)["engram_table_storage"] == {"dtype": "bf16", "master": False}
    assert identity("model.use_engram=false")["engram_table_storage"] is None


def test_resume_with_another_table_dtype_is_refused_naming_the_field(identity):
    fp32, bf16 = identity(), identity("model.engram_table_dtype=bf16")
    err = _refusal(fp32, bf16)
    (line,) = [x for x in str(err).splitlines() if "engram_table_dtype" in x]
    assert line == (
        "  - model.engram_table_dtype: fp32 in the checkpoint, bf16 here. The checkpoint holds fp32 "
        "tables (their own master), this run keeps bf16 tables with float32 master; the table state "
        "does not convert on load: resume with model.engram_table_dtype=fp32 (the checkpoint's), or "
        "set checkpoint.load_engram=false to keep the backbone and start Engram afresh")
    assert err.overrides == ("checkpoint.load_engram=false",)
    assert "resume with model.engram_table_dtype=bf16 (the checkpoint's)" in str(_refusal(bf16, fp32))
    # fp32 -> the 4-byte tables (same keys, but the values would be rounded): the way back
    # also names the master setting the fp32 table needs
    assert ("resume with model.engram_table_dtype=fp32 model.engram_master_weights=true (the "
            "checkpoint's)") in str(_refusal(fp32, identity(*FOUR_BYTE)))


def test_resume_from_four_byte_tables_with_master_is_refused(identity):
    four = identity(*FOUR_BYTE)
    with_master = identity("model.engram_table_dtype=bf16", "model.engram_optimizer=rowwise_adam",
                           "model.engram_optimizer_state_dtype=bf16")
    message = str(_refusal(four, with_master))
    assert ("model.engram_master_weights: false in the checkpoint, true here. The checkpoint holds "
            "bf16 tables without float32 master, this run keeps bf16 tables with float32 master"
            in message)
    assert "resume with model.engram_master_weights=false (the checkpoint's)" in message
    assert "model.engram_master_weights: true in the checkpoint, false here" in str(_refusal(with_master, four))
    # the case: bf16 with master and the default optimizer: both differences, one message
    message = str(_refusal(four, identity("model.engram_table_dtype=bf16")))
    assert "model.engram_optimizer:" in message and "model.engram_master_weights:" in message


def test_unchanged_storage_older_manifests_and_load_engram_false_pass(identity):
    from engram_train.training.run_identity import check_run_identity

    four, bf16 = identity(*FOUR_BYTE), identity("model.engram_table_dtype=bf16")
    check_run_identity(four, identity(*FOUR_BYTE), load_engram=True, where="ckpt")
    check_run_identity(bf16, identity("model.engram_table_dtype=bf16", "model.engram_optimizer=adam"),
                       load_engram=True, where="ckpt")
    check_run_identity(four, bf16, load_engram=False, where="ckpt")  # Engram starts afresh
    older = {k: v for k, v in identity().items() if k != "engram_table_storage"}
    check_run_identity(older, bf16, load_engram=True, where="ckpt")  # nothing recorded to compare
    # the optimizer state dtype alone is not refused (same keys, the load casts the moments)
    check_run_identity(four, identity(*FOUR_BYTE[:3]), load_engram=True, where="ckpt")


# -- a truncated safetensors file in an HF import -----------------------------------------------


def _safetensors(path: Path) -> bytes:
    import torch
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.ones(64, 32)}, str(path))
    return path.read_bytes()


@pytest.mark.parametrize("keep", [-100, 20, 0])
def test_truncated_safetensors_is_named(tmp_path, keep):
    from engram_train.errors import EngramError
    from engram_train.models.hf_folder import HFFolder, HFSourceError

    data = _safetensors(tmp_path / "model.safetensors")
    cut = data[:keep]
    (tmp_path / "model.safetensors").write_bytes(cut)
    with pytest.raises(HFSourceError) as info:
        HFFolder(tmp_path)
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'model.safetensors'} ({len(cut)} bytes) is truncated or damaged")
    assert "\n" not in message and isinstance(info.value, EngramError)


def test_truncated_shard_named_by_an_index_is_named(tmp_path):
    from engram_train.models.hf_folder import HFFolder, HFSourceError

    data = _safetensors(tmp_path / "model-00001-of-00001.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00001.safetensors"}}))
    assert HFFolder(tmp_path).read("model.embed_tokens.weight").shape == (64, 32)
    (tmp_path / "model-00001-of-00001.safetensors").write_bytes(data[: len(data) // 2])
    folder = HFFolder(tmp_path)  # the index is read; shards are opened when a tensor is
    with pytest.raises(HFSourceError, match=r"model-00001-of-00001\.safetensors \(\d+ bytes\) is truncated"):
        folder.read("model.embed_tokens.weight")
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"a": ')
    with pytest.raises(HFSourceError, match=r"model\.safetensors\.index\.json is damaged"):
        HFFolder(tmp_path)


# -- mHC values checked with mHC off ------------------------------------------------------------


@pytest.mark.parametrize("override, expected", [
    ("model.num_residual_streams=0", "num_residual_streams=0 must be >= 1"),
    ("model.mhc_sinkhorn_iterations=-3", "mhc_sinkhorn_iterations=-3 must be >= 1"),
    ("model.mhc_init_gating_factor=-0.5", "mhc_init_gating_factor=-0.5 must be >= 0"),
])
def test_impossible_mhc_values_are_refused_with_mhc_off(override, expected):
    from engram_train.errors import ConfigError
    from engram_train.training.run_config import build_transformer_config

    with pytest.raises(ConfigError, match=rf"{expected}.*\(checked with enable_hyper_connections=false too\)"):
        build_transformer_config(compose("model.enable_hyper_connections=false", override))


def test_mhc_off_keeps_accepting_possible_values():
    from engram_train.training.run_config import build_transformer_config

    config = build_transformer_config(compose("model.enable_hyper_connections=false",
                                              "model.num_residual_streams=1", "model.use_engram=true"))
    assert config.engram_hc_mult == 1 and config.num_residual_streams == 1


# -- an HF export's files against its marker ----------------------------------------------------


def _export(out: Path) -> None:
    from engram_train.export.publish import publish

    def write(folder: Path) -> None:
        (folder / "config.json").write_text("{}\n")
        (folder / "modeling_engram_deepseek_v3.py").write_text("x = 1\n")
        (folder / "sub").mkdir()
        (folder / "sub" / "model.safetensors").write_bytes(b"\0" * 100)

    publish(out, "hf", write, lambda _: None)


def test_export_marker_records_every_file_and_check_names_changes(tmp_path, capsys):
    import hashlib

    from engram_train.export import main
    from engram_train.export.export_errors import ExportError
    from engram_train.export.publish import MARKER, verify_export

    out = tmp_path / "hf"
    _export(out)
    files = json.loads((out / MARKER).read_text())["files"]
    assert files["modeling_engram_deepseek_v3.py"] == {
        "size": 6, "sha256": hashlib.sha256(b"x = 1\n").hexdigest()}
    assert sorted(files) == ["config.json", "modeling_engram_deepseek_v3.py", "sub/model.safetensors"]
    assert verify_export(out) == 3
    (out / "__pycache__").mkdir()  # a tool's cache is not an added file
    (out / "__pycache__" / "m.pyc").write_bytes(b"c")
    main(["--check", str(out)])
    assert "3 files match the SHA-256" in capsys.readouterr().err

    (out / "modeling_engram_deepseek_v3.py").write_text("x = 2\n")  # same size, other bytes
    (out / "sub" / "model.safetensors").unlink()
    (out / "extra.py").write_text("")
    with pytest.raises(ExportError) as info:
        verify_export(out)
    message = str(info.value)
    assert "\n" not in message
    assert "modeling_engram_deepseek_v3.py changed (sha256 " in message
    assert "sub/model.safetensors missing" in message and "extra.py added" in message
    with pytest.raises(SystemExit) as stop:
        main(["--check", str(out)])
    assert str(stop.value).startswith(f"engram-export: error: export {out} does not match")

    (out / MARKER).write_text(json.dumps({"written_by": "engram-export", "format": "hf"}))
    with pytest.raises(ExportError, match="records no file hashes .* re-export"):
        verify_export(out)
    with pytest.raises(ExportError, match="is not an export: it has no"):
        verify_export(tmp_path)

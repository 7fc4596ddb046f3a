"""engram-sweep: matched variants, the code corpus's checksum and split, and a smoke sweep."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import random
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from launch import run_process

REPO = Path(__file__).resolve().parents[1]
DEMO = ["--data-path", "examples/data/demo_text_document", "--split", "90,10,0",
        "--tokenizer", "examples/data/tokenizer"]


def _sweep(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return run_process([sys.executable, "-m", "engram_train.sweep", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def _corpus_module():
    spec = importlib.util.spec_from_file_location(
        "build_code_corpus", REPO / "scripts" / "build_code_corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------- variants


@pytest.fixture(scope="module")
def dry_run() -> list[dict]:
    done = _sweep("--dry-run", "--total-params", "1.5M", *DEMO)
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def test_variants_match_the_total_and_report_activated(dry_run):
    by_name = {v["variant"]: v for v in dry_run}
    assert list(by_name) == ["moe", "engram_rho0.2", "engram_rho0.4", "engram_rho0.6",
                             "engram_rho0.2_one_row", "engram_rho0.2_frozen"]
    moe = by_name["moe"]
    assert moe["rho"] is None and moe["engram_tables"] == 0
    assert abs(moe["total_params"] - 1_500_000) / 1_500_000 < 0.02  # nearest whole expert
    for name in ("engram_rho0.2", "engram_rho0.4", "engram_rho0.6", "engram_rho0.2_frozen"):
        v = by_name[name]
        assert abs(v["total_params"] - moe["total_params"]) <= 0.01 * moe["total_params"], name
        assert abs(v["rho_actual"] - v["rho"]) <= 0.5 / moe["routed_experts"] + 1e-9
        # Top-k is kept: the activated parameters differ by Engram's projections, less the
        # router rows of the removed experts (a router reads every expert's row).
        shortfall = v["engram_dense"] - (v["active_params"] - moe["active_params"])
        removed = moe["routed_experts"] - v["routed_experts"]
        assert shortfall == removed * 64 * 3  # hidden 64, 3 MoE layers
        assert v["lookups_per_row"] > 1
    tables = [by_name[f"engram_rho{r}"]["engram_tables"] for r in (0.2, 0.4, 0.6)]
    assert tables == sorted(tables) and tables[0] > 0
    one_row = by_name["engram_rho0.2_one_row"]
    # 2 layers x 2 orders x 4 heads, one row of 64 / 4 = 16 values each.
    assert one_row["engram_tables"] == 16 * 16
    assert one_row["active_params"] == by_name["engram_rho0.2"]["active_params"]


def test_too_small_a_budget_is_refused_with_the_fix():
    done = _sweep("--dry-run", "--rhos", "0.2", "--controls", "", *DEMO)
    assert done.returncode != 0
    assert "rho=0.2" in done.stderr and "--total-params" in done.stderr


def test_one_row_control_hashes_every_ngram_to_row_zero():
    from types import SimpleNamespace

    from engram_train.engram.ngram_hash import NgramHashMapping, engram_head_vocab_sizes

    sizes = engram_head_vocab_sizes([101, 101], 3, 4, [1, 3], one_row=True)
    assert sizes == {1: [[1] * 4] * 2, 3: [[1] * 4] * 2}
    config = SimpleNamespace(
        engram_layer_ids=[1, 3], max_ngram_size=3, n_head_per_ngram=4, engram_pad_id=0,
        engram_reset_at_eos=False, engram_eos_id=None, engram_seed=0,
        engram_vocab_size=[101, 101], engram_one_row_per_head=True)
    mapping = NgramHashMapping(config, tokenizer=np.arange(50))
    ids = np.random.default_rng(0).integers(0, 50, size=(2, 16))
    assert all((h == 0).all() for h in mapping.hash(ids).values())


# --------------------------------------------------------------------------- corpus


def _fake_wheel(folder: Path, files: dict[str, str]) -> tuple[str, str, str]:
    path = folder / "fakepkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return ("fakepkg==1.0", path.name, digest)


def _sources(n: int) -> dict[str, str]:
    rng = random.Random(0)
    words = ["def", "return", "self", "import", "class", "for", "in", "if", "x", "y", "(", ")"]
    files = {f"fakepkg/mod{i}.py": " ".join(rng.choice(words) for _ in range(60)) + "\n"
             for i in range(n)}
    files["fakepkg/empty.py"] = "\n"
    files["fakepkg/data.txt"] = "not python"
    return files


def test_corpus_refuses_a_wheel_whose_checksum_differs(tmp_path):
    corpus = _corpus_module()
    requirement, name, digest = _fake_wheel(tmp_path, _sources(3))
    corpus.fetch_wheels([(requirement, name, digest)], tmp_path)  # present and pinned: accepted
    with pytest.raises(corpus.CorpusError, match="SHA-256 .* differs from the pinned"):
        corpus.fetch_wheels([(requirement, name, "0" * 64)], tmp_path)


def test_corpus_split_is_by_file_and_deterministic():
    corpus = _corpus_module()
    docs = [(f"pkg/f{i}.py", f"x = {i}\n") for i in range(400)]
    train, valid = corpus.split_files(docs, 10.0)
    shuffled = docs[:]
    random.Random(1).shuffle(shuffled)
    assert corpus.split_files(shuffled, 10.0) == (train, valid)
    names = {n for n, _ in train} | {n for n, _ in valid}
    assert len(names) == 400 and not {n for n, _ in train} & {n for n, _ in valid}
    assert 20 <= len(valid) <= 60  # about 10% of 400
    # The same file is held out in any corpus it appears in.
    assert all(corpus.is_validation(n, 10.0) for n, _ in valid)


def test_corpus_build_holds_out_the_validation_files(tmp_path):
    from engram_train.sweep.runner import split_token_counts

    corpus = _corpus_module()
    wheel = _fake_wheel(tmp_path, _sources(40))
    meta = corpus.build(tmp_path / "out", tmp_path, 25.0, wheels=[wheel], vocab_size=300)
    n_train, n_valid = meta["files"]["train"], meta["files"]["valid"]
    assert n_train + n_valid == 40  # the empty file and the non-.py file are left out
    assert meta["split"] == f"{n_train},{n_valid},0" and n_valid > 0
    # megatron's document split puts exactly the held-out files in the validation split.
    counts = split_token_counts(str(tmp_path / "out" / meta["prefix"]), meta["split"])
    assert counts == {**meta["tokens"], "test": 0}
    lines = (tmp_path / "out" / "corpus.jsonl").read_text().splitlines()
    assert [json.loads(x)["file"] for x in lines[n_train:]] == meta["valid_files"]


# --------------------------------------------------------------------------- smoke sweep


def test_smoke_sweep_trains_two_variants_and_reports(tmp_path):
    done = _sweep("--total-params", "1.5M", "--variants", "moe,engram_rho0.2", "--seeds", "7",
                  "--train-iters", "4", "--global-batch-size", "2", "--seq-length", "32",
                  "--eval-interval", "2", "--eval-iters", "1", "--out", str(tmp_path), *DEMO,
                  "train.log_interval=1")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "allocation_sweep.json").read_text())
    assert [(r["variant"], r["seed"]) for r in report["runs"]] == [("moe", 7), ("engram_rho0.2", 7)]
    for r in report["runs"]:
        assert r["tokens"] == 4 * 2 * 32
        assert math.isfinite(r["val_loss"]) and r["tokens_per_s"] > 0 and r["step_time_s"] > 0
        assert r["tokens_per_s_best"] >= r["tokens_per_s"]
        assert [it for it, _ in r["val_curve"]] == [2, 4]
    moe, engram = report["runs"]
    assert moe["rho"] is None and engram["rho"] == 0.2
    assert engram["active_params"] > moe["active_params"]
    assert "| `engram_rho0.2` | " in done.stdout  # the summary table, printed at the end
    summary = {row["variant"]: row for row in report["summary"]}
    assert summary["moe"]["throughput_vs_moe"]["median"] == 1.0
    assert summary["moe"]["best_throughput_vs_moe"]["median"] == 1.0
    for name in ("allocation_loss_vs_rho.png", "allocation_throughput.png",
                 "allocation_loss_curves.png"):
        assert (tmp_path / name).stat().st_size > 1000
    # A finished sweep resumes without training again.
    metrics = tmp_path / "runs" / "moe_seed7" / "metrics.jsonl"
    before = metrics.stat().st_mtime_ns
    again = _sweep("--total-params", "1.5M", "--variants", "moe", "--seeds", "7",
                   "--train-iters", "4", "--global-batch-size", "2", "--seq-length", "32",
                   "--eval-interval", "2", "--eval-iters", "1", "--out", str(tmp_path), *DEMO,
                   "train.log_interval=1")
    assert again.returncode == 0, again.stderr[-2000:]
    assert metrics.stat().st_mtime_ns == before


def test_a_schedule_that_would_repeat_tokens_is_refused(tmp_path):
    done = _sweep("--variants", "moe", "--rhos", "", "--controls", "", "--train-iters", "100000",
                  "--out", str(tmp_path), *DEMO)
    assert done.returncode != 0 and "tokens would repeat" in done.stderr


def test_frozen_tables_keep_their_init(tmp_path):
    """engram_freeze_tables: after training steps with a non-zero LR the exported table is still
    the init a fresh module draws (and the trained projections have moved away from it)."""
    import torch
    from safetensors.torch import load_file

    from engram_train.config import EngramConfig
    from engram_train.engram.engram_module import Engram

    train = run_process(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
         "-m", "engram_train.train", "+model.engram_freeze_tables=true", "train.train_iters=2",
         "train.seq_length=32", "train.global_batch_size=2", "train.micro_batch_size=2",
         "train.eval_interval=null", f"experiment.exp_dir={tmp_path / 'run'}",
         f"checkpoint.save={tmp_path / 'ckpt'}"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert train.returncode == 0, train.stderr[-3000:]
    export = run_process([sys.executable, "-m", "engram_train.export", "--load",
                             str(tmp_path / "ckpt"), "--config", str(tmp_path / "run" / "config.yaml"),
                             "--out", str(tmp_path / "export")],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert export.returncode == 0, export.stderr[-3000:]
    trained = load_file(tmp_path / "export" / "engram_layer1.safetensors")
    config = EngramConfig(
        use_engram=True, engram_tokenizer_name_or_path=str(REPO / "examples/data/tokenizer"),
        engram_vocab_size=[20011, 20011], max_ngram_size=3, n_embed_per_ngram=64,
        n_head_per_ngram=4, engram_layer_ids=[1, 3])  # deepseek_v3_tiny's Engram
    fresh = Engram(config, hidden_size=64, layer_id=1).state_dict()
    assert torch.equal(trained["multi_head_embedding.embedding.weight"],
                       fresh["multi_head_embedding.weight"])
    assert not torch.equal(trained["norm1.0.weight"], fresh["norm1.0.weight"])  # it trained

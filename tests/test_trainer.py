"""The trainer as users run it: torchrun + Hydra overrides, metrics, plot, checkpoints, resume."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from engram_train.config import register

from launch import REPO, free_port, run_process

CONF = str(REPO / "conf")


def run_trainer(nproc: int, *overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={free_port()}", "-m", "engram_train.train", *overrides]
    proc = run_process(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def read_metrics(exp_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (exp_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """The default (demo) config on 2 processes, 30 iterations, checkpoints at 15 and 30."""
    root = tmp_path_factory.mktemp("trainer")
    exp, ckpt = root / "run", root / "ckpt"
    proc = run_trainer(
        2, f"experiment.exp_dir={exp}", f"checkpoint.save={ckpt}", "checkpoint.save_interval=15",
        "train.train_iters=30", "train.log_interval=5", "train.eval_interval=15", "train.eval_iters=2",
        "train.lr_warmup_iters=5",
    )
    return root, exp, ckpt, proc


def test_demo_logs_megatron_style_lines(demo_run):
    _, _, _, proc = demo_run
    lines = [l for l in proc.stdout.splitlines() if " iteration " in l and "lm loss:" in l]
    assert len(lines) == 6
    for field in ("consumed samples:", "elapsed time per iteration (ms):", "tokens/s:", "learning rate:",
                  "grad norm:", "mem (GiB)"):
        assert field in lines[0]
    assert "validation loss at iteration 15" in proc.stdout


def test_metrics_jsonl_records_and_falling_loss(demo_run):
    _, exp, _, _ = demo_run
    records = read_metrics(exp)
    assert [r["iteration"] for r in records] == [5, 10, 15, 20, 25, 30]
    for r in records:
        assert {"iteration", "lm_loss", "lr", "grad_norm", "tokens_per_s", "step_time_s"} <= set(r)
        assert math.isfinite(r["lm_loss"]) and r["tokens_per_s"] > 0
    assert [r["iteration"] for r in records if "val_loss" in r] == [15, 30]
    assert records[-1]["lm_loss"] < records[0]["lm_loss"] - 0.5
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert val[1] < val[0]


def test_outputs_written(demo_run):
    _, exp, ckpt, _ = demo_run
    assert (exp / "loss.png").stat().st_size > 10_000
    assert any((exp / "tensorboard").iterdir())
    assert "train_iters: 30" in (exp / "config.yaml").read_text()  # overrides recorded
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "30"
    assert (ckpt / "iter_0000015").is_dir() and not list(ckpt.glob("*.tmp"))


def test_resume_is_exact(demo_run):
    """Resume from iteration 15 and continue: the logged losses at 20, 25, 30 are identical
    (the resumed run hashes with two threads: the same ids)."""
    root, exp, ckpt, _ = demo_run
    partial = root / "ckpt15"
    partial.mkdir()
    shutil.copytree(ckpt / "iter_0000015", partial / "iter_0000015")
    (partial / "latest_checkpointed_iteration.txt").write_text("15")
    resumed = root / "resumed"
    run_trainer(
        2, f"experiment.exp_dir={resumed}", f"checkpoint.load={partial}",
        "train.train_iters=30", "train.log_interval=5", "train.eval_interval=15", "train.eval_iters=2",
        "train.lr_warmup_iters=5", "data.hash_threads=2",
    )
    original = {r["iteration"]: r for r in read_metrics(exp)}
    again = {r["iteration"]: r for r in read_metrics(resumed)}
    assert sorted(again) == [20, 25, 30]
    for it in (20, 25, 30):
        assert again[it]["lm_loss"] == original[it]["lm_loss"]
        assert again[it]["lr"] == original[it]["lr"]
    assert again[30]["val_loss"] == original[30]["val_loss"]


@pytest.mark.parametrize("preset", ["deepseek_v3_tiny", "deepseek_v3_small", "engram_27b"])
def test_every_preset_prints_its_job_config(preset):
    proc = run_process([sys.executable, "-m", "engram_train.train", f"model={preset}", "--cfg", "job"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "use_engram: true" in proc.stdout and "engram_layer_ids" in proc.stdout


def _cfg(*overrides):
    register()  # the run config's schema (conf/train.yaml's defaults)
    with initialize_config_dir(config_dir=CONF, version_base=None):
        return compose(config_name="train", overrides=list(overrides))


@pytest.mark.parametrize(
    "overrides, world, match",
    [
        (["train.global_batch_size=6"], 4, r"train.global_batch_size=6 must be divisible"),
        (["system.pipeline_model_parallel_size=3"], 3, r"model.num_layers=4 must be divisible"),
        (["system.tensor_model_parallel_size=2", "system.sequence_parallel=false"], 2,
         r"system.sequence_parallel"),
        (["system.precision=fp8"], 1, r"system.precision='fp8'"),
        (["system.recompute_granularity=everything"], 1, r"system.recompute_granularity"),
        (["data.hash_threads=0"], 1, r"data.hash_threads=0 must be an int >= 1"),
        (["data.path=/nonexistent/prefix"], 1, r"data.path: /nonexistent/prefix.bin does not exist"),
        (["data.path=[0.5,examples/data/demo_text_document,0.5,/nonexistent/b]"], 1,
         r"data.path: /nonexistent/b.bin does not exist"),
        (["data.tokenizer=/nonexistent"], 1, r"data\.tokenizer: no tokenizer\.json at '/nonexistent'"),
        (["system.tensor_model_parallel_size=3"], 4, r"world size 4 is not divisible"),
        (["model.engram_embedding_parallel_size=3"], 4, r"engram_embedding_parallel_size=3"),
        (["model.engram_embedding_parallel_method=allreduce", "model.engram_embedding_parallel_size=2"], 2,
         r"'allreduce' shards the tables over the tensor-parallel group"),
        (["system.virtual_pipeline_model_parallel_size=2"], 2, r"virtual_pipeline_model_parallel_size"),
        (["system.expert_model_parallel_size=3"], 4, r"expert_model_parallel_size 3 must divide"),
        (["data.reset_attention_mask=true"], 1, r"data.reset_attention_mask=true is not supported"),
    ],
)
def test_bad_configs_fail_before_any_process_group(overrides, world, match):
    from engram_train.training.run_config import ConfigError, validate_run_config

    with pytest.raises(ConfigError, match=match):
        validate_run_config(_cfg(*overrides), world)


def test_model_fields_are_validated_with_megatron_and_engram_rules():
    from engram_train.training.run_config import ConfigError, build_transformer_config

    with pytest.raises(ConfigError, match=r"unknown keys \['hiden_size'\]"):
        build_transformer_config(_cfg("+model.hiden_size=64"))
    with pytest.raises(ConfigError, match="engram_layer_ids"):
        build_transformer_config(_cfg("model.engram_layer_ids=[1,7]"))
    config = build_transformer_config(_cfg("model.use_engram=false"))
    assert config.use_engram is False and config.multi_latent_attention


def test_default_config_is_valid_for_every_layout_up_to_four_processes():
    from engram_train.training.run_config import build_transformer_config, validate_run_config

    layouts = [(1, 1, 1, 1), (2, 1, 1, 1), (2, 2, 1, 1), (2, 1, 2, 1), (4, 1, 1, 1), (4, 2, 2, 1),
               (4, 2, 1, 2), (4, 1, 2, 1), (4, 1, 4, 1), (4, 4, 1, 1), (4, 1, 1, 4), (3, 1, 1, 1)]
    for world, tp, pp, ep in layouts:
        cfg = _cfg(f"system.tensor_model_parallel_size={tp}", f"system.pipeline_model_parallel_size={pp}",
                   f"system.expert_model_parallel_size={ep}")
        if world == 3:
            cfg = _cfg("train.global_batch_size=6")
        validate_run_config(cfg, world)
        build_transformer_config(cfg)

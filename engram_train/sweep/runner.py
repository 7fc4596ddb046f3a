"""Train the sweep's variants through the trainer's CLI, seed-major, and read their metrics.

Every run is `torchrun --standalone --nproc-per-node <n> -m engram_train.train` with the
variant's model section written as `<out>/conf/model/<variant>.yaml` (found through Hydra's
`--config-dir`), the seed, the data and the same schedule for all. Seeds go round the variants in
turn (seed 1: every variant, then seed 2, ...), so a load that changes during the sweep falls on
every variant alike. A run whose metrics already reach its last iteration with the same command
is not repeated: a sweep that was stopped resumes where it stopped.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from engram_train.sweep.variants import SweepError, Variant


@dataclass
class Schedule:
    """What every run shares: data, batch, length of training, evaluation."""

    data_path: str
    split: str
    tokenizer: str
    train_iters: int
    global_batch_size: int
    micro_batch_size: int
    seq_length: int
    eval_interval: int
    eval_iters: int
    nproc: int = 1
    threads: int = 1

    @property
    def tokens(self) -> int:
        return self.train_iters * self.global_batch_size * self.seq_length

    def overrides(self) -> list[str]:
        return [
            f"data.path={self.data_path}", f"data.split='{self.split}'",
            f"data.tokenizer={self.tokenizer}", f"train.train_iters={self.train_iters}",
            f"train.global_batch_size={self.global_batch_size}",
            f"train.micro_batch_size={self.micro_batch_size}",
            f"train.seq_length={self.seq_length}", f"train.eval_interval={self.eval_interval}",
            f"train.eval_iters={self.eval_iters}",
        ]


def split_token_counts(prefix: str, split: str) -> dict[str, int]:
    """Tokens in each split of an indexed dataset, cut by documents as megatron cuts them."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    import numpy as np

    dataset = IndexedDataset(prefix)
    lengths = np.array(dataset.sequence_lengths, dtype=np.int64)  # a copy: the map closes
    del dataset
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    out = {}
    for name, bounds in zip(("train", "valid", "test"), matrix):
        if bounds is None:
            out[name] = 0
            continue
        lo, hi = (int(round(b * float(len(lengths)))) for b in bounds)
        out[name] = int(lengths[lo:hi].sum())
    return out


def check_single_epoch(schedule: Schedule) -> dict[str, int]:
    """Refuse a schedule that would show a training token twice, or evaluate on nothing."""
    counts = split_token_counts(schedule.data_path, schedule.split)
    need = schedule.train_iters * schedule.global_batch_size * (schedule.seq_length + 1)
    if need > counts["train"]:
        raise SweepError(
            f"{schedule.train_iters} iterations x {schedule.global_batch_size} x "
            f"{schedule.seq_length + 1} tokens = {need:,} exceed the train split's "
            f"{counts['train']:,} tokens of {schedule.data_path}: tokens would repeat. Lower "
            "--train-iters or use a larger corpus (scripts/build_code_corpus.py)")
    if counts["valid"] == 0:
        raise SweepError(f"data split {schedule.split!r} holds no validation documents")
    return counts


def write_model_configs(variants: Sequence[Variant], conf_dir: Path) -> None:
    (conf_dir / "model").mkdir(parents=True, exist_ok=True)
    for v in variants:
        text = f"# engram-sweep variant {v.name}\n" + OmegaConf.to_yaml(OmegaConf.create(v.model))
        (conf_dir / "model" / f"{v.name}.yaml").write_text(text)


def run_command(variant: str, seed: int, schedule: Schedule, conf_dir: Path, exp_dir: Path,
                extra: Sequence[str]) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={schedule.nproc}", "-m", "engram_train.train",
        "--config-dir", str(conf_dir.resolve()), f"model={variant}", f"train.seed={seed}",
        f"experiment.exp_name={exp_dir.name}", f"experiment.exp_dir={exp_dir}",
        *schedule.overrides(), *extra,
    ]


def read_metrics(exp_dir: Path) -> list[dict]:
    path = exp_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(records: list[dict], schedule: Schedule) -> dict:
    """Final validation loss, and throughput as the median (and the best) over logged
    intervals after the first (which carries start-up)."""
    train = [r for r in records if "lm_loss" in r]
    vals = [(r["iteration"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    steady = train[1:] or train
    tps = [r["tokens_per_s"] for r in steady if r.get("tokens_per_s")]
    step = [r["step_time_s"] for r in steady if r.get("step_time_s")]
    final = vals[-1] if vals and vals[-1][0] == schedule.train_iters else None
    return {
        "tokens": schedule.tokens,
        "val_loss": final[1] if final else None,
        "tokens_per_s": statistics.median(tps) if tps else None,
        # The least disturbed interval: nearer the machine's own speed when others load it.
        "tokens_per_s_best": max(tps) if tps else None,
        "step_time_s": statistics.median(step) if step else None,
        "train_curve": [[r["iteration"], r["lm_loss"]] for r in train],
        "val_curve": [list(v) for v in vals],
    }


def run_one(variant: Variant, seed: int, schedule: Schedule, out: Path,
            extra: Sequence[str]) -> dict:
    """Train one variant for one seed (or reuse its finished run) and return its summary."""
    exp_dir = out / "runs" / f"{variant.name}_seed{seed}"
    cmd = run_command(variant.name, seed, schedule, out / "conf", exp_dir, extra)
    stamp = exp_dir / "sweep_command.json"
    done = summarize(read_metrics(exp_dir), schedule)
    if done["val_loss"] is not None and stamp.is_file() and json.loads(stamp.read_text()) == cmd[1:]:
        return done
    exp_dir.mkdir(parents=True, exist_ok=True)
    (exp_dir / "metrics.jsonl").unlink(missing_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(schedule.threads))
    start = time.monotonic()
    with open(exp_dir / "sweep_stdout.log", "w") as log:
        rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = (exp_dir / "sweep_stdout.log").read_text().splitlines()[-15:]
        raise SweepError(f"run {exp_dir.name} failed (exit {rc}):\n" + "\n".join(tail))
    stamp.write_text(json.dumps(cmd[1:]))
    result = summarize(read_metrics(exp_dir), schedule)
    result["wall_s"] = round(time.monotonic() - start, 1)
    if result["val_loss"] is None:
        raise SweepError(f"run {exp_dir.name} ended without a validation loss at iteration "
                         f"{schedule.train_iters}; see {exp_dir / 'sweep_stdout.log'}")
    return result


def run_sweep(variants: Sequence[Variant], seeds: Sequence[int], schedule: Schedule, out: Path,
              extra: Sequence[str], on_run: Callable[[list[dict]], None]) -> list[dict]:
    """Seed-major: every variant for the first seed, then the next seed. `on_run` gets the runs
    so far after each one (the report is rewritten as the sweep goes)."""
    write_model_configs(variants, out / "conf")
    runs: list[dict] = []
    for seed in seeds:
        for v in variants:
            print(f"engram-sweep: {v.name} seed {seed} ...", flush=True)
            result = run_one(v, seed, schedule, out, extra)
            runs.append({**v.summary(), "seed": seed, **result})
            print(f"engram-sweep: {v.name} seed {seed}: val_loss {result['val_loss']:.4f}, "
                  f"{result['tokens_per_s']:.0f} tokens/s", flush=True)
            on_run(runs)
    return runs

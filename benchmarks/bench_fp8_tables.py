"""Engram tables as FP8 E4M3 with E8M0 scales: host memory per table parameter, and quality.

``memory`` (default): the demo model (``deepseek_v3_tiny``) with host-resident tables grown to
``--params`` table parameters, in four configurations side by side, each in its own process:

- ``fp32``: float32 tables with ``sparse_adam`` (the demo's default: value + two moments);
- ``bf16_4byte``: the 4-byte configuration (bf16 tables without master, ``rowwise_adam`` with
  a bf16 first moment);
- ``fp8_frozen``: ``engram_table_dtype=fp8_e4m3`` with ``engram_freeze_tables=true`` (no
  gradient, no optimizer state);
- ``fp8_trained``: fp8 tables trained by ``rowwise_adam`` (bf16 first moment, one bf16
  second moment per row, both and the rows rounded stochastically);
- ``fp8_frozen_d32``, ``fp8_trained_d32``: the same with rows of 32 values instead of the
  demo's 16 (``n_head_per_ngram=2``): the scale byte and the row moment spread over 32.

Each process builds the demo-size model first (imports, allocator, process groups), then the
big one; it reports the resident memory the big model added (RSS after building it,
materialising its optimizer state as after a long run, and ``--steps`` training steps, minus
RSS before it) over its table parameters, next to the accounting
(``training/run_config.engram_table_bytes_per_param``). The backbone of the big model counts
against the tables (a few MB).

``timing``: the host table update per step (``engram_host_update_s``) and the step time,
``bf16_4byte`` against ``fp8_trained``, trainer runs interleaved over ``--rounds``.

``quality``: the trainer on the demo (its 200 iterations, validation at the end) for
``--seeds`` seeds (``train.seed``), host placement, ``bf16_4byte`` against ``fp8_trained``
(and ``fp8_frozen`` as the floor): final validation loss of each run and the mean difference.
Configurations not named in ``--configs`` are kept from ``--out`` when it has the same
``--iters``.

    python benchmarks/bench_fp8_tables.py [memory|quality|timing] [--params 3e8]
        [--seeds 1 2 3] [--memory-configs NAME ...] [--iters 200] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_common import free_port, write_result

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
HOST = ["model.engram_table_placement=host"]
CONFIGS = {
    "fp32": [],
    "bf16_4byte": ["model.engram_table_dtype=bf16", "model.engram_optimizer=rowwise_adam",
                   "model.engram_master_weights=false", "model.engram_optimizer_state_dtype=bf16"],
    "fp8_frozen": ["model.engram_table_dtype=fp8_e4m3", "+model.engram_freeze_tables=true"],
    "fp8_trained": ["model.engram_table_dtype=fp8_e4m3", "model.engram_optimizer=rowwise_adam",
                    "model.engram_master_weights=false", "model.engram_optimizer_state_dtype=bf16"],
}
# the same with rows of 32 values (4 heads of 16 -> 2 heads of 32 per n-gram order): one E8M0
# byte per 32 values, one bf16 second moment per 32
WIDE = ["model.n_head_per_ngram=2"]
CONFIGS.update(fp8_frozen_d32=CONFIGS["fp8_frozen"] + WIDE,
               fp8_trained_d32=CONFIGS["fp8_trained"] + WIDE)
X1_VOCAB = 20011  # the demo preset's engram_vocab_size per order
SEQ, MICRO, NUM_MICRO = 128, 2, 4


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def compose(vocab: int, overrides: list[str]):
    from hydra import compose as hydra_compose, initialize_config_dir

    from engram_train.config import register

    register()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return hydra_compose(config_name="train", overrides=[
            "model=deepseek_v3_tiny", f"model.engram_vocab_size=[{vocab},{vocab}]", *overrides])


def build(vocab: int, lm_vocab: int, overrides: list[str]):
    """(model chunks, optimizer, hash mapping, table parameters, accounting bytes/param)."""
    from megatron.core.optimizer import OptimizerConfig

    from engram_train.engram.ngram_hash import NgramHashMapping
    from engram_train.models.builder import build_model
    from engram_train.models.table_params import engram_table_params
    from engram_train.training.optimizer import build_optimizer
    from engram_train.training.run_config import (
        build_transformer_config,
        engram_table_bytes_per_param,
    )

    config = build_transformer_config(compose(vocab, overrides))
    model = build_model(config, lm_vocab, SEQ)
    optimizer = build_optimizer(OptimizerConfig(optimizer="adam", lr=3e-3, clip_grad=1.0),
                                model, config)
    tables = optimizer.chained_optimizers[-1]
    tables._init_state(tables.optimizer)
    for param in tables.main_params:  # the state as after a long run: every page touched
        for value in tables.optimizer.state[param].values():
            value.zero_()
    num_params = sum(p.numel() for p in engram_table_params(model))
    accounting = engram_table_bytes_per_param(config)
    return model, optimizer, NgramHashMapping(config), num_params, accounting


def train(setup, steps: int, lm_vocab: int) -> list[float]:
    import torch

    from engram_train.training.step import train_step

    model, optimizer, mapping = setup[:3]
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        batches = []
        for _ in range(NUM_MICRO):
            tokens = torch.randint(0, lm_vocab, (MICRO, SEQ + 1), generator=generator)
            batch = dict(tokens=tokens[:, :-1].contiguous(), labels=tokens[:, 1:].contiguous(),
                         loss_mask=torch.ones(MICRO, SEQ),
                         position_ids=torch.arange(SEQ).expand(MICRO, SEQ).contiguous())
            batches.append(dict(batch, engram_hash_ids=mapping.hash_stacked(batch["tokens"])))
        losses.append(train_step(model, optimizer, batches, SEQ, MICRO).lm_loss)
    optimizer.chained_optimizers[-1].finish_update()
    return losses


def measure_one(name: str, params: float, steps: int) -> dict:
    """Run in a child process: one configuration's bytes per table parameter."""
    import math

    import torch

    from engram_train.data import load_tokenizer
    from engram_train.logs import quiet_known_warnings
    from engram_train.runtime import ParallelSizes, initialize_distributed
    from engram_train.training.run_config import padded_vocab_size

    torch.set_num_threads(1)
    quiet_known_warnings()
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("RANK", "0")
    initialize_distributed(ParallelSizes(), seed=1)
    overrides = HOST + CONFIGS[name]
    lm_vocab = padded_vocab_size(
        load_tokenizer(compose(X1_VOCAB, overrides).data.tokenizer).vocab_size, 1)
    small = build(X1_VOCAB, lm_vocab, overrides)
    train(small, 1, lm_vocab)
    big_vocab = math.ceil(1.01 * params / (small[3] / X1_VOCAB))
    before = rss_bytes()
    start = time.perf_counter()
    big = build(big_vocab, lm_vocab, overrides)
    built = rss_bytes()
    build_s = time.perf_counter() - start
    losses = train(big, steps, lm_vocab)
    after = rss_bytes()
    return dict(table_params=big[3], engram_vocab_size=big_vocab, build_s=build_s,
                bytes_per_table_param_built=(built - before) / big[3],
                bytes_per_table_param=(after - before) / big[3],
                bytes_per_table_param_accounting=big[4], losses=losses,
                rss_gib=after / 2**30)


def memory(args) -> None:
    path = args.out or RESULTS / "bench_fp8_tables.json"
    previous = json.loads(path.read_text()) if path.exists() else {}
    out = previous.get("configs", {}) if previous.get("params") == args.params else {}
    for name in args.memory_configs:
        with tempfile.TemporaryDirectory() as folder:
            one = Path(folder) / "one.json"
            cmd = [sys.executable, __file__, "one", name, "--params", str(args.params),
                   "--steps", str(args.steps), "--out", str(one)]
            env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(free_port()))
            subprocess.run(cmd, check=True, env=env, cwd=REPO)
            out[name] = json.loads(one.read_text())
        row = out[name]
        print(f"{name:12s} {row['table_params']:,} table params: "
              f"{row['bytes_per_table_param']:.3f} B/param by RSS "
              f"(after build {row['bytes_per_table_param_built']:.3f}; accounting "
              f"{row['bytes_per_table_param_accounting']:.4f})", flush=True)
    write_result(path, dict(params=args.params, steps=args.steps, placement="host",
                            row_width=dict(default=16, d32=32), configs=out))


def trainer_records(name: str, seed: int, iters: int, *extra: str) -> list[dict]:
    """The metrics records of one demo trainer run of configuration ``name``."""
    with tempfile.TemporaryDirectory() as exp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1",
               f"--master-port={free_port()}", "-m", "engram_train.train",
               f"experiment.exp_dir={exp}", f"train.seed={seed}", f"train.train_iters={iters}",
               *extra, *HOST, *CONFIGS[name]]
        subprocess.run(cmd, check=True, cwd=REPO, capture_output=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
        return [json.loads(line) for line in
                Path(exp, "metrics.jsonl").read_text().splitlines() if line.strip()]


def timing(args) -> None:
    """Per-step host table update and step time, ``bf16_4byte`` against ``fp8_trained``, in
    interleaved runs of ``--iters`` (every iteration logged; the first 5 dropped)."""
    names = ["bf16_4byte", "fp8_trained"]
    samples: dict[str, dict[str, list[float]]] = {n: {"update": [], "step": []} for n in names}
    for _ in range(args.rounds):
        for name in names:
            records = trainer_records(name, 1, args.iters, "train.eval_interval=null",
                                      "train.log_interval=1")
            kept = [r for r in records if "lm_loss" in r][5:]
            samples[name]["update"] += [r["engram_host_update_s"] for r in kept]
            samples[name]["step"] += [r["step_time_s"] for r in kept]
    out = {n: dict(update_ms_median=1000 * statistics.median(v["update"]),
                   step_ms_median=1000 * statistics.median(v["step"]), steps=len(v["step"]))
           for n, v in samples.items()}
    for name, row in out.items():
        print(f"{name:12s} host update {row['update_ms_median']:.2f} ms/step, step "
              f"{row['step_ms_median']:.1f} ms (median of {row['steps']})", flush=True)
    write_result(args.out or RESULTS / "bench_fp8_tables_timing.json",
                 dict(iters=args.iters, rounds=args.rounds, placement="host", configs=out))


def quality(args) -> None:
    path = args.out or RESULTS / "bench_fp8_tables_quality.json"
    previous = json.loads(path.read_text()) if path.exists() else {}
    runs: dict[str, dict[int, float]] = {
        name: {int(seed): val for seed, val in v.items()}
        for name, v in previous.get("final_val_loss", {}).items()
        if previous.get("iters") == args.iters and name not in args.configs}
    for name in args.configs:
        for seed in args.seeds:
            start = time.perf_counter()
            records = trainer_records(name, seed, args.iters, f"train.eval_interval={args.iters}")
            val = [r["val_loss"] for r in records if r.get("val_loss") is not None][-1]
            runs.setdefault(name, {})[seed] = val
            print(f"{name:12s} seed {seed}: final validation loss {val:.4f} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
    summary = {name: dict(mean=statistics.mean(v.values()),
                          stdev=statistics.stdev(v.values()) if len(v) > 1 else 0.0)
               for name, v in runs.items()}
    base = runs.get("bf16_4byte", {})
    diff = {name: statistics.mean(v[s] - base[s] for s in v) for name, v in runs.items()
            if name != "bf16_4byte" and base and set(v) == set(base)}
    for name, d in diff.items():
        print(f"{name} - bf16_4byte, mean over seeds: {d:+.4f}")
    write_result(path, dict(iters=args.iters, seeds=args.seeds, placement="host",
                            final_val_loss=runs, summary=summary, mean_diff_vs_bf16_4byte=diff))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", nargs="?", default="memory",
                        choices=("memory", "quality", "timing", "one"))
    parser.add_argument("name", nargs="?", help="(one) the configuration to measure")
    parser.add_argument("--params", type=float, default=3e8, help="table parameters (memory)")
    parser.add_argument("--steps", type=int, default=3, help="training steps before the RSS")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--iters", type=int, default=200, help="trainer iterations (quality)")
    parser.add_argument("--configs", nargs="+", default=["bf16_4byte", "fp8_trained", "fp8_frozen"],
                        help="(quality) configurations to train")
    parser.add_argument("--memory-configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS),
                        help="(memory) configurations to measure; others kept from --out")
    parser.add_argument("--rounds", type=int, default=2, help="(timing) interleaved rounds")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.part == "one":
        args.out.write_text(json.dumps(measure_one(args.name, args.params, args.steps)))
    elif args.part == "memory":
        memory(args)
    elif args.part == "timing":
        timing(args)
    else:
        quality(args)


if __name__ == "__main__":
    main()

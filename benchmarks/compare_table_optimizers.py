"""Quality of the Engram table optimizers: the demo (``make demo``: deepseek_v3_tiny + Engram,
2 processes, 200 iterations) with ``model.engram_optimizer`` adam and sparse_adam, several
seeds (``train.seed``: backbone init and data order), runs interleaved. Reports the validation
loss at the last iteration per run, the per-optimizer mean and the paired differences.

    python benchmarks/compare_table_optimizers.py [--seeds 1234 1 2] [--out PATH.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_common import write_result

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "outputs" / "benchmarks" / "compare_table_optimizers.json"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[1234, 1, 2])
    p.add_argument("--optimizers", nargs="+", default=["adam", "sparse_adam"])
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p.parse_args(argv)


def final_val_loss(exp_dir: Path) -> float:
    records = [json.loads(line) for line in (exp_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "val_loss" in r][-1]["val_loss"]


def main(argv=None) -> dict:
    args = parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for opt in args.optimizers:
                exp = Path(tmp) / f"{opt}_{seed}"
                cmd = [sys.executable, "-m", "torch.distributed.run",
                       f"--nproc-per-node={args.nproc}", "-m", "engram_train.train",
                       f"experiment.exp_dir={exp}", f"train.seed={seed}",
                       f"train.train_iters={args.iters}", f"model.engram_optimizer={opt}"]
                env = dict(os.environ, OMP_NUM_THREADS="1")
                proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
                if proc.returncode != 0:
                    raise RuntimeError(f"{opt} seed {seed} failed:\n{proc.stderr[-3000:]}")
                loss = final_val_loss(exp)
                runs.append(dict(optimizer=opt, seed=seed, val_loss=loss))
                print(f"seed {seed:5d} {opt:>12}: validation loss {loss:.4f}", flush=True)
    summary = {}
    for opt in args.optimizers:
        losses = [r["val_loss"] for r in runs if r["optimizer"] == opt]
        summary[opt] = dict(mean=statistics.mean(losses),
                            stdev=statistics.stdev(losses) if len(losses) > 1 else 0.0)
        print(f"{opt:>12}: mean {summary[opt]['mean']:.4f} +- {summary[opt]['stdev']:.4f}")
    if set(args.optimizers) == {"adam", "sparse_adam"}:
        by = {(r["optimizer"], r["seed"]): r["val_loss"] for r in runs}
        diffs = [by["sparse_adam", s] - by["adam", s] for s in args.seeds]
        summary["sparse_minus_adam"] = dict(per_seed=diffs, mean=statistics.mean(diffs))
        print(f"sparse_adam - adam per seed: {[round(d, 4) for d in diffs]}")
    result = dict(benchmark="compare_table_optimizers", iters=args.iters, nproc=args.nproc,
                  runs=runs, summary=summary)
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()

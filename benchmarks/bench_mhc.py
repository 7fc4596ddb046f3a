"""What the mHC backbone (n = 4 residual streams) costs and gives, on the demo (``make demo``:
deepseek_v3_tiny, 2 CPU processes, DP2).

Timing (default): trainer step time with and without mHC, each with and without Engram, the
four runs interleaved in every round (machine drift hits them alike); medians over the logged
iterations after ``--warmup``, and peak RSS. Then where the time goes: the mappings of one
sublayer (normalized projection, Sinkhorn, collapse, write-back) timed in one process at the
demo's shapes, forward + backward, times the number of sublayers a step runs.
Quality (``--quality``): the demo with Engram, single-stream vs mHC, ``--seeds`` seeds,
validation loss at the last iteration (200).

    python benchmarks/bench_mhc.py [--rounds 3] [--iters 40] [--quality] [--out PATH.json]
        [--override model.hidden_size=256 ...]   (the same comparison on another model)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_common import free_port, write_result

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "outputs" / "benchmarks" / "bench_mhc.json"
MEM_RE = re.compile(r"mem \(GiB\) rss/max: ([\d.]+)/([\d.]+)")
VARIANTS = {  # name -> trainer overrides
    "plain": ["model.use_engram=false"],
    "mhc": ["model.use_engram=false", "model.enable_hyper_connections=true"],
    "engram": [],
    "engram_mhc": ["model.enable_hyper_connections=true"],
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=40, help="iterations per timed run")
    p.add_argument("--warmup", type=int, default=10, help="iterations left out of the median")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--quality", action="store_true", help="also the 200-iteration comparison")
    p.add_argument("--seeds", type=int, nargs="+", default=[1234, 1, 2])
    p.add_argument("--quality-iters", type=int, default=200)
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="a trainer override for every run, e.g. model.hidden_size=256")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p.parse_args(argv)


def run_trainer(overrides: list[str], iters: int, nproc: int, workdir: Path,
                eval_interval: int | None = None) -> dict:
    exp = workdir / f"run_{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={free_port()}", "-m", "engram_train.train",
           f"experiment.exp_dir={exp}", f"train.train_iters={iters}", "train.log_interval=1",
           f"train.eval_interval={eval_interval or iters}", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{overrides} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines()]
    peaks = [float(m.group(2)) for m in MEM_RE.finditer(proc.stdout)]
    return dict(steps={r["iteration"]: r["step_time_s"] for r in records if "step_time_s" in r},
                val_loss=[r["val_loss"] for r in records if "val_loss" in r][-1:] or [None],
                peak_rss_gib=max(peaks) if peaks else None)


def sublayer_breakdown(repeats: int = 30) -> dict:
    """One sublayer's mapping at the demo's shapes (s=128, b=2 per micro-batch, n=4, h=64),
    forward + backward, in milliseconds per call, by part."""
    from engram_train.models.hyper_connection import (
        HyperConnection,
        normalized_projection,
        sinkhorn,
    )

    torch.manual_seed(0)
    s, b, n, h = 128, 2, 4, 64
    hc = HyperConnection(h, n)
    x = torch.randn(s, b, n, h, requires_grad=True)
    y = torch.randn(s, b, h, requires_grad=True)

    def mapping():
        return normalized_projection(x.reshape(s, b, n * h), hc.fn, hc.norm_eps)

    def sink():
        logits = torch.randn(s, b, n, n, requires_grad=True)
        return sinkhorn(logits, hc.sinkhorn_iterations)

    def whole():
        u, h_post, c = hc(x)
        return hc.mix(x, y + u, h_post, c)

    def collapse_and_mix():
        w = torch.full((s, b, n), 1.0 / n, requires_grad=True)
        c = torch.eye(n).expand(s, b, n, n).clone().requires_grad_(True)
        u = torch.matmul(w.unsqueeze(-2), x).squeeze(-2)
        return hc.mix(x, y + u, w, c)

    timings = {}
    for name, fn in (("normalized_projection", mapping), ("sinkhorn", sink),
                     ("collapse_and_write_back", collapse_and_mix), ("whole_mapping", whole)):
        samples = []
        for i in range(repeats + 5):
            start = time.perf_counter()
            fn().sum().backward()
            if i >= 5:
                samples.append(time.perf_counter() - start)
        timings[name] = statistics.median(samples) * 1000
    return timings


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(1)
    steps = {name: [] for name in VARIANTS}
    round_medians = {name: [] for name in VARIANTS}
    rss = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for name, overrides in VARIANTS.items():
                got = run_trainer([*overrides, *args.override], args.iters, args.nproc,
                                  Path(tmp))
                timed = [t for it, t in got["steps"].items() if it > args.warmup]
                steps[name].extend(timed)
                round_medians[name].append(statistics.median(timed))
                rss[name].append(got["peak_rss_gib"])
                print(f"round {round_} {name:>10}: {statistics.median(timed) * 1000:7.1f} ms, "
                      f"peak rss {got['peak_rss_gib']:.2f} GiB", flush=True)
        timing = {name: dict(median_ms=statistics.median(v) * 1000, peak_rss_gib=max(rss[name]))
                  for name, v in steps.items()}
        # Ratios within each round (its four runs are minutes apart), then their median: a
        # round slowed by other load on the machine moves all of its runs alike.
        def round_ratio(a, b):
            return statistics.median(x / y for x, y in zip(round_medians[a], round_medians[b]))

        ratios = dict(mhc_vs_plain=round_ratio("mhc", "plain"),
                      engram_mhc_vs_engram=round_ratio("engram_mhc", "engram"),
                      engram_vs_plain=round_ratio("engram", "plain"),
                      engram_mhc_vs_plain=round_ratio("engram_mhc", "plain"))
        print("\n| variant | step (ms) | peak RSS (GiB) |\n| --- | --- | --- |")
        for name, t in timing.items():
            print(f"| {name} | {t['median_ms']:.1f} | {t['peak_rss_gib']:.2f} |")
        print(f"mHC / no mHC (median of per-round ratios): {ratios['mhc_vs_plain']:.3f}x without "
              f"Engram, {ratios['engram_mhc_vs_engram']:.3f}x with Engram")

        breakdown = sublayer_breakdown()
        # per step: 2 sublayers x 4 layers x micro-batches per rank (global 8 / (mbs 2 x DP2))
        calls = 2 * 4 * (8 // (2 * args.nproc))
        per_step = {k: v * calls for k, v in breakdown.items()}
        print(f"\nmapping per sublayer call (fwd+bwd, ms): "
              + ", ".join(f"{k} {v:.2f}" for k, v in breakdown.items()))
        print(f"x {calls} sublayer calls per step and rank: whole mapping "
              f"{per_step['whole_mapping']:.1f} ms of the "
              f"{timing['engram_mhc']['median_ms'] - timing['engram']['median_ms']:.1f} ms "
              "step difference (with Engram)")

        quality = None
        if args.quality:
            quality = []
            for seed in args.seeds:
                for name in ("engram", "engram_mhc"):
                    got = run_trainer([*VARIANTS[name], f"train.seed={seed}"],
                                      args.quality_iters, args.nproc, Path(tmp))
                    quality.append(dict(variant=name, seed=seed, val_loss=got["val_loss"][0]))
                    print(f"seed {seed:5d} {name:>10}: validation loss at "
                          f"{args.quality_iters} {got['val_loss'][0]:.4f}", flush=True)
            for name in ("engram", "engram_mhc"):
                losses = [q["val_loss"] for q in quality if q["variant"] == name]
                print(f"{name:>10}: mean {statistics.mean(losses):.4f} "
                      f"+- {statistics.stdev(losses) if len(losses) > 1 else 0.0:.4f}")
    result = dict(benchmark="bench_mhc", overrides=args.override, nproc=args.nproc,
                  iters=args.iters, warmup=args.warmup,
                  rounds=args.rounds, timing=timing, ratios=ratios,
                  round_medians_ms={k: [v * 1000 for v in vs] for k, vs in round_medians.items()},
                  sublayer_mapping_ms=breakdown, sublayer_calls_per_step=calls,
                  mapping_ms_per_step=per_step, quality=quality,
                  torch_threads=torch.get_num_threads())
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()

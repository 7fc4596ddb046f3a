"""Engram overhead (spec section 6): the trainer's step with Engram / without, same backbone and
batch, minus the Engram module's own compute; what remains (hashing, lookups, waits) is what
prefetch must hide.

Runs, interleaved round-robin on ``--nprocs`` (default 2 and 4) processes of the demo
(``torchrun -m engram_train.train``, data-parallel, eps = world size so the lookups cross
ranks): no Engram; Engram with ``model.engram_prefetch=false``; Engram with prefetch on. The
Engram module's own compute is timed in this process: forward + backward of one ``Engram``
branch on the demo shapes with its memory rows given (no lookup), times the Engram layers and
the micro-batches a rank runs per step. Per configuration: median step time, ratios, and the
lookup/hash/wait seconds per step the trainer logs (``engram_*`` in metrics.jsonl).

    python benchmarks/bench_engram_overhead.py [--nprocs 2 4] [--rounds 2] [--out PATH.json]

GPU machines: the same script runs unchanged (torchrun picks NCCL); pass ``--nprocs 1 8``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import write_result  # noqa: E402
from bench_table_scaling import run_trainer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "outputs" / "benchmarks" / "bench_engram_overhead.json"
GLOBAL_BATCH, MICRO_BATCH, SEQ, ENGRAM_LAYERS = 8, 2, 128, 2


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nprocs", type=int, nargs="+", default=[2, 4])
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p.parse_args(argv)


def module_compute_s(repeats: int = 50) -> float:
    """Median forward + backward of one Engram branch (demo shapes, rows already fetched)."""
    import torch

    from engram_train.config import EngramConfig
    from engram_train.engram.engram_module import Engram

    torch.set_num_threads(1)
    config = EngramConfig(use_engram=True, engram_vocab_size=[211, 223], max_ngram_size=3,
                          n_embed_per_ngram=64, n_head_per_ngram=4, engram_layer_ids=[1, 3],
                          engram_tokenizer_name_or_path=str(REPO / "examples/data/tokenizer"))
    engram = Engram(config, 64, 1)
    memory = torch.randn(SEQ, MICRO_BATCH, engram.memory_dim, requires_grad=True)
    hidden = torch.randn(SEQ, MICRO_BATCH, 64, requires_grad=True)
    times = []
    for i in range(repeats + 5):
        start = time.perf_counter()
        engram(hidden, memory=memory).sum().backward()
        if i >= 5:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def engram_seconds(exp_dir: Path, warmup: int) -> dict:
    path = exp_dir / "metrics.jsonl"
    if not path.exists():
        return {}
    records = [json.loads(line) for line in path.read_text().splitlines()]
    out = {}
    for key in ("engram_hash_s", "engram_lookup_s", "engram_wait_s"):
        values = [r[key] for r in records if key in r and r["iteration"] > warmup]
        if values:
            out[key] = statistics.median(values)
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    configs = [("no_engram", ["model.use_engram=false"]),
               ("engram_blocking", ["model.engram_prefetch=false"]),
               ("engram_prefetch", ["model.engram_prefetch=true"])]
    per_rank_module = module_compute_s()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for nproc in args.nprocs:
            eps = [f"model.engram_embedding_parallel_size={nproc}"]
            samples = {name: [] for name, _ in configs}
            logged = {name: [] for name, _ in configs}
            for _ in range(args.rounds):
                for name, overrides in configs:
                    config = dict(name=name, overrides=overrides + (eps if name != "no_engram"
                                                                    else []))
                    got = run_trainer(config, args.iters, nproc, Path(tmp))
                    samples[name] += [t for it, t in got["steps"].items() if it > args.warmup]
                    logged[name].append(engram_seconds(got["exp_dir"], args.warmup))
            plain = statistics.median(samples["no_engram"])
            micro_per_rank = GLOBAL_BATCH // (MICRO_BATCH * nproc)
            module = per_rank_module * ENGRAM_LAYERS * micro_per_rank
            entry = dict(nproc=nproc, no_engram_s=plain, module_compute_s=module)
            for name in ("engram_blocking", "engram_prefetch"):
                step = statistics.median(samples[name])
                entry[name] = dict(
                    step_s=step, vs_no_engram=step / plain,
                    beyond_module_s=step - plain - module,
                    beyond_module_vs_no_engram=(step - plain - module) / plain,
                    logged={key: statistics.median(r[key] for r in logged[name] if key in r)
                            for key in logged[name][0]},
                )
            blocking = entry["engram_blocking"]["logged"].get("engram_lookup_s")
            prefetched = entry["engram_prefetch"]["logged"]
            if blocking:
                # engram_lookup_s is the lookup time on the critical path (starting lookups:
                # dedup, id routing, gathers; plus waiting for rows). The rows in flight are
                # the part prefetch can hide: ``rows_hidden_fraction``; ``hidden_fraction``
                # counts the starting part too, which still runs on the critical path.
                entry["hidden_fraction"] = 1 - prefetched["engram_lookup_s"] / blocking
                entry["rows_hidden_fraction"] = 1 - prefetched["engram_wait_s"] / blocking
            results.append(entry)
            print(f"\n{nproc} processes: no Engram {plain * 1000:.1f} ms/step, Engram module "
                  f"compute {module * 1000:.1f} ms/step/rank")
            for name in ("engram_blocking", "engram_prefetch"):
                e = entry[name]
                print(f"  {name:>16}: {e['step_s'] * 1000:7.1f} ms  ({e['vs_no_engram']:.2f}x), "
                      f"beyond the module {e['beyond_module_s'] * 1000:+.1f} ms "
                      f"({e['beyond_module_vs_no_engram'] * 100:+.1f}%), logged {e['logged']}")
            if "hidden_fraction" in entry:
                print(f"  lookup time on the critical path hidden by prefetch: "
                      f"{entry['hidden_fraction'] * 100:.1f}% (waiting for rows: "
                      f"{entry['rows_hidden_fraction'] * 100:.1f}%)")
    result = dict(benchmark="engram_overhead", machine=platform.processor() or platform.machine(),
                  cpus=os.cpu_count(), iters=args.iters, warmup=args.warmup, rounds=args.rounds,
                  module_compute_per_branch_s=per_rank_module, results=results)
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()

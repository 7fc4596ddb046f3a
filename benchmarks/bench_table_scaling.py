"""Table scaling (spec section 6): the trainer's step with Engram tables x1, x10, x50, same
model, batch and tokens, for ``model.engram_optimizer`` adam and sparse_adam, plus the same
model without Engram as the floor. The ideal is flat: a step pays for the rows its tokens touch.

Every configuration is a real ``torchrun -m engram_train.train`` job (default 2 processes, DP2,
replicated tables: eps 1) on the demo corpus; the configurations run round-robin (``--rounds``)
so that they share the machine's load, and the step time of a configuration is the median of
its logged iterations after ``--warmup``. Peak RSS is rank 0's (``mem (GiB) rss/max``). Bytes per
table parameter = (peak RSS - the no-Engram run's peak RSS) / table parameters per rank.

``--placements device host`` adds ``model.engram_table_placement=host`` runs (tables and their
Adam state in host memory, rows gathered on the host; docs/host-tables.md), with their per-step
host gather and host update times from ``metrics.jsonl``.

Also reported: how much deduplication saves on the demo corpus (ids a lookup would request per
micro-batch vs distinct rows it fetches, and per step on one data-parallel rank).

    python benchmarks/bench_table_scaling.py [--rounds 2] [--iters 30] [--out PATH.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_common import free_port, write_result

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "outputs" / "benchmarks" / "bench_table_scaling.json"
BASE_VOCAB = 20011  # the demo preset's engram_vocab_size per n-gram order
STEP_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ .*elapsed time per iteration \(ms\): ([\d.]+)")
MEM_RE = re.compile(r"mem \(GiB\) rss/max: ([\d.]+)/([\d.]+)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scales", type=int, nargs="+", default=[1, 10, 50])
    p.add_argument("--optimizers", nargs="+", default=["sparse_adam", "adam"])
    p.add_argument("--placements", nargs="+", default=["device"], choices=["device", "host"])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--iters", type=int, default=30, help="iterations per run")
    p.add_argument("--warmup", type=int, default=10, help="iterations not timed")
    p.add_argument("--dense-iters", type=int, default=12,
                   help="iterations for dense adam at scales >= 10 (its steps are slow)")
    p.add_argument("--dense-warmup", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p.parse_args(argv)


def configurations(args) -> list[dict]:
    configs = [dict(name="no_engram", overrides=["model.use_engram=false"], scale=0,
                    optimizer=None)]
    for scale in args.scales:
        vocab = BASE_VOCAB * scale
        for opt in args.optimizers:
            for placement in args.placements:
                tag = "" if placement == "device" else "_host"
                configs.append(dict(
                    name=f"{opt}{tag}_x{scale}", scale=scale, optimizer=opt, placement=placement,
                    base=f"{opt}{tag}_x1",
                    overrides=[f"model.engram_vocab_size=[{vocab},{vocab}]",
                               f"model.engram_optimizer={opt}",
                               f"model.engram_table_placement={placement}"],
                ))
    return configs


def run_trainer(config: dict, iters: int, nproc: int, workdir: Path) -> dict:
    exp = workdir / f"{config['name']}_{time.monotonic_ns()}"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
        f"--master-port={free_port()}", "-m", "engram_train.train",
        f"experiment.exp_dir={exp}", f"train.train_iters={iters}", "train.log_interval=1",
        f"train.eval_interval={iters}", "train.eval_iters=1", *config["overrides"],
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{config['name']} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    steps = {int(m.group(1)): float(m.group(2)) / 1000 for m in STEP_RE.finditer(proc.stdout)}
    peaks = [float(m.group(2)) for m in MEM_RE.finditer(proc.stdout)]
    host = {}
    metrics = exp / "metrics.jsonl"
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            record = json.loads(line)
            if "engram_host_gather_s" in record:
                host.setdefault("gather_s", {})[record["iteration"]] = record["engram_host_gather_s"]
                host.setdefault("update_s", {})[record["iteration"]] = record["engram_host_update_s"]
    return dict(steps=steps, peak_rss_gib=max(peaks) if peaks else None, exp_dir=exp, host=host)


def table_params_per_rank(scale: int) -> int:
    """Rows x D of both Engram layers of the demo preset at ``scale`` (eps 1: every rank holds
    all rows)."""
    from engram_train.engram.ngram_hash import engram_head_vocab_sizes

    vocab = BASE_VOCAB * scale
    sizes = engram_head_vocab_sizes([vocab, vocab], 3, 4, [1, 3])
    head_dim = 64 // 4
    return sum(sum(sum(order) for order in layer) for layer in sizes.values()) * head_dim


def dedup_on_demo_corpus(micro_batch=2, seq=128, micro_batches_per_step=2, steps=50) -> dict:
    """ids requested vs distinct rows on the demo corpus (the demo's micro-batch shape and a
    DP2 rank's share of its global batch), over consecutive windows of the token stream."""
    import numpy as np
    import torch

    from engram_train.config import EngramConfig
    from engram_train.engram.ngram_hash import NgramHashMapping
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(REPO / "examples/data/demo_text_document"))
    tokens = np.concatenate([np.asarray(dataset[i]) for i in range(len(dataset))])
    config = EngramConfig(use_engram=True, engram_vocab_size=[BASE_VOCAB, BASE_VOCAB],
                          max_ngram_size=3, n_embed_per_ngram=64, n_head_per_ngram=4,
                          engram_layer_ids=[1, 3],
                          engram_tokenizer_name_or_path=str(REPO / "examples/data/tokenizer"))
    mapping = NgramHashMapping(config)
    per_micro, per_step = [], []
    window = micro_batch * seq
    for step in range(steps):
        start = step * window * micro_batches_per_step
        step_rows = {layer: [] for layer in config.engram_layer_ids}
        for m in range(micro_batches_per_step):
            lo = start + m * window
            ids = torch.from_numpy(tokens[lo: lo + window].astype(np.int64)).view(micro_batch, seq)
            hashed = mapping.hash(ids)
            for layer, h in hashed.items():
                offsets = torch.from_numpy(mapping.offsets[layer])
                rows = (torch.as_tensor(np.ascontiguousarray(h)) + offsets).flatten()
                per_micro.append(rows.numel() / torch.unique(rows).numel())
                step_rows[layer].append(rows)
        for rows in step_rows.values():
            rows = torch.cat(rows)
            per_step.append(rows.numel() / torch.unique(rows).numel())
    return dict(per_micro_batch=statistics.median(per_micro), per_step=statistics.median(per_step),
                micro_batch=[micro_batch, seq], micro_batches_per_step=micro_batches_per_step)


def main(argv=None) -> dict:
    args = parse_args(argv)
    configs = configurations(args)
    samples = {c["name"]: [] for c in configs}
    peaks = {c["name"]: [] for c in configs}
    host_times = {c["name"]: {"gather_s": [], "update_s": []} for c in configs}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for config in configs:
                dense_big = config["optimizer"] == "adam" and config["scale"] >= 10
                iters = args.dense_iters if dense_big else args.iters
                warmup = args.dense_warmup if dense_big else args.warmup
                got = run_trainer(config, iters, args.nproc, Path(tmp))
                timed = [t for it, t in got["steps"].items() if it > warmup]
                samples[config["name"]] += timed
                for key, per_iter in got["host"].items():
                    host_times[config["name"]][key] += [
                        t for it, t in per_iter.items() if it > warmup]
                peaks[config["name"]].append(got["peak_rss_gib"])
                print(f"round {round_} {config['name']:>18}: median step "
                      f"{statistics.median(timed) * 1000:8.1f} ms, peak rss "
                      f"{got['peak_rss_gib']:.2f} GiB", flush=True)
    floor = statistics.median(samples["no_engram"])
    floor_rss = max(peaks["no_engram"])
    rows = []
    for config in configs:
        name = config["name"]
        median = statistics.median(samples[name])
        entry = dict(name=name, scale=config["scale"], optimizer=config["optimizer"],
                     placement=config.get("placement"),
                     median_step_s=median, steps_timed=len(samples[name]),
                     vs_no_engram=median / floor, peak_rss_gib=max(peaks[name]))
        if config["scale"]:
            params = table_params_per_rank(config["scale"])
            base = statistics.median(samples[config["base"]])
            entry.update(table_params_per_rank=params, vs_x1=median / base,
                         bytes_per_table_param=(entry["peak_rss_gib"] - floor_rss) * 2**30 / params)
        for key, values in host_times[name].items():
            if values:
                entry[f"host_{key}"] = statistics.median(values)
        if config.get("placement") == "host" and config["scale"]:
            device = f"{config['optimizer']}_x{config['scale']}"
            if device in samples:
                entry["vs_device"] = median / statistics.median(samples[device])
        rows.append(entry)
    print("\n| config | table params / rank | median step (s) | vs x1 | vs no Engram | "
          "peak RSS (GiB) | bytes / table param |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for e in rows:
        print(f"| {e['name']} | {e.get('table_params_per_rank', 0) / 1e6:.1f} M | "
              f"{e['median_step_s']:.3f} | {e.get('vs_x1', float('nan')):.2f}x | "
              f"{e['vs_no_engram']:.2f}x | {e['peak_rss_gib']:.2f} | "
              f"{e.get('bytes_per_table_param', float('nan')):.1f} |")
    for e in rows:
        if "host_gather_s" in e:
            print(f"{e['name']}: host gather+copy {e['host_gather_s'] * 1000:.1f} ms/step, host "
                  f"update {e['host_update_s'] * 1000:.1f} ms/step, vs device placement "
                  f"{e.get('vs_device', float('nan')):.2f}x")
    dedup = dedup_on_demo_corpus()
    print(f"\ndedup on the demo corpus: {dedup['per_micro_batch']:.2f}x ids per distinct row "
          f"per micro-batch, {dedup['per_step']:.2f}x per step and DP rank")
    result = dict(
        benchmark="table_scaling", machine=platform.processor() or platform.machine(),
        cpus=os.cpu_count(), nproc=args.nproc, rounds=args.rounds, iters=args.iters,
        warmup=args.warmup, placements=args.placements, results=rows, dedup=dedup,
    )
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()

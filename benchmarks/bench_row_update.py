"""Per-step table work at x1 and x50 tables, interleaved step by step in one process.

The trainer-level comparison (``bench_table_scaling.py``) runs whole jobs one after the other; on
a shared machine whose speed drifts by 2x within minutes its ratios carry that drift. This
benchmark isolates what Engram does per step with a table, for the demo's shapes (two Engram
layers, 8 heads x 16 values per row, ~7.5k distinct rows touched per layer and step, a DP2 step
after the gradient sync), on tables of the demo size (x1) and 50 times larger, alternating the
two every step so that drift hits both alike:

- ``gather``: the lookup's read of the touched rows (``read_rows``, device or host placement);
- ``update``: ``RowSparseAdam.step_rows`` on those rows (moments and values).

Rows are drawn uniformly (hash addresses are uniform by design), so each touched row is a cache
and TLB miss once the table outgrows the caches: the remaining growth with table size is that
memory latency, not work proportional to the table (nothing here touches an untouched row).

    python benchmarks/bench_row_update.py [--steps 60] [--out PATH.json]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from bench_common import write_result

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "outputs" / "benchmarks" / "bench_row_update.json"
ROWS_X1 = 2 * 4 * 20011  # rows per Engram layer of the demo preset (2 orders x 4 heads)
DIM, LAYERS, TOUCHED = 16, 2, 7500


def build(scale: int, placement: str):
    from engram_train.engram.host_table import make_host_resident
    from engram_train.training.sparse_adam import RowSparseAdam

    tables = []
    for _ in range(LAYERS):
        table = torch.nn.Parameter(torch.randn(ROWS_X1 * scale, DIM) * 0.02)
        if placement == "host":
            make_host_resident(table)
        tables.append(table)
    optimizer = RowSparseAdam([{"params": tables}], lr=1e-3)
    for table in tables:  # dense moments, allocated and touched up front (as after step 1)
        optimizer.init_state(table)
    return tables, optimizer


def one_step(tables, optimizer, generator) -> tuple[float, float]:
    from engram_train.engram.row_grad import read_rows

    rows = [torch.unique(torch.randint(0, t.shape[0], (TOUCHED,), generator=generator))
            for t in tables]
    start = time.perf_counter()
    for table, r in zip(tables, rows):
        read_rows(table, r)
    gathered = time.perf_counter()
    grads = [(r, torch.randn(r.numel(), DIM, generator=generator)) for r in rows]
    updating = time.perf_counter()
    optimizer.step_rows(grads)
    done = time.perf_counter()
    return gathered - start, done - updating


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--scales", type=int, nargs="+", default=[1, 50])
    p.add_argument("--placements", nargs="+", default=["device", "host"])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    setups = {(s, pl): build(s, pl) for s in args.scales for pl in args.placements}
    times = {key: {"gather_s": [], "update_s": []} for key in setups}
    generator = torch.Generator().manual_seed(0)
    for step in range(args.steps + 5):
        for key, (tables, optimizer) in setups.items():  # interleaved: drift hits all alike
            gather, update = one_step(tables, optimizer, generator)
            if step >= 5:
                times[key]["gather_s"].append(gather)
                times[key]["update_s"].append(update)
    rows = []
    base = {pl: (args.scales[0], pl) for pl in args.placements}
    for (scale, placement), t in times.items():
        entry = dict(scale=scale, placement=placement, rows_per_table=ROWS_X1 * scale,
                     gather_ms=1000 * statistics.median(t["gather_s"]),
                     update_ms=1000 * statistics.median(t["update_s"]))
        rows.append(entry)
    for entry in rows:
        ref = next(e for e in rows if (e["scale"], e["placement"]) == base[entry["placement"]])
        entry["gather_vs_x1"] = entry["gather_ms"] / ref["gather_ms"]
        entry["update_vs_x1"] = entry["update_ms"] / ref["update_ms"]
    print(f"| placement | scale | rows / table | gather (ms) | vs x1 | update (ms) | vs x1 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for e in rows:
        print(f"| {e['placement']} | x{e['scale']} | {e['rows_per_table']:,} | {e['gather_ms']:.2f} "
              f"| {e['gather_vs_x1']:.2f}x | {e['update_ms']:.2f} | {e['update_vs_x1']:.2f}x |")
    result = dict(benchmark="row_update", steps=args.steps, touched_rows_per_table=TOUCHED,
                  layers=LAYERS, dim=DIM, results=rows)
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()

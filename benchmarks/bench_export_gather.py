"""Rows/s gathered from a memory-mapped export table vs the memory-bandwidth bound.

The table is a safetensors layer file written and mapped by the export code itself
(`SafetensorsWriter`, `MappedSafetensors`), gathered with
`engram_train.inference.gather_table_rows` (what `EngramMemory.lookup` runs), at uniformly
random rows (hash addresses are uniform).
The bound is what a copy of the same bytes would take: rows/s = copy bandwidth / row bytes, with
the copy bandwidth measured in the same run (a large contiguous `copy_`, same threads). Copies,
gathers from the map (`EngramMemory` default), from a resident huge-page copy
(`EngramMemory(tables="hugepages")`), and the two primitives the gather picks from by size
(torch's multi-threaded `index_select`, numpy's single-threaded `take`, both on the map) are
interleaved so they share the machine's load; every call draws new rows (rows read before sit
in the CPU cache). Medians are reported, with the best of the repeats next to them: on a
shared, busy host the fastest call is the one least disturbed by other processes. The first
gather on a fresh map is reported separately: it pays a page fault per touched page
(`EngramMemory.prefault` avoids that at start-up).

    python benchmarks/bench_export_gather.py [--rows 4194304 --dim 160 --dtype bf16]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from engram_train.export.safetensors_io import MappedSafetensors, SafetensorsWriter, TensorSpec
from engram_train.inference.memory import gather_table_rows, resident_table

REPO = Path(__file__).resolve().parents[1]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
NUMPY_VIEW = {torch.float32: torch.float32, torch.bfloat16: torch.int16}  # numpy has no bf16


def write_table(path: Path, rows: int, dim: int, dtype: torch.dtype) -> None:
    block = 1 << 16
    generator = torch.Generator().manual_seed(0)
    with SafetensorsWriter(path, [TensorSpec("table", dtype, (rows, dim))]) as writer:
        for start in range(0, rows, block):
            n = min(block, rows - start)
            with writer.region("table", (start, 0), (n, dim)) as view:
                view.copy_(torch.randn(n, dim, generator=generator))


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1 << 22, help="table rows")
    parser.add_argument("--dim", type=int, default=160,
                        help="row width D (engram_27b: n_embed_per_ngram 1280 / 8 heads)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--batches", default="1024,16384,262144",
                        help="rows per gather (64 sequences x 16 heads = 1024 per decode step)")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--copy-mib", type=int, default=256, help="bytes copied for bandwidth")
    parser.add_argument("--dir", default=None, help="where the table file goes (default: tmp)")
    parser.add_argument("--out", default=str(REPO / "outputs" / "benchmarks" /
                                             "bench_export_gather.json"))
    args = parser.parse_args(argv)
    dtype = DTYPES[args.dtype]
    batches = [int(b) for b in args.batches.split(",")]
    load_before = os.getloadavg()

    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        path = Path(folder) / "engram_layer0.safetensors"
        write_table(path, args.rows, args.dim, dtype)
        table = MappedSafetensors(path).tensor("table")
        row_bytes = args.dim * table.element_size()
        generator = torch.Generator().manual_seed(1)

        # First gather on a fresh map: page faults on every touched page.
        first_rows = torch.randint(0, args.rows, (batches[-1],), generator=generator)
        first_s = timed(lambda: gather_table_rows(table, first_rows))
        flat = table.view(-1)
        flat[:: max(1, 4096 // table.element_size())].sum()  # prefault the rest

        src = torch.empty(args.copy_mib * 2**20, dtype=torch.uint8).fill_(1)
        dst = torch.empty_like(src)
        numpy_table = table.view(NUMPY_VIEW[dtype]).numpy()
        resident, _buffer = resident_table(table)  # EngramMemory(tables="hugepages")
        candidates = {
            "gather": lambda rows, out: gather_table_rows(table, rows, out),
            "hugepages": lambda rows, out: gather_table_rows(resident, rows, out),
            "torch_index_select": lambda rows, out: torch.index_select(table, 0, rows, out=out),
            "numpy_take": lambda rows, out: np.take(numpy_table, rows.numpy(), axis=0),
        }
        results = []
        for batch in batches:
            out = torch.empty(batch, args.dim, dtype=dtype)
            check = torch.randint(0, args.rows, (batch,), generator=generator)
            assert torch.equal(gather_table_rows(table, check, out), resident[check])
            times = {name: [] for name in ["copy", *candidates]}
            for _ in range(args.repeats):  # interleaved: all candidates see the same load
                times["copy"].append(timed(lambda: dst.copy_(src)))
                for name, gather in candidates.items():
                    # Fresh rows for every call: rows read before would be in the CPU cache.
                    rows = torch.randint(0, args.rows, (batch,), generator=generator)
                    times[name].append(timed(lambda: gather(rows, out)))
            median = {k: statistics.median(v) for k, v in times.items()}
            best = {k: min(v) for k, v in times.items()}  # least disturbed call: a busy host
            copy_bw = src.numel() / median["copy"]
            bound = copy_bw / row_bytes
            rate = {name: batch / median[name] for name in candidates}
            best_bound = src.numel() / best["copy"] / row_bytes
            results.append({
                "rows_per_gather": batch,
                "gather_median_s": median["gather"],
                "rows_per_s": rate["gather"],
                "gathered_GB_per_s": rate["gather"] * row_bytes / 1e9,
                "copy_bandwidth_GB_per_s": copy_bw / 1e9,
                "bound_rows_per_s": bound,
                "fraction_of_bound": rate["gather"] / bound,
                "hugepages_rows_per_s": rate["hugepages"],
                "hugepages_fraction_of_bound": rate["hugepages"] / bound,
                "torch_index_select_rows_per_s": rate["torch_index_select"],
                "numpy_take_rows_per_s": rate["numpy_take"],
                "best_of_repeats": {
                    "copy_bandwidth_GB_per_s": src.numel() / best["copy"] / 1e9,
                    "bound_rows_per_s": best_bound,
                    **{f"{name}_rows_per_s": batch / best[name] for name in candidates},
                },
            })
            print(f"{batch:>8} rows/gather: map {rate['gather'] / 1e6:6.2f} M rows/s "
                  f"({100 * rate['gather'] / bound:4.1f}% of bound) | huge pages "
                  f"{rate['hugepages'] / 1e6:6.2f} M rows/s "
                  f"({100 * rate['hugepages'] / bound:4.1f}%) | bound {bound / 1e6:6.2f} M rows/s (copy {copy_bw / 1e9:.2f} GB/s) | "
                  f"index_select {rate['torch_index_select'] / 1e6:.2f}, take "
                  f"{rate['numpy_take'] / 1e6:.2f}")
            print(f"{'':>8} best of {args.repeats}: map "
                  f"{batch / best['gather'] / 1e6:6.2f}, huge pages "
                  f"{batch / best['hugepages'] / 1e6:6.2f}, bound {best_bound / 1e6:6.2f} M rows/s")
        print(f"first gather on a fresh map ({batches[-1]} rows): "
              f"{batches[-1] / first_s / 1e6:.2f} M rows/s")

    report = {
        "benchmark": "bench_export_gather",
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "torch": torch.__version__,
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "thp": Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
        if Path("/sys/kernel/mm/transparent_hugepage/enabled").exists() else None,
        "table": {"rows": args.rows, "dim": args.dim, "dtype": args.dtype,
                  "row_bytes": row_bytes, "bytes": args.rows * row_bytes},
        "repeats": args.repeats,
        "results": results,
        "first_gather_fresh_map": {"rows": batches[-1], "seconds": first_s,
                                   "rows_per_s": batches[-1] / first_s},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()

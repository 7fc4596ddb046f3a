"""The sweep's result: one JSON (every run, and a per-variant summary) and three figures.

- `allocation_loss_vs_rho.png`: final validation loss against rho, every seed and the median
  (the U curve; rho 0 is the pure MoE), controls drawn at their rho;
- `allocation_throughput.png`: training tokens/s relative to the pure MoE of the same seed;
- `allocation_loss_curves.png`: training and validation loss of every variant against tokens.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

FIGURES = ("allocation_loss_vs_rho.png", "allocation_throughput.png",
           "allocation_loss_curves.png")


def _spread(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def summarize_runs(runs: Sequence[dict]) -> list[dict]:
    """Per variant: validation loss over seeds, and throughput relative to the pure MoE run of
    the same seed (runs of one seed were interleaved, so they saw the same machine load)."""
    moe_tps = {r["seed"]: r["tokens_per_s"] for r in runs if r["variant"] == "moe"}
    moe_best = {r["seed"]: r.get("tokens_per_s_best") for r in runs if r["variant"] == "moe"}
    by_variant: dict[str, list[dict]] = defaultdict(list)
    for r in runs:
        by_variant[r["variant"]].append(r)
    rows = []
    for name, rs in by_variant.items():
        ratios = [r["tokens_per_s"] / moe_tps[r["seed"]] for r in rs
                  if r["seed"] in moe_tps and r["tokens_per_s"]]
        best = [r["tokens_per_s_best"] / moe_best[r["seed"]] for r in rs
                if moe_best.get(r["seed"]) and r.get("tokens_per_s_best")]
        rows.append({
            "variant": name, "rho": rs[0]["rho"], "control": rs[0].get("control"),
            "total_params": rs[0]["total_params"], "active_params": rs[0]["active_params"],
            "seeds": sorted(r["seed"] for r in rs),
            "val_loss": _spread([r["val_loss"] for r in rs if r["val_loss"] is not None]),
            "tokens_per_s": _spread([r["tokens_per_s"] for r in rs if r["tokens_per_s"]]),
            "throughput_vs_moe": _spread(ratios),
            "best_throughput_vs_moe": _spread(best),
        })
    return rows


def write_json(path: Path, meta: dict, runs: Sequence[dict]) -> dict:
    report = {**meta, "runs": list(runs), "summary": summarize_runs(runs)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    tmp.replace(path)
    return report


def markdown_table(report: dict) -> str:
    """The summary as a Markdown table (printed at the end of a sweep, quoted in the docs)."""
    def spread(v, fmt):
        return "-" if v is None else (f"{v['median']:{fmt}} ({v['min']:{fmt}} - {v['max']:{fmt}})")

    lines = ["| variant | total | activated | validation loss, median (range) | tokens/s vs MoE "
             "| best interval vs MoE |", "| --- | --- | --- | --- | --- | --- |"]
    for row in report["summary"]:
        lines.append(f"| `{row['variant']}` | {row['total_params']:,} | {row['active_params']:,} "
                     f"| {spread(row['val_loss'], '.4f')} "
                     f"| {spread(row['throughput_vs_moe'], '.2f')} "
                     f"| {spread(row.get('best_throughput_vs_moe'), '.2f')} |")
    return "\n".join(lines)


def _style(row: dict) -> tuple[str, str]:
    return {"one_row": ("s", "tab:red"), "frozen": ("^", "tab:purple")}.get(
        row.get("control"), ("o", "tab:blue"))


def plot_loss_vs_rho(report: dict, path: Path, plt) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    line = []
    for row in report["summary"]:
        if row["val_loss"] is None:
            continue
        x = row["rho"] or 0.0
        marker, color = _style(row)
        seeds = [r["val_loss"] for r in report["runs"]
                 if r["variant"] == row["variant"] and r["val_loss"] is not None]
        ax.scatter([x] * len(seeds), seeds, marker=marker, color=color, alpha=0.35, s=18)
        v = row["val_loss"]
        ax.errorbar([x], [v["median"]], yerr=[[v["median"] - v["min"]], [v["max"] - v["median"]]],
                    fmt=marker, color=color, capsize=3,
                    label=row["variant"] if row.get("control") else None)
        if not row.get("control"):
            line.append((x, v["median"]))
    line.sort()
    ax.plot(*zip(*line), color="tab:blue", label="MoE (rho 0) and Engram: median, seed range")
    ax.set_xlabel("rho: share of the routed-expert parameters given to Engram")
    ax.set_ylabel("validation loss (held-out files)")
    ax.set_title("Same total parameters: experts vs Engram")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_throughput(report: dict, path: Path, plt) -> None:
    rows = [r for r in report["summary"] if r["throughput_vs_moe"]]
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    names = [r["variant"] for r in rows]
    for k, (key, label, shift) in enumerate((
            ("throughput_vs_moe", "median interval", -0.2),
            ("best_throughput_vs_moe", "best interval", 0.2))):
        have = [(i, r[key]) for i, r in enumerate(rows) if r.get(key)]
        if not have:
            continue
        med = [v["median"] for _, v in have]
        err = [[m - v["min"] for m, (_, v) in zip(med, have)],
               [v["max"] - m for m, (_, v) in zip(med, have)]]
        ax.bar([i + shift for i, _ in have], med, width=0.4, yerr=err, capsize=3,
               color="tab:gray" if k else "tab:blue", label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.legend(fontsize=8)
    ax.set_xticks(range(len(rows)), names, rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("training tokens/s relative to MoE (same seed)")
    ax.set_title("Throughput (median over seeds, range)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_curves(report: dict, path: Path, plt) -> None:
    fig, (ax_t, ax_v) = plt.subplots(1, 2, figsize=(10, 4))
    tokens_per_iter = report["schedule"]["global_batch_size"] * report["schedule"]["seq_length"]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, row in enumerate(report["summary"]):
        color = colors[i % len(colors)]
        for j, r in enumerate(x for x in report["runs"] if x["variant"] == row["variant"]):
            label = row["variant"] if j == 0 else None
            if r["train_curve"]:
                it, loss = zip(*r["train_curve"])
                ax_t.plot([k * tokens_per_iter for k in it], loss, color=color, lw=0.9,
                          alpha=0.8, label=label)
            if r["val_curve"]:
                it, loss = zip(*r["val_curve"])
                ax_v.plot([k * tokens_per_iter for k in it], loss, "o-", color=color, lw=0.9,
                          ms=3, alpha=0.8, label=label)
    for ax, what in ((ax_t, "training loss"), (ax_v, "validation loss")):
        ax.set_xlabel("tokens")
        ax.set_ylabel(what)
    ax_t.legend(fontsize=7)
    fig.suptitle("Every variant and seed")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_figures(report: dict, out_dir: Path, prefix: str = "") -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = [out_dir / f"{prefix}{name}" for name in FIGURES]
    for fn, p in zip((plot_loss_vs_rho, plot_throughput, plot_curves), paths):
        fn(report, p, plt)
    return paths

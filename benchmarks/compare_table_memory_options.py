"""Does the 4-byte table configuration cost quality? The committed allocation sweep's rho 0.4
Engram model (docs/allocation-sweep.md: 4M parameters, code corpus, 150 iterations) trained by
``engram-sweep`` with three table options, the same seeds and tokens:

  (a) fp32      fp32 tables, ``sparse_adam`` (12 bytes per table parameter; the default)
  (b) rowwise   fp32 tables, ``rowwise_adam`` (8 bytes)
  (c) 4byte     bf16 tables, ``rowwise_adam``, no float32 master, bf16 per-element moment
                (4 bytes)

Reports each option's validation loss (median and range over seeds), the paired difference to
(a) per seed, and writes the JSON and a plot.

    python scripts/build_code_corpus.py          # once: corpora/code
    python benchmarks/compare_table_memory_options.py [--seeds 1,2,3] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from bench_common import write_result

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "outputs" / "benchmarks" / "table_memory_options"
RESULT = REPO / "benchmarks" / "results" / "table_memory_options.json"
VARIANT = "engram_rho0.4"

# The committed sweep's command (docs/allocation-sweep.md, "Result").
SWEEP = ["--corpus", "corpora/code", "--total-params", "4M", "--train-iters", "150",
         "--global-batch-size", "16", "--seq-length", "256", "--eval-interval", "50",
         "--eval-iters", "16", "--variants", VARIANT]
MODEL = ["model.hidden_size=128", "model.ffn_hidden_size=384", "model.num_attention_heads=4",
         "model.q_lora_rank=64", "model.kv_lora_rank=64", "model.qk_head_dim=32",
         "model.qk_pos_emb_head_dim=16", "model.v_head_dim=32", "model.moe_ffn_hidden_size=96",
         "model.moe_shared_expert_intermediate_size=96", "model.moe_router_topk=2",
         "model.n_embed_per_ngram=64", "model.n_head_per_ngram=4"]
OPTIONS = {
    "fp32": ["model.engram_optimizer=sparse_adam"],
    "rowwise": ["model.engram_optimizer=rowwise_adam"],
    "4byte": ["model.engram_table_dtype=bf16", "model.engram_optimizer=rowwise_adam",
              "model.engram_master_weights=false", "model.engram_optimizer_state_dtype=bf16"],
}
BYTES_PER_PARAM = {"fp32": 12, "rowwise": 8, "4byte": 4}  # value + moments (+ master), nominal


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="1,2,3", help="comma-separated train seeds")
    p.add_argument("--options", default=",".join(OPTIONS), help="comma-separated: " + ", ".join(OPTIONS))
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the sweeps' folders")
    p.add_argument("--result", type=Path, default=RESULT, help="the JSON summary")
    p.add_argument("--reuse", action="store_true", help="summarize finished sweeps without training")
    return p.parse_args(argv)


def run_sweep(option: str, seeds: str, out: Path) -> None:
    cmd = [sys.executable, "-m", "engram_train.sweep", *SWEEP, "--seeds", seeds,
           "--out", str(out), *MODEL, *OPTIONS[option]]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), check=True)


def summarize(options: list[str], out: Path) -> dict:
    per_option = {}
    for option in options:
        data = json.loads((out / option / "allocation_sweep.json").read_text())
        runs = sorted((r for r in data["runs"] if r["variant"] == VARIANT), key=lambda r: r["seed"])
        losses = {r["seed"]: r["val_loss"] for r in runs}
        per_option[option] = dict(
            overrides=OPTIONS[option], bytes_per_table_param=BYTES_PER_PARAM[option],
            val_loss=losses, median=statistics.median(losses.values()),
            min=min(losses.values()), max=max(losses.values()),
            tokens_per_s_median=statistics.median(r["tokens_per_s"] for r in runs),
            curves={r["seed"]: r.get("val_curve") or r.get("train_curve") for r in runs})
    base = per_option.get("fp32")
    for option, row in per_option.items():
        if base is None or option == "fp32":
            continue
        paired = [row["val_loss"][s] - base["val_loss"][s] for s in row["val_loss"] if s in base["val_loss"]]
        row["minus_fp32_per_seed"] = paired
        row["median_vs_fp32"] = row["median"] / base["median"] - 1.0
    return dict(benchmark="table_memory_options", variant=VARIANT, sweep=SWEEP, model=MODEL,
                options=per_option)


def plot(result: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    names = list(result["options"])
    for i, name in enumerate(names):
        losses = list(result["options"][name]["val_loss"].values())
        ax.scatter([i] * len(losses), losses, alpha=0.6)
        ax.plot([i - 0.2, i + 0.2], [result["options"][name]["median"]] * 2, color="black")
    ax.set_xticks(range(len(names)),
                  [f"{n}\n{result['options'][n]['bytes_per_table_param']} B/param" for n in names])
    ax.set_ylabel("validation loss (150 iterations)")
    ax.set_title(f"{result['variant']}: table options, one point per seed")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    print(f"written {png}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    options = [o for o in args.options.split(",") if o]
    unknown = [o for o in options if o not in OPTIONS]
    if unknown:
        raise SystemExit(f"--options: unknown {unknown}; choose from {list(OPTIONS)}")
    if not args.reuse:
        for option in options:
            run_sweep(option, args.seeds, args.out / option)
    result = summarize(options, args.out)
    for name, row in result["options"].items():
        extra = f"  median {100 * row['median_vs_fp32']:+.2f}% vs fp32" if "median_vs_fp32" in row else ""
        print(f"{name:>8} ({row['bytes_per_table_param']:2d} B/param): validation loss median "
              f"{row['median']:.4f} [{row['min']:.4f}, {row['max']:.4f}]{extra}")
    write_result(args.result, result)
    plot(result, args.result.with_suffix(".png"))
    return result


if __name__ == "__main__":
    main()

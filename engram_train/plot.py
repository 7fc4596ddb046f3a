"""engram-plot: loss curves of one or several runs in one PNG.

Each run is a run folder holding ``metrics.jsonl`` (as written by
`engram_train.metrics.MetricsWriter`) or the path of such a file. The train loss is drawn as a
line and the validation loss as markers in the run's colour; runs are labelled by their folder
names. When an iteration appears more than once (a resumed run), its last record wins.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

from engram_train.errors import EngramError

METRICS_FILE = "metrics.jsonl"


class PlotError(EngramError, ValueError):
    """Nothing to plot, or a metrics file that cannot be read; the message names it."""


class MetricsNotFoundError(PlotError, FileNotFoundError):
    """No ``metrics.jsonl`` where a run was named."""


def _metrics_file(path: str | os.PathLike) -> Path:
    p = Path(path)
    file = p / METRICS_FILE if p.is_dir() else p
    if not file.is_file():
        raise MetricsNotFoundError(f"no {METRICS_FILE} at '{path}': give a run folder or the file")
    return file


def load_metrics(path: str | os.PathLike) -> dict[str, tuple[list[int], list[float]]]:
    """``{"train": (iterations, lm_loss), "val": (iterations, val_loss)}`` of one run."""
    by_iter: dict[int, dict] = {}
    file = _metrics_file(path)
    lines = file.read_text(encoding="utf-8").splitlines()
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if lineno == len(lines):
                continue  # a line cut short by a run that is still writing
            raise PlotError(f"{file}:{lineno}: not valid JSON") from None
        by_iter.setdefault(int(rec["iteration"]), {}).update(rec)
    out = {}
    for name, key in (("train", "lm_loss"), ("val", "val_loss")):
        pts = [(i, r[key]) for i, r in sorted(by_iter.items()) if r.get(key) is not None]
        out[name] = ([i for i, _ in pts], [float(v) for _, v in pts])
    return out


def smooth_ema(values: list[float], weight: float) -> list[float]:
    """TensorBoard-style debiased exponential moving average; `weight` in [0, 1)."""
    if not 0.0 <= weight < 1.0:
        raise PlotError(f"smoothing weight must be in [0, 1), got {weight}")
    out, avg, norm = [], 0.0, 0.0
    for v in values:
        avg = weight * avg + (1.0 - weight) * v
        norm = weight * norm + (1.0 - weight)
        out.append(avg / norm)
    return out


def run_labels(paths: list[str | os.PathLike]) -> list[str]:
    """The run folder names, with parent folders added until they are unique."""
    dirs = [_metrics_file(p).resolve().parent for p in paths]
    depth = 1
    while True:
        labels = ["/".join(d.parts[-depth:]) for d in dirs]
        if len(set(labels)) == len(labels) or depth >= max(len(d.parts) for d in dirs):
            return labels
        depth += 1


def plot_runs(
    paths: list[str | os.PathLike] | str | os.PathLike,
    out: str | os.PathLike,
    *,
    smooth: float = 0.0,
    title: str | None = None,
    logy: bool = False,
) -> Path:
    """Draw the loss curves of `paths` (run folders or metrics.jsonl files) into PNG `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if not paths:
        raise PlotError("no run to plot")
    labels = run_labels(paths)
    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=120)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    drawn = 0
    for k, (path, label) in enumerate(zip(paths, labels)):
        m = load_metrics(path)
        color = colors[k % len(colors)]
        iters, loss = m["train"]
        if iters:
            if smooth > 0:
                ax.plot(iters, loss, color=color, alpha=0.25, linewidth=0.8)
                loss = smooth_ema(loss, smooth)
            ax.plot(iters, loss, color=color, linewidth=1.5, label=f"{label} train")
            drawn += 1
        v_iters, v_loss = m["val"]
        if v_iters:
            ax.plot(v_iters, v_loss, "o--", color=color, markersize=5, linewidth=0.8,
                    markeredgecolor="black", markeredgewidth=0.5, label=f"{label} val")  # fmt: skip
            drawn += 1
    if not drawn:
        plt.close(fig)
        raise PlotError(f"no lm_loss or val_loss values in {', '.join(map(str, paths))}")
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss" + (" (log scale)" if logy else ""))
    if logy:
        ax.set_yscale("log")
    ax.set_title(title or ("loss" + (f" (EMA smoothing {smooth:g})" if smooth > 0 else "")))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    out = Path(out)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:  # written beside the target and renamed: a failed write leaves an earlier plot whole
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(tmp, format="png")
        os.replace(tmp, out)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise PlotError(f"cannot write {out}: {e.strerror or e}; give --out a writable path") from None
    finally:
        plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="engram-plot",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: engram-plot runs/baseline runs/engram --smooth 0.6 --out loss.png",
    )
    p.add_argument("runs", nargs="+", help="run folders or metrics.jsonl files")
    p.add_argument("--out", help="output PNG (default: <run>/loss.png for one run, else loss.png)")
    p.add_argument(
        "--smooth",
        type=float,
        default=0.0,
        metavar="W",
        help="EMA smoothing weight in [0, 1) for the train loss, e.g. 0.6 (default 0: none)",
    )
    p.add_argument("--title", help="figure title")
    p.add_argument("--logy", action="store_true", help="log-scale loss axis")
    args = p.parse_args(argv)  # fmt: skip
    try:
        if args.out is None:
            one = len(args.runs) == 1
            args.out = _metrics_file(args.runs[0]).parent / "loss.png" if one else "loss.png"
        out = plot_runs(args.runs, args.out, smooth=args.smooth, title=args.title, logy=args.logy)
    except EngramError as e:
        print(f"engram-plot: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

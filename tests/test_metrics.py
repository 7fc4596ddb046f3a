"""Metrics: log line format, metrics.jsonl + TensorBoard, resume truncation, engram-plot."""

from __future__ import annotations

import json
import math
import os
import re
import struct
import zlib

import pytest
import torch

from engram_train.metrics import (
    MetricsWriter,
    format_eval_line,
    format_log_line,
    is_logging_rank,
    memory_usage,
)
from engram_train.plot import load_metrics, plot_runs, run_labels, smooth_ema
from engram_train.plot import main as plot_main


def test_log_line_layout():
    line = format_log_line(
        iteration=10, train_iters=100, consumed_samples=80, step_time_s=0.1234, tokens_per_s=1234.4,
        lr=1e-4, global_batch_size=8, losses={"lm loss": 5.123456}, grad_norm=1.2344,
        now=0.0,
    )  # fmt: skip
    assert re.match(r"^ \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] iteration       10/     100 \|", line)
    for field in (
        "| consumed samples:           80 |",
        "| elapsed time per iteration (ms): 123.4 |",
        "| tokens/s: 1234 |",
        "| learning rate: 1.000000E-04 |",
        "| global batch size:     8 |",
        "| lm loss: 5.123456E+00 |",
        "| grad norm: 1.234 |",
    ):
        assert field in line, field
    label, now, peak = memory_usage()
    assert label == (
        "alloc/max" if torch.cuda.is_available() and torch.cuda.is_initialized() else "rss/max"
    )
    assert 0 < now <= peak
    assert re.search(rf"\| mem \(GiB\) {re.escape(label)}: \d+\.\d\d/\d+\.\d\d \|$", line)
    bare = format_log_line(
        iteration=1, train_iters=2, consumed_samples=4, step_time_s=1.0, lr=0.5,
        global_batch_size=4, losses={}, memory=False,
    )  # fmt: skip
    assert "mem" not in bare and "grad norm" not in bare and "tokens/s" not in bare


def test_eval_line():
    line = format_eval_line(100, {"lm loss": math.log(20.0)})
    assert line.startswith(" validation loss at iteration 100 | lm loss value: 2.995732E+00 |")
    assert "lm loss PPL: 2.000000E+01 |" in line


def test_metrics_jsonl_and_tensorboard(tmp_path):
    exp = tmp_path / "run_a"
    with MetricsWriter(exp, enabled=True) as w:
        for it in (10, 20, 30):
            w.log(it, lm_loss=torch.tensor(6.0 - it / 10), lr=1e-4 * it, grad_norm=1.5,
                  tokens_per_s=1000.0 + it, step_time_s=0.25,
                  val_loss=5.5 if it == 20 else None)  # fmt: skip
            # flushed: readable while the writer is open
            assert len((exp / "metrics.jsonl").read_text().splitlines()) == it // 10
        w.log(40, lm_loss=float("nan"), lr=1e-3, consumed_samples=320)
    records = [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines()]
    assert records[0] == {
        "iteration": 10, "lm_loss": 5.0, "lr": pytest.approx(1e-3), "grad_norm": 1.5,
        "tokens_per_s": 1010.0, "step_time_s": 0.25,
    }  # fmt: skip
    assert records[1]["val_loss"] == 5.5 and "val_loss" not in records[0]
    assert records[3] == {"iteration": 40, "lm_loss": None, "lr": 1e-3, "consumed_samples": 320}

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(exp / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/lm_loss", "train/lr", "train/grad_norm", "train/tokens_per_s",
            "train/step_time_s", "val/lm_loss", "train/consumed_samples"} <= tags  # fmt: skip
    assert [(e.step, round(e.value, 4)) for e in acc.Scalars("train/lm_loss")] == [
        (10, 5.0),
        (20, 4.0),
        (30, 3.0),
    ]
    assert [(e.step, e.value) for e in acc.Scalars("val/lm_loss")] == [(20, 5.5)]


def test_disabled_writer_writes_nothing(tmp_path):
    w = MetricsWriter(tmp_path / "rank3", enabled=False)
    assert w.log(1, lm_loss=1.0) is None
    w.close()
    assert not (tmp_path / "rank3").exists()
    assert is_logging_rank()  # no process group: this process logs


def test_resume_drops_the_abandoned_tail(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        for it in range(1, 6):
            w.log(it, lm_loss=float(it))
    with MetricsWriter(tmp_path, tensorboard=False, resume_iteration=3) as w:
        w.log(4, lm_loss=40.0)
    its = [
        json.loads(x)["iteration"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ]
    assert its == [1, 2, 3, 4]
    assert load_metrics(tmp_path)["train"] == ([1, 2, 3, 4], [1.0, 2.0, 3.0, 40.0])


def write_run(path, n=50, offset=0.0, val_every=10):
    path.mkdir(parents=True)
    with open(path / "metrics.jsonl", "w") as f:
        for it in range(1, n + 1):
            rec = {"iteration": it, "lm_loss": 8.0 * math.exp(-it / 20) + 2 + offset}
            if it % val_every == 0:
                rec["val_loss"] = rec["lm_loss"] + 0.1
            f.write(json.dumps(rec) + "\n")
        f.write('{"iteration": 51, "lm_lo')  # a record still being written


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert zlib.crc32(data[12:29]) == struct.unpack(">I", data[29:33])[0]
    return struct.unpack(">II", data[16:24])


def test_plot_runs_writes_png(tmp_path):
    write_run(tmp_path / "exp" / "baseline")
    write_run(tmp_path / "exp" / "engram", offset=-0.3)
    m = load_metrics(tmp_path / "exp" / "engram" / "metrics.jsonl")
    assert len(m["train"][0]) == 50 and m["val"][0] == [10, 20, 30, 40, 50]
    out = plot_runs([tmp_path / "exp" / "baseline", tmp_path / "exp" / "engram" / "metrics.jsonl"],
                    tmp_path / "plots" / "loss.png", smooth=0.6)  # fmt: skip
    assert out.stat().st_size > 10_000
    w, h = png_size(out)
    assert w > 500 and h > 300


def test_plot_cli(tmp_path, capsys):
    write_run(tmp_path / "a" / "run")
    write_run(tmp_path / "b" / "run")
    assert run_labels([tmp_path / "a" / "run", tmp_path / "b" / "run"]) == ["a/run", "b/run"]
    assert plot_main([str(tmp_path / "a" / "run")]) == 0
    assert (tmp_path / "a" / "run" / "loss.png").stat().st_size > 10_000
    out = tmp_path / "both.png"
    assert plot_main([str(tmp_path / "a" / "run"), str(tmp_path / "b" / "run"), "--out", str(out),
                      "--smooth", "0.9", "--logy"]) == 0  # fmt: skip
    assert out.stat().st_size > 10_000
    assert plot_main([str(tmp_path / "missing")]) == 1
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_plot_that_cannot_be_written_is_one_line_and_keeps_the_old_plot(tmp_path, capsys):
    """An unwritable --out ends in one line naming it; a write that fails midway (a folder in
    the temporary file's place stands for a full disk) leaves the earlier plot as it was."""
    write_run(tmp_path / "run")
    assert plot_main([str(tmp_path / "run"), "--out", str(tmp_path / "run" / "metrics.jsonl" / "x.png")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("engram-plot: cannot write ") and "--out" in err and "Traceback" not in err
    out = tmp_path / "loss.png"
    assert plot_main([str(tmp_path / "run"), "--out", str(out)]) == 0
    before = out.read_bytes()
    (tmp_path / f".loss.png.{os.getpid()}.tmp").mkdir()
    assert plot_main([str(tmp_path / "run"), "--out", str(out), "--logy"]) == 1
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".loss.png.{os.getpid()}.tmp", "loss.png", "run"]


def test_smooth_ema():
    assert smooth_ema([1.0, 1.0, 1.0], 0.9) == pytest.approx([1.0, 1.0, 1.0])  # debiased
    s = smooth_ema([0.0, 10.0], 0.5)
    assert s[0] == 0.0 and 0.0 < s[1] < 10.0
    with pytest.raises(ValueError):
        smooth_ema([1.0], 1.0)

"""Faults injected into real trainer runs (torchrun, 2 CPU processes, the demo model), one test
per row of issue 13's table, each asserting the new outcome and that no data was lost.

Launches are few and shared: a base run writes checkpoints at iterations 2 and 4 that the
other cases copy and damage; checks that need no training (resume mismatches, truncated or
overwritten files) call the trainer's `check` step in this process against those checkpoints.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from hydra import compose, initialize_config_dir
from engram_train.config import register
from packaging.version import Version

from engram_train.checkpoint.lock import LOCK_FILE
from engram_train.runtime import megatron_core_version

from damage import corrupt
from launch import REPO, free_port, run_process

CONF = str(REPO / "conf")
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
TRACKER = "latest_checkpointed_iteration.txt"


def trainer_cmd(nproc: int, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            f"--master-port={free_port()}", "-m", "engram_train.train", *overrides]  # fmt: skip


def run_trainer(*overrides: str, expect: int = 0, timeout: int = 900) -> subprocess.CompletedProcess:
    proc = run_process(trainer_cmd(2, *overrides), cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert (proc.returncode == 0) == (expect == 0), out[-6000:]
    proc.output = out
    return proc


def read_metrics(exp_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (exp_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def manifest_digest(ckpt: Path) -> dict:
    return json.loads((ckpt / "manifest.json").read_text())["files"]


def _cfg(*overrides):
    register()  # the run config's schema (conf/train.yaml's defaults)
    with initialize_config_dir(config_dir=CONF, version_base=None):
        return compose(config_name="train", overrides=list(overrides))


COMMON = ["train.train_iters=4", "checkpoint.save_interval=2", "train.eval_interval=null", "train.lr_warmup_iters=2"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """2 processes, 4 iterations, checkpoints at 2 and 4; log_interval 10 and no evaluation, so
    only the final iteration is logged (the plot step once failed on such a run)."""
    root = tmp_path_factory.mktemp("reliability_trainer")
    exp, ckpt = root / "run", root / "ckpt"
    proc = run_trainer(f"experiment.exp_dir={exp}", f"checkpoint.save={ckpt}", *COMMON)
    return root, exp, ckpt, proc


def copy_run(base, name: str) -> tuple[Path, Path]:
    root, exp, ckpt, _ = base
    exp2, ckpt2 = root / f"{name}_run", root / f"{name}_ckpt"
    shutil.copytree(exp, exp2)
    shutil.copytree(ckpt, ckpt2)
    return exp2, ckpt2


# -- row: train_iters small, eval_interval=null: the plot step ----------------------------------


def test_short_run_without_evaluation_finishes_with_a_plot(base):
    _, exp, ckpt, proc = base
    assert [r["iteration"] for r in read_metrics(exp)] == [4]  # the final iteration is logged
    assert (exp / "loss.png").stat().st_size > 1000
    assert (ckpt / TRACKER).read_text() == "4"
    from engram_train.checkpoint import check_checkpoint

    for it in (2, 4):
        assert check_checkpoint(ckpt / f"iter_000000{it}") == []
        manifest = json.loads((ckpt / f"iter_000000{it}" / "manifest.json").read_text())
        assert manifest["iteration"] == it and manifest["run"]["use_engram"]
        assert manifest["run"]["engram"]["engram_layer_ids"] == [1, 3]
    assert not list(ckpt.glob("*.tmp"))


# -- rows: resume with another train_iters / engram_seed / tokenizer / layer order / model ------


def test_resume_mismatches_fail_before_any_process_group(base):
    from engram_train.training.plan import check
    from engram_train.training.run_identity import ResumeMismatchError

    _, _, ckpt, _ = base
    load = [f"checkpoint.load={ckpt}", f"experiment.exp_dir={ckpt.parent / 'check'}", *COMMON]
    with pytest.raises(ResumeMismatchError, match=r"(?s)train\.train_iters.*32 samples \(~4 iterations of 8\) "
                       r"in the checkpoint, 64 \(~8\) here.*override_opt_param_scheduler"):
        check(_cfg(*load, "train.train_iters=8"))
    with pytest.raises(ResumeMismatchError, match=r"model\.engram_seed: 0 in the checkpoint, 5 here"):
        check(_cfg(*load, "model.engram_seed=5"))
    other = REPO / "tests" / "data" / "golden" / "tok_bpe4k"
    with pytest.raises(ResumeMismatchError, match=r"engram_tokenizer_name_or_path \(the compressed vocabulary\)"):
        check(_cfg(*load, f"model.engram_tokenizer_name_or_path={other}"))
    with pytest.raises(ResumeMismatchError, match=r"has Engram, this run has use_engram=false.*load_engram=false"):
        check(_cfg(*load, "model.use_engram=false"))
    # The same layers in another order are the same model.
    assert check(_cfg(*load, "model.engram_layer_ids=[3,1]")).resume_from == str(ckpt)
    # The overrides accept what they name.
    check(_cfg(*load, "train.train_iters=8", "checkpoint.override_opt_param_scheduler=true"))
    check(_cfg(*load, "model.engram_seed=5", "checkpoint.load_engram=false"))


def test_resume_lists_every_mismatch_at_once(base):
    """Adding Engram's switch and a longer schedule in one relaunch: the identity and the
    schedule are both reported, with the overrides that accept them together; a shape change
    among them leaves no such line (it cannot be accepted)."""
    from engram_train.training.plan import check
    from engram_train.training.run_identity import ResumeMismatchError

    _, _, ckpt, _ = base
    load = [f"checkpoint.load={ckpt}", f"experiment.exp_dir={ckpt.parent / 'check_all'}", *COMMON]
    with pytest.raises(ResumeMismatchError) as e:
        check(_cfg(*load, "model.engram_seed=5", "train.train_iters=8"))
    message = str(e.value)
    assert "model.engram_seed: 0 in the checkpoint, 5 here" in message, message
    assert "train.train_iters" in message and "32 samples" in message, message
    assert message.endswith("To accept every difference above in one relaunch, add: "
                            "checkpoint.load_engram=false checkpoint.override_opt_param_scheduler=true"), message
    check(_cfg(*load, "model.engram_seed=5", "train.train_iters=8",
               "checkpoint.load_engram=false", "checkpoint.override_opt_param_scheduler=true"))
    with pytest.raises(ResumeMismatchError) as e:
        check(_cfg(*load, "model.hidden_size=128", "train.train_iters=8"))
    assert "hidden_size" in str(e.value) and "train.train_iters" in str(e.value)
    assert "in one relaunch" not in str(e.value)


def test_resume_at_the_final_iteration_says_so_and_exits_0(base):
    exp, ckpt = copy_run(base, "final")
    plot = (exp / "loss.png").read_bytes()
    proc = run_trainer(f"experiment.exp_dir={exp}", f"checkpoint.load={ckpt}", f"checkpoint.save={ckpt}", *COMMON)
    assert proc.output.count("engram-train: nothing to train: the checkpoint is at iteration 4 and "
                             "train.train_iters=4") == 1, proc.output[-3000:]
    assert "loss plot" not in proc.output and not re.search(r"\] iteration +\d", proc.output)
    assert (exp / "loss.png").read_bytes() == plot and (ckpt / TRACKER).read_text() == "4"
    assert [r["iteration"] for r in read_metrics(exp)] == [4]


# -- rows: a truncated shard; random bytes inside a shard ---------------------------------------


def test_truncated_and_overwritten_shards_are_named(base, tmp_path):
    from engram_train.checkpoint import DamagedCheckpointError, select_checkpoint
    from engram_train.training.plan import check

    _, _, ckpt, _ = base
    for mode in ("truncate", "overwrite"):
        damaged = tmp_path / mode
        shutil.copytree(ckpt, damaged)
        shard = max((damaged / "iter_0000004").glob("*.distcp"), key=lambda p: p.stat().st_size)
        size = shard.stat().st_size
        corrupt(shard, truncate=mode == "truncate")
        if mode == "truncate":  # found before any process group: sizes are compared at start
            expected = re.escape(f"{shard}: {size // 2} bytes, {size} were written")
            with pytest.raises(DamagedCheckpointError, match=expected):
                check(_cfg(f"checkpoint.load={damaged}", f"experiment.exp_dir={tmp_path / 'run'}", *COMMON))
        with pytest.raises(DamagedCheckpointError) as e:
            select_checkpoint(damaged)
        assert str(shard) in str(e.value) and "load_fallback=true" in str(e.value)
        chosen = select_checkpoint(damaged, fallback=True)
        assert chosen.iteration == 2 and chosen.skipped[0][0] == 4 and str(shard) in chosen.skipped[0][1][0]
        assert shard.stat().st_size == (size // 2 if mode == "truncate" else size)  # left for inspection


# -- row: a checkpoint without Engram, resumed with Engram (the continued-pretraining recipe) ----


def test_adding_engram_to_a_checkpoint_without_it(tmp_path):
    """Saved without Engram under data parallel 2; refused with Engram unless switched on;
    with checkpoint.load_engram=false resumed with Engram under tensor parallel 2."""
    from engram_train.checkpoint import check_checkpoint
    from engram_train.training.plan import check
    from engram_train.training.run_identity import ResumeMismatchError

    base, engram = tmp_path / "base", tmp_path / "engram"
    run_trainer(f"experiment.exp_dir={tmp_path / 'run_base'}", f"checkpoint.save={base}", "model.use_engram=false",
                "train.train_iters=2", "train.eval_interval=null", "train.lr_warmup_iters=1")  # fmt: skip
    before = manifest_digest(base / "iter_0000002")
    resume = [f"experiment.exp_dir={tmp_path / 'run_engram'}", f"checkpoint.load={base}", f"checkpoint.save={engram}",
              "train.train_iters=4", "train.eval_interval=null", "train.lr_warmup_iters=1", "train.log_interval=1",
              "checkpoint.override_opt_param_scheduler=true"]  # fmt: skip
    with pytest.raises(ResumeMismatchError, match=r"saved without Engram.*checkpoint\.load_engram=false"):
        check(_cfg(*resume))
    proc = run_trainer(*resume, "checkpoint.load_engram=false", "system.tensor_model_parallel_size=2")
    assert f"resumed from {base / 'iter_0000002'} at iteration 2 (16 samples consumed); Engram not loaded: " \
           "initialised afresh" in proc.output
    records = read_metrics(tmp_path / "run_engram")
    assert [r["iteration"] for r in records] == [3, 4] and all(math.isfinite(r["lm_loss"]) for r in records)
    manifest = json.loads((engram / "iter_0000004" / "manifest.json").read_text())
    assert manifest["run"]["use_engram"] and check_checkpoint(engram / "iter_0000004") == []
    assert manifest_digest(base / "iter_0000002") == before and sorted(p.name for p in base.iterdir()) == [
        ".engram-train.lock", "iter_0000002", TRACKER]


# -- row: random bytes in the newest checkpoint, resumed with fallback; longer schedule -------


def test_damaged_newest_checkpoint_falls_back_and_schedule_override_is_followed(base):
    """iter_4 damaged: with checkpoint.load_fallback the run resumes from iter_2, and with a
    longer train_iters and override_opt_param_scheduler the LR follows the new cosine."""
    exp, ckpt = copy_run(base, "fallback")
    shard = max((ckpt / "iter_0000004").glob("*.distcp"), key=lambda p: p.stat().st_size)
    corrupt(shard)
    iter2 = manifest_digest(ckpt / "iter_0000002")
    proc = run_trainer(
        f"experiment.exp_dir={exp}", f"checkpoint.save={ckpt}", f"checkpoint.load={ckpt}",
        "checkpoint.load_fallback=true", "checkpoint.override_opt_param_scheduler=true",
        "train.train_iters=8", "checkpoint.save_interval=2", "train.eval_interval=null",
        "train.lr_warmup_iters=2", "train.log_interval=1",
    )  # fmt: skip
    assert f"passing over damaged checkpoint {ckpt / 'iter_0000004'}" in proc.output
    assert f"{shard}: contents changed since the save" in proc.output
    assert f"resumed from {ckpt / 'iter_0000002'} at iteration 2" in proc.output
    from engram_train.checkpoint import check_checkpoint

    for it in (2, 4, 6, 8):
        assert check_checkpoint(ckpt / f"iter_000000{it}") == []
    assert manifest_digest(ckpt / "iter_0000002") == iter2 and (ckpt / TRACKER).read_text() == "8"
    records = read_metrics(exp)
    assert [r["iteration"] for r in records] == [3, 4, 5, 6, 7, 8]  # base's 4 dropped: after iter 2
    # megatron's warmup + cosine over the new 8 iterations (in samples), written out here
    lr, min_lr, warmup, decay = 3e-3, 3e-4, 2 * 8, 8 * 8
    for r in records:
        s = r["iteration"] * 8
        want = min_lr + (lr - min_lr) * 0.5 * (math.cos(math.pi * (s - warmup) / (decay - warmup)) + 1)
        assert r["lr"] == pytest.approx(want, rel=1e-6), r
        assert math.isfinite(r["lm_loss"])
    assert records[2]["iteration"] == 5 and records[2]["lr"] > 5 * min_lr  # the old schedule ended at min_lr


# -- row: non-finite loss (a diverged step) -------------------------------------------------------


def test_nonfinite_steps_stop_the_run_without_saving(tmp_path):
    """A learning rate of 1e35 blows the weights up; the steps after that are NaN. With a
    budget of 1 the first NaN step is skipped (and not checkpointed), the second stops the
    run. The checkpoint whose weights gave the first NaN loss is set aside, not offered."""
    exp, ckpt = tmp_path / "run", tmp_path / "ckpt"
    proc = run_trainer(
        f"experiment.exp_dir={exp}", f"checkpoint.save={ckpt}", "checkpoint.save_interval=1",
        "train.train_iters=6", "train.lr=1e35", "train.min_lr=0", "train.lr_warmup_iters=0",
        "train.nonfinite_skip_budget=1", "train.log_interval=1", "train.eval_interval=null",
        expect=1,
    )  # fmt: skip
    records = {r["iteration"]: r for r in read_metrics(exp)}
    bad = sorted(i for i, r in records.items() if r.get("lm_loss") is None or r.get("grad_norm") is None)
    assert len(bad) == 2 and bad[1] == bad[0] + 1 == max(records), records
    first = bad[0]
    assert f"iteration {first}: non-finite lm loss" in proc.output
    assert "update skipped (1 of train.nonfinite_skip_budget=1)" in proc.output
    assert (f"iteration {first + 1}: non-finite lm loss (nan) or grad norm (nan); 2 such steps, more than "
            "train.nonfinite_skip_budget=1. Stopped without saving") in proc.output
    assert f"The first abnormal iteration is {first}" in proc.output
    check_set_aside(ckpt, proc.output, first, saved=range(1, first))


# -- rows: train.lr=1e3 (a loss spike); with warmup 0 (a collapsed model) ---------------------------


def check_set_aside(ckpt: Path, output: str, first_abnormal: int, saved) -> None:
    """Checkpoints from iteration first_abnormal - 1 on are renamed *.diverged, the tracker names
    the newest one below (or is gone), and the message offers that one."""
    from engram_train.checkpoint import check_checkpoint

    good = [i for i in saved if i < first_abnormal - 1]
    aside = [i for i in saved if i >= first_abnormal - 1]
    assert sorted(p.name for p in ckpt.iterdir()) == sorted(
        [".engram-train.lock"] + [f"iter_{i:07d}" for i in good] + [f"iter_{i:07d}.diverged" for i in aside]
        + ([TRACKER] if good else [])
    ), output[-3000:]
    if aside:
        assert "Set aside (renamed *.diverged, never loaded): " + ", ".join(
            f"iter_{i:07d}.diverged" for i in aside) in output
    if good:
        assert int((ckpt / TRACKER).read_text()) == good[-1]
        assert f"The newest good checkpoint is iteration {good[-1]} in {ckpt} (now the latest)" in output
        assert check_checkpoint(ckpt / f"iter_{good[-1]:07d}") == []
    else:
        assert f"No checkpoint in {ckpt} was vouched for by a normal loss" in output
    # printed once (by rank 0), without a traceback of the trainer
    assert output.count("The first abnormal iteration is") == 1
    assert f'File "{REPO / "engram_train"}' not in output and "HYDRA_FULL_ERROR" not in output


def first_spike(records: list[dict], factor: float = 10.0) -> int | None:
    """The first iteration whose loss exceeds factor x the largest of the earlier ones."""
    for i, r in enumerate(records[1:], 1):
        if r["lm_loss"] > factor * max(p["lm_loss"] for p in records[max(0, i - 100):i]):
            return r["iteration"]
    return None


def test_loss_spike_stops_the_run_before_the_next_save(tmp_path):
    """train.lr=1e3 for 5 iterations (issue 26): the loss jumps by orders of magnitude. Before
    the guard the run ended with exit 0 and a collapsed model saved as the latest checkpoint."""
    exp, ckpt = tmp_path / "run", tmp_path / "ckpt"
    proc = run_trainer(f"experiment.exp_dir={exp}", f"checkpoint.save={ckpt}", "checkpoint.save_interval=2",
                       "train.lr=1e3", "train.train_iters=5", "train.log_interval=1", "train.eval_interval=null",
                       expect=1)  # fmt: skip
    records = read_metrics(exp)
    spike = first_spike(records)
    assert spike is not None and spike == records[-1]["iteration"] < 5, records
    assert f"training diverged at iteration {spike}: lm loss" in proc.output
    assert "more than train.divergence_spike_factor=10 times the largest of the last" in proc.output
    assert "Lower train.lr (now 1000), lengthen train.lr_warmup_iters (now 20)" in proc.output
    check_set_aside(ckpt, proc.output, spike, saved=[i for i in (2, 4) if i < spike])


def test_collapsed_model_is_never_left_as_latest(tmp_path):
    """train.lr=1e3 train.lr_warmup_iters=0, saving every 2 (issue 26): the loss spikes at once
    and the run stops there. With the spike rule switched off, the model collapses (loss
    ln(vocab), grad norm 0), which the collapse rule catches on its second step; a zero-gradient
    step is not saved, and the checkpoint whose weights produced the first collapsed loss is set
    aside."""
    common = ["checkpoint.save_interval=2", "train.lr=1e3", "train.lr_warmup_iters=0", "train.train_iters=6",
              "train.log_interval=1", "train.eval_interval=null"]  # fmt: skip
    exp, ckpt = tmp_path / "run", tmp_path / "ckpt"
    proc = run_trainer(f"experiment.exp_dir={exp}", f"checkpoint.save={ckpt}", *common, expect=1)
    records = read_metrics(exp)
    spike = first_spike(records)
    assert spike is not None and spike == records[-1]["iteration"], records
    assert f"training diverged at iteration {spike}" in proc.output
    check_set_aside(ckpt, proc.output, spike, saved=[i for i in (2, 4) if i < spike])

    exp, ckpt = tmp_path / "run_collapse", tmp_path / "ckpt_collapse"
    proc = run_trainer(f"experiment.exp_dir={exp}", f"checkpoint.save={ckpt}", *common, "checkpoint.save_interval=1",
                       "train.divergence_spike_factor=1e30", expect=1)  # fmt: skip
    records = read_metrics(exp)
    uniform = math.log(4096)  # the demo tokenizer's vocabulary, already a multiple of 128
    collapsed = [r["iteration"] for r in records if r["grad_norm"] == 0 and abs(r["lm_loss"] - uniform) < 1e-3 * uniform]
    first = collapsed[0]
    assert collapsed[:2] == [first, first + 1] == [first, records[-1]["iteration"]], records
    assert f"iteration {first}: grad norm exactly 0 at lm loss" in proc.output and "not saved" in proc.output
    assert (f"training diverged at iteration {first + 1}: grad norm exactly 0 for 2 consecutive steps at lm loss "
            f"{records[-1]['lm_loss']:.6g} = ln(4096)") in proc.output
    assert f"The first abnormal iteration is {first}" in proc.output
    check_set_aside(ckpt, proc.output, first, saved=range(1, first))


# -- rows: tracker deleted; SIGTERM; a stale .tmp; metrics not duplicated -------------------------


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _alive(pids) -> list[int]:
    left = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                left.append(pid)
        except psutil.NoSuchProcess:
            pass
    return left


def _cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())[:120]
    except psutil.NoSuchProcess:
        return "(gone)"


def _wait_gone(pids, seconds: float) -> list[int]:
    deadline = time.time() + seconds
    while time.time() < deadline and _alive(pids):
        time.sleep(0.2)
    return _alive(pids)


@pytest.mark.cpu_slots(2)
def test_sigterm_saves_then_exits_and_resume_finds_the_newest_without_tracker(base):
    exp, ckpt = copy_run(base, "sigterm")
    (ckpt / TRACKER).unlink()
    stale = ckpt / "iter_0000003.tmp"
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"\0" * 4096)
    before = {it: manifest_digest(ckpt / f"iter_000000{it}") for it in (2, 4)}
    proc = subprocess.Popen(
        trainer_cmd(2, f"experiment.exp_dir={exp}", f"checkpoint.load={ckpt}", f"checkpoint.save={ckpt}",
                    "train.train_iters=1000", "train.log_interval=1", "train.eval_interval=null",
                    "train.lr_warmup_iters=2", "checkpoint.override_opt_param_scheduler=true"),
        cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if " iteration        6/" in line:
                proc.send_signal(signal.SIGTERM)
                break
        lines += proc.stdout.readlines()
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            for p in [proc.pid, *(c.pid for c in _descendants(proc.pid))]:
                os.kill(p, signal.SIGKILL)
    out = "".join(lines)
    assert "(no tracker file: the newest complete one) at iteration 4" in out
    assert "received SIGTERM: saved iteration" in out
    stopped = int((ckpt / TRACKER).read_text())
    assert stopped >= 6
    from engram_train.checkpoint import check_checkpoint

    assert check_checkpoint(ckpt / f"iter_{stopped:07d}") == []
    assert {it: manifest_digest(ckpt / f"iter_000000{it}") for it in (2, 4)} == before  # untouched
    assert not stale.exists() and not list(ckpt.glob("*.tmp"))
    iterations = [r["iteration"] for r in read_metrics(exp)]
    assert iterations == list(range(4, stopped + 1))  # base's 4, then 5.. once each


# -- row: kill -9 of rank 0 during a save ---------------------------------------------------------


def _rank0(torchrun_pid: int) -> psutil.Process | None:
    for p in _descendants(torchrun_pid):
        try:
            if p.environ().get("RANK") == "0" and p.ppid() == torchrun_pid:
                return p
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return None


# megatron-core 0.16.1 writes checkpoint shards from forked processes, 0.19.2 from threads
# (filesystem_async.FileSystemWriterAsync; the releases between are not supported lanes).
FORKED_WRITERS = Version(megatron_core_version()) < Version("0.19")


@pytest.mark.cpu_slots(2)
def test_kill_rank0_during_save_leaves_no_process(tmp_path):
    """Rank 0 is killed (SIGKILL) while a checkpoint is being written: nothing of the job
    survives it, and the newest complete checkpoint stays intact. megatron-core 0.16 writes
    from processes forked by the rank: they are stopped (SIGSTOP) just before, as on a slow
    file system (on their own they would finish this small checkpoint within a second and hide
    the fault). megatron-core 0.19 writes from threads of the rank itself."""
    exp, ckpt = tmp_path / "run", tmp_path / "ckpt"
    proc = subprocess.Popen(
        trainer_cmd(2, f"experiment.exp_dir={exp}", f"checkpoint.save={ckpt}", "checkpoint.save_interval=1",
                    "train.train_iters=50", "train.eval_interval=null"),
        cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    writers, forked, job = [], [], set()
    try:
        deadline = time.time() + 600
        while time.time() < deadline and not writers and proc.poll() is None:
            rank0 = _rank0(proc.pid)
            if rank0 is not None:
                try:
                    cmd = rank0.cmdline()
                    forked = [c for c in rank0.children() if c.cmdline() == cmd]
                    # writing: a shard file of the checkpoint open
                    writers = [p for p in (forked if FORKED_WRITERS else [rank0])
                               if any(str(ckpt) in f.path for f in p.open_files())]
                except psutil.NoSuchProcess:
                    writers = []
            if not writers:
                time.sleep(0.01)
        assert writers, "no process of rank 0 seen writing a checkpoint before the run ended"
        for writer in forked:
            writer.suspend()
        job = {p.pid for p in _descendants(proc.pid)}  # workers, writers, helpers
        rank0.kill()
        proc.wait(timeout=300)
        left = _wait_gone(job, 15)
        survivors = {pid: _cmdline(pid) for pid in left}
    finally:
        for pid in _alive(job):  # whatever is left of this job, so the suite goes on
            os.kill(pid, signal.SIGKILL)
    assert {w.pid for w in writers} <= job
    assert left == [], survivors
    from engram_train.checkpoint import check_checkpoint, read_tracker

    latest = read_tracker(ckpt)
    if latest is not None:
        assert check_checkpoint(ckpt / f"iter_{latest:07d}") == []


# -- row: disk full during a save -----------------------------------------------------------------

ENOSPC_SCRIPT = textwrap.dedent("""
    set -u
    mount -t tmpfs -o size={size} tmpfs {mnt} || exit 90
    {cmd} checkpoint.check_free_space=true > {out}/checked.log 2>&1; echo "checked_rc=$?" >> {out}/rc
    rm -rf {mnt}/ckpt
    {cmd} checkpoint.check_free_space=false > {out}/unchecked.log 2>&1; echo "unchecked_rc=$?" >> {out}/rc
    ls -a {mnt}/ckpt > {out}/listing; cat {mnt}/ckpt/latest_checkpointed_iteration.txt > {out}/tracker
    {python} -c "from engram_train.checkpoint import check_checkpoint as c; print(c('{mnt}/ckpt/iter_0000002'))" \\
        > {out}/problems
""")


def _mount_namespace() -> list[str] | None:
    """A command prefix that runs in a private mount namespace where tmpfs can be mounted."""
    for prefix in (["unshare", "-m"], ["unshare", "-r", "-m"]):
        probe = run_process([*prefix, "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"], capture_output=True)
        if probe.returncode == 0:
            return prefix
    return None


@pytest.mark.cpu_slots(2)
def test_disk_full_is_reported_as_such_and_loses_nothing(tmp_path):
    """A tmpfs with room for one checkpoint (in a private mount namespace). Saving the second:
    refused up front by the free-space check; without it, ENOSPC while writing is reported as
    'no space left on device', the partial directory removed and iteration 2 kept intact."""
    namespace = _mount_namespace()
    assert namespace is not None, "needs root or unprivileged user namespaces (unshare -r -m) to mount a tmpfs"
    mnt, out = tmp_path / "mnt", tmp_path / "out"
    mnt.mkdir()
    out.mkdir()
    cmd = " ".join(trainer_cmd(2, f"experiment.exp_dir={tmp_path / 'run'}", f"checkpoint.save={mnt}/ckpt",
                               "checkpoint.save_interval=2", "train.train_iters=4", "train.eval_interval=null"))
    script = ENOSPC_SCRIPT.format(size="100m", mnt=mnt, out=out, cmd=cmd, python=sys.executable)
    proc = run_process([*namespace, "bash", "-c", script], cwd=REPO, env=ENV, capture_output=True,
                          text=True, timeout=1200)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rc = dict(line.split("=") for line in (out / "rc").read_text().split())
    checked, unchecked = (out / "checked.log").read_text(), (out / "unchecked.log").read_text()
    assert rc == {"checked_rc": "1", "unchecked_rc": "1"}, checked[-3000:] + unchecked[-3000:]
    assert "not enough free space to save iteration 4" in checked and "Nothing was written" in checked
    assert "saving iteration 4 to" in unchecked and "no space left on device" in unchecked
    assert "The partial iter_0000004.tmp was removed; the newest complete checkpoint is still iter_0000002" in unchecked
    # the folder lock of the run (checkpoint/lock.py) stays, as any lock file does
    assert (out / "listing").read_text().split() == [".", "..", LOCK_FILE, "iter_0000002", TRACKER]
    assert (out / "tracker").read_text() == "2" and (out / "problems").read_text().strip() == "[]"

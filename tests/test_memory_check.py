"""The trainer's start-up memory check (``system.memory_check``, memory_plan/start_check.py): a
run whose memory plan does not fit this machine is refused in one line naming both figures,
before the model is built and before the process holds 2 GiB; ``tight`` warns; ``warn`` and
``off`` start anyway; every documented trainer command passes the check on its machine."""

from __future__ import annotations

import logging
import os
import re
import sys

import pytest

from launch import REPO, run_process
from test_presets import COMMANDS

GIB = 1 << 30
REFUSED_BEFORE = 2 * GIB  # peak RSS a refused run may reach (the issue: 19 GB and growing)
# A child that runs the trainer in a fresh interpreter and writes the child's peak RSS (its
# only child: getrusage's RUSAGE_CHILDREN is the trainer's maximum resident set, in KiB).
PEAK_RSS_OF_CHILD = (
    "import os, resource, subprocess, sys\n"
    "code = subprocess.run(sys.argv[2:]).returncode\n"
    "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024))\n"
    "sys.exit(code)\n"
)
# Tables no attention kernel changes: 2 x 200M rows of the demo's heads (about 190 GiB of
# float32 tables, twice that in their Adam moments), and V4.1-tiny's three orders at 200M rows.
HUGE_DEMO_TABLES = "model.engram_vocab_size=[200000000,200000000]"
HUGE_V41_TABLES = "model.engram_vocab_size=[200000000,200000000,200000000]"


@pytest.fixture(autouse=True)
def _one_process(monkeypatch):
    """No torchrun around the in-process checks: one rank, one per node."""
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)


def compose(*overrides: str):
    from engram_train.config import typed_run_config
    from engram_train.training.param_count import compose_config

    return typed_run_config(compose_config(list(overrides)))


def vocab() -> int:
    from engram_train.data import load_tokenizer

    return load_tokenizer(str(REPO / "examples" / "data" / "tokenizer")).vocab_size


def planned(cfg, world: int = 1, local: int = 1, **machine):
    from engram_train.memory_plan.start_check import Machine, plan_run

    return plan_run(cfg, vocab(), Machine(**{"device": "cpu", "host_memory": 1 << 50,
                                             "host_source": "test", **machine}), world, local)


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


# -- the two runs of the issue, refused as a user starts them ---------------------------------


def run_trainer(tmp_path, *overrides: str):
    """``python -m engram_train.train`` on one process in a fresh interpreter: (exit code,
    stderr, peak RSS in bytes)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(key, None)
    peak = tmp_path / "peak_rss"
    proc = run_process(
        [sys.executable, "-c", PEAK_RSS_OF_CHILD, str(peak), sys.executable, "-m",
         "engram_train.train", f"experiment.exp_dir={tmp_path / 'exp'}", "train.train_iters=2",
         *overrides],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    return proc.returncode, proc.stderr, int(peak.read_text())


@pytest.mark.parametrize("overrides", [
    (HUGE_DEMO_TABLES,),
    ("model=deepseek_v41_tiny", HUGE_V41_TABLES),
], ids=["demo_200GB_tables", "v41_tiny_300GB_tables"])
def test_a_run_that_cannot_fit_is_refused_in_one_line_before_2_gib(tmp_path, overrides):
    """Before the check the first ended in a traceback from torch's CPU allocator once the
    model was built; now it stops at start-up with the plan's figure (the same plan
    engram-plan makes), the host's, the largest item and the fix, and nothing is written."""
    code, stderr, peak = run_trainer(tmp_path, *overrides)
    assert code == 1, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    said = [line for line in stderr.splitlines() if line.startswith("engram-train")]
    assert len(said) == 1, stderr[-3000:]
    plan = planned(compose(*overrides, "train.train_iters=2"))  # on a machine of any size
    line = said[0]
    assert line.startswith("engram-train: invalid configuration: memory check: the plan of this run "
                           f"needs {gib(plan.host_bytes_per_node)} of host memory per node (1 rank "
                           f"x {gib(plan.total_bytes_per_rank)} peak RSS) and this host has "), line
    host = float(re.search(r"this host has ([0-9.]+) GiB for it", line).group(1)) * GIB
    total = float(re.search(r"of ([0-9.]+) GiB total\)", line).group(1)) * GIB
    assert 0 < host <= total + 0.05 * GIB and host < plan.host_bytes_per_node
    assert "the largest item, engram_table_moments" in line and "model.engram_vocab_size" in line
    assert line.endswith("; set system.memory_check=warn to start anyway")
    assert peak < REFUSED_BEFORE, f"peak RSS {gib(peak)}"
    assert not (tmp_path / "exp" / "metrics.jsonl").exists()
    assert not (tmp_path / "exp" / "config.yaml").exists()


# -- the verdicts and the modes, against a machine of a given size ----------------------------


def check(cfg, host_memory: int, caplog, **machine):
    from engram_train.memory_plan.start_check import Machine, check_memory

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="engram_train"):
        return check_memory(cfg, vocab(), Machine(**{"device": "cpu", "host_memory": host_memory,
                                                     "host_source": "given", **machine}))


def said(caplog, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level and r.name == "engram_train"]


def test_verdicts_decide_refuse_warn_and_pass(caplog):
    """A plan above the machine is refused (ConfigError, one line); with warn it starts with a
    warning; between the plan and the plan plus its measured error it warns ``tight`` in both
    modes; with room to spare it says ``fits`` at info."""
    from engram_train.errors import ConfigError
    from engram_train.memory_plan.plan_report import FIT_MARGIN

    cfg = compose()
    need = planned(cfg).host_bytes_per_node
    with pytest.raises(ConfigError) as info:
        check(cfg, need * 9 // 10, caplog)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"memory check: the plan of this run needs {gib(need)}")
    assert f"this host has {gib(need * 9 // 10)} for it (given)" in message

    warn = compose("system.memory_check=warn")
    assert check(warn, need * 9 // 10, caplog).verdict == "no"
    assert [m for m in said(caplog, logging.WARNING) if "starting anyway (system.memory_check=warn)" in m]

    tight = int(need * (1 + FIT_MARGIN / 2))
    for mode in (cfg, warn):
        assert check(mode, tight, caplog).verdict == "tight"
        warned = said(caplog, logging.WARNING)
        assert len(warned) == 1 and warned[0].startswith("memory check: tight: the plan of this run needs")
        assert f"({gib(need * (1 + FIT_MARGIN))} with the plan's +20% error)" in warned[0]

    assert check(cfg, need * 2, caplog).verdict == "yes"
    assert said(caplog, logging.WARNING) == []
    assert [m for m in said(caplog, logging.INFO) if m.startswith("memory check: fits: ")]


def test_off_plans_nothing(caplog):
    assert check(compose("system.memory_check=off"), 1, caplog) is None
    assert said(caplog, logging.WARNING) == said(caplog, logging.INFO) == []


def test_a_plan_that_fails_warns_and_lets_the_run_start(caplog, monkeypatch):
    """The check guards the run; an error of the planner itself does not stop it."""
    from engram_train.memory_plan import plan_cli

    def broken(*args, **kwargs):
        raise KeyError("an item the plan lacks")

    monkeypatch.setattr(plan_cli, "make_plan", broken)
    assert check(compose(), 1, caplog) is None
    assert said(caplog, logging.WARNING) == [
        "memory check skipped: the plan of this run failed (KeyError: 'an item the plan lacks'); "
        "engram-plan with the same overrides shows it, system.memory_check=off skips it"]


def test_cuda_device_memory_is_checked_per_rank(caplog):
    """On CUDA the device peak of a rank is compared with the rank's device memory; the
    refusal names that figure and where it came from."""
    from engram_train.errors import ConfigError

    cfg = compose()
    plan = planned(cfg, device="cuda", device_memory=1 << 50)
    small = plan.device_bytes_per_rank // 2
    with pytest.raises(ConfigError, match=re.escape(
            f"needs {gib(plan.device_bytes_per_rank)} of device memory per rank and cuda:0 (given) "
            f"has {gib(small)} for it")):
        check(cfg, 1 << 50, caplog, device="cuda", device_memory=small, device_source="cuda:0 (given)")


def test_a_wrong_mode_is_refused_naming_the_field():
    from engram_train.errors import ConfigError
    from engram_train.training.run_config import validate_run_config

    with pytest.raises(ConfigError, match=r"^system.memory_check='maybe' must be one of refuse, warn, off$"):
        validate_run_config(compose("system.memory_check=maybe"), 1, check_data=False)


def test_host_figure_adds_the_ranks_own_memory_and_keeps_to_the_limits(monkeypatch):
    """What other processes hold is not available; what this node's ranks hold already is
    (their baseline is in the plan); never more than the host's total or the cgroup's room."""
    from engram_train.memory_plan import start_check

    monkeypatch.setattr(start_check, "_meminfo", lambda: {"MemTotal": 16 * GIB, "MemAvailable": 10 * GIB})
    monkeypatch.setattr(start_check, "_rss", lambda: GIB)
    monkeypatch.setattr(start_check, "_cgroup_room", lambda total: None)
    assert start_check.host_memory(1)[0] == 11 * GIB
    assert start_check.host_memory(4)[0] == 14 * GIB
    assert start_check.host_memory(8)[0] == 16 * GIB
    monkeypatch.setattr(start_check, "_cgroup_room", lambda total: (12 * GIB, 5 * GIB))
    figure, source = start_check.host_memory(4)
    assert figure == 9 * GIB and "cgroup limit 12.0 GiB" in source


def test_this_hosts_figure_is_within_its_memory():
    from engram_train.memory_plan.start_check import _meminfo, this_machine

    machine = this_machine(2)
    assert machine.device in ("cpu", "cuda")
    assert 0 < machine.host_memory <= _meminfo()["MemTotal"]


# -- every documented command passes on its machine -------------------------------------------

# The documented launches of 8 ranks and more are GPU jobs (README 'GPUs, multi-node',
# docs/engram-integration.md, docs/presets.md): planned on the GPUs the docs plan them on
# (docs/memory.md 'Worked plans': 141 GiB per GPU, 2 TiB per node, vocabulary 129280); the
# others are CPU runs of the shipped corpus, planned against this host.
GPU_MACHINE = dict(device="cuda", device_memory=141 * GIB, device_source="H200",
                   host_memory=2 << 40, host_source="2 TiB")
TRAIN_COMMANDS = [c for c in COMMANDS if c["mode"] == "train"]


def test_every_documented_training_command_passes_the_check():
    from engram_train.memory_plan.plan_cli import make_plan, one_rank
    from engram_train.memory_plan.start_check import host_memory

    assert len(TRAIN_COMMANDS) >= 15
    verdicts = {}
    with one_rank():
        for command in TRAIN_COMMANDS:
            words = command["command"].split()
            local = int(words[words.index("--nproc-per-node") + 1]) if "--nproc-per-node" in words else 1
            cfg = compose(*command["overrides"])
            if command["world"] >= 8:
                plan = make_plan(cfg, command["world"], local, 129280, GPU_MACHINE["device"],
                                 GPU_MACHINE["device_memory"], GPU_MACHINE["host_memory"])
            else:
                plan = make_plan(cfg, command["world"], local, vocab(), "cpu", None, host_memory(local)[0])
            verdicts[command["command"]] = plan.verdict
    assert [c for c, v in verdicts.items() if v != "yes"] == []

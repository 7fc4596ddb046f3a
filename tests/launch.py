"""Run a script under real torchrun (gloo on CPU) and collect the JSON each rank writes; every
process a test starts goes through `run`, which holds one CPU slot per rank for its lifetime.

Why slots. Under pytest-xdist several test workers launch at once; a 4-rank launch beside two
2-rank ones on a 2-core machine only multiplies context switches (and gloo's busy waits). The
slots are lock files shared by all workers of one run (``ENGRAM_TEST_SLOTS``, default: the
machine's cores and one more); a launch takes as many as it has ranks (at most all of them), so
launches never run more ranks than slots, whatever the number of workers. The one slot beyond
the cores fills the time a launch leaves a core idle (its ranks wait on each other in gloo:
~1.3 cores busy per 2 ranks): on 2 cores the suite ran 12 min 5 s with 2 slots and 2 workers,
11 min 23 s with 3 and 3."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DIST_DIR = Path(__file__).parent / "dist"
REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slot_count() -> int:
    return max(1, int(os.environ.get("ENGRAM_TEST_SLOTS") or len(os.sched_getaffinity(0)) + 1))


def _slot_dir() -> Path:
    path = Path(os.environ.get("ENGRAM_TEST_SLOT_DIR") or
                Path(tempfile.gettempdir()) / f"engram-test-slots-{os.getuid()}")
    path.mkdir(parents=True, exist_ok=True)
    return path


_HELD_HERE = [0]  # slots this process holds: nested requests (a marked test's launches) pass


@contextlib.contextmanager
def cpu_slots(ranks: int):
    """Hold ``ranks`` CPU slots (capped at the machine's) while the block runs; inside a block
    that already holds slots (``@pytest.mark.cpu_slots(n)`` on a test), nothing more is taken."""
    if _HELD_HERE[0]:
        yield
        return
    wanted = min(max(1, ranks), slot_count())
    folder = _slot_dir()
    held = []
    # First come, first served: a request holds the turnstile while it gathers its slots, so
    # a 4-rank launch is not starved by a stream of one-slot requests from other workers.
    with open(folder / "turnstile.lock", "w") as turnstile:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        while len(held) < wanted:
            for i in range(slot_count()):
                if len(held) == wanted:
                    break
                handle = open(folder / f"slot{i}.lock", "w")
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    handle.close()
                    continue
                held.append(handle)
            if len(held) < wanted:
                time.sleep(0.05)
    _HELD_HERE[0] = wanted
    try:
        yield
    finally:
        _HELD_HERE[0] = 0
        for handle in held:
            handle.close()


def ranks_of(cmd) -> int:
    """Processes a command runs: torchrun's ``--nproc-per-node``, else one."""
    text = " ".join(map(str, cmd)) if not isinstance(cmd, str) else cmd
    if "torch.distributed.run" not in text and "torchrun" not in text:
        return 1  # e.g. engram-plan's --nproc-per-node plans ranks, it starts none
    match = re.search(r"--nproc[-_]per[-_]node[= ](\d+)", text)
    return int(match.group(1)) if match else 1


def kind_of(cmd) -> str:
    text = " ".join(map(str, cmd)) if not isinstance(cmd, str) else cmd
    if "engram_train.train" in text:
        return "trainer"
    return "torchrun script" if str(DIST_DIR) in text else "command"


def children_cpu_seconds() -> float:
    """CPU seconds (user + system) of this process's finished children: its difference around
    a launch is the launch's CPU time (a pytest worker runs one test at a time)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def record(cmd, ranks: int, seconds: float, cpu_seconds: float | None = None) -> None:
    """With ``ENGRAM_TEST_TIMINGS=<file>``, one JSON line per launch (docs/testing.md's table):
    wall seconds and, where known, the CPU seconds of the launch's processes."""
    path = os.environ.get("ENGRAM_TEST_TIMINGS")
    if path:
        line = dict(kind=kind_of(cmd), ranks=ranks, seconds=round(seconds, 2),
                    cpu_seconds=None if cpu_seconds is None else round(cpu_seconds, 2),
                    test=os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0])
        with open(path, "a") as handle:
            handle.write(json.dumps(line) + "\n")


_ZYGOTE = []  # this worker's tests/zygote.Zygote, started on first use
_FORKABLE_KEYS = {"cwd", "env", "capture_output", "text", "timeout", "check"}


def _zygote_command(cmd, kwargs) -> dict | None:
    """The zygote's form of ``cmd`` when it can run it (``tests/zygote.py``), else None."""
    if os.environ.get("ENGRAM_TEST_ZYGOTE", "1") == "0" or isinstance(cmd, str):
        return None
    if not kwargs.get("capture_output") or set(kwargs) - _FORKABLE_KEYS:
        return None
    cmd = [str(c) for c in cmd]
    if not cmd or os.path.realpath(cmd[0]) != os.path.realpath(sys.executable):
        return None
    from zygote import parse

    return parse(cmd[1:])


def _run_in_zygote(cmd, command: dict, kwargs) -> tuple[subprocess.CompletedProcess, float]:
    from zygote import Zygote

    if not _ZYGOTE:
        _ZYGOTE.append(Zygote())
    env = dict(kwargs.get("env") or os.environ)
    cwd = str(kwargs.get("cwd") or os.getcwd())
    with tempfile.TemporaryDirectory(prefix="engram-launch-") as folder:
        out, err = Path(folder) / "stdout", Path(folder) / "stderr"
        code, cpu = _ZYGOTE[0].run(command, cwd, env, out, err, kwargs.get("timeout"))
        stdout, stderr = out.read_bytes(), err.read_bytes()
    if kwargs.get("text"):
        stdout, stderr = stdout.decode(errors="replace"), stderr.decode(errors="replace")
    if code is None:
        raise subprocess.TimeoutExpired(cmd, kwargs.get("timeout"), output=stdout, stderr=stderr)
    proc = subprocess.CompletedProcess(cmd, code, stdout, stderr)
    if kwargs.get("check"):
        proc.check_returncode()
    return proc, cpu


def _port_picked_now(cmd):
    """``cmd`` with its ``--master-port=N`` picked again once the launch holds its slots: a port
    picked when the command was built may be taken by another launch while this one waited."""
    if not isinstance(cmd, list):
        return cmd
    return [f"--master-port={free_port()}" if isinstance(a, str) and a.startswith("--master-port=")
            else a for a in cmd]


def run_process(cmd, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run`` holding one CPU slot per rank of ``cmd``. A Python command the test
    zygote recognises (a module, a script, torchrun of either; ``tests/zygote.py``) is forked
    from it instead of started afresh: the same code runs, the imports are paid once per worker
    (``forked=False``, or ``ENGRAM_TEST_ZYGOTE=0`` for the whole run, starts it as a user does)."""
    ranks = kwargs.pop("ranks", None) or ranks_of(cmd)
    forked = kwargs.pop("forked", True)
    with cpu_slots(ranks):
        cmd = _port_picked_now(cmd)
        command = _zygote_command(cmd, kwargs) if forked else None
        started, cpu = time.perf_counter(), children_cpu_seconds()
        if command is not None:
            proc, used = _run_in_zygote(cmd, command, kwargs)
            record(cmd, ranks, time.perf_counter() - started, used)
            return proc
        try:
            return subprocess.run(cmd, **kwargs)
        finally:
            record(cmd, ranks, time.perf_counter() - started, children_cpu_seconds() - cpu)


def torchrun(script: str, nproc: int, out_dir: Path, *args: str, timeout: int = 600,
             forked: bool = True) -> list[dict]:
    """Launch ``tests/dist/<script>`` on ``nproc`` processes; return each rank's result dict.

    Each rank writes ``<out_dir>/rank<r>.json``; a non-zero exit fails with the log tail.
    ``forked``: ranks forked from a launcher that imported torch and megatron-core once
    (``tests/forked_torchrun.py``); ``False`` starts them as ``torchrun`` does, a fresh
    interpreter each (for scripts whose subject is how a rank's process ends).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    launcher = [str(Path(__file__).parent / "forked_torchrun.py")] if forked else [
        "-m", "torch.distributed.run"]
    cmd = [
        sys.executable, *launcher,
        f"--nproc-per-node={nproc}", f"--master-port={free_port()}",  # picked again under the slots
        str(DIST_DIR / script), "--out", str(out_dir), *args,
    ]
    proc = run_process(cmd, ranks=nproc, forked=forked, env=env, capture_output=True,
                       text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(
            f"torchrun {script} failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        )
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nproc)]


def trainer_metrics(nproc: int, exp: Path, *overrides: str) -> dict[int, dict]:
    """The trainer (``engram_train.train``) on ``nproc`` processes with the Hydra
    ``overrides``, its log in ``exp``: each iteration's metrics.jsonl record."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={free_port()}", "-m", "engram_train.train", *overrides,
           f"experiment.exp_dir={exp}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = run_process(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    records = [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    return {r["iteration"]: r for r in records}

"""One process per pytest worker that has imported torch, megatron-core and the project once,
and forks the launches of that worker's tests from there.

A launch started the usual way begins with a fresh interpreter importing torch and
megatron-core (about 5 s of CPU, and once more per rank under the ``torchrun`` command line).
The tests start about a hundred launches; paid each time, the imports were a third of the
suite's CPU. The zygote pays them once: ``tests/launch.py`` hands it a command it recognises
(``python -m torch.distributed.run [opts] -m MODULE|SCRIPT ARGS``, ``python -m MODULE ARGS``,
``python SCRIPT ARGS``, ``python tests/forked_torchrun.py ...``), and it forks a child that sets
the command's working directory, environment and ``sys.argv``, redirects its output to files
the test reads, and runs it: a module or script as ``__main__``, a torchrun command through
torch's elastic launcher with forked ranks (``tests/forked_torchrun.py``). What runs is the
same code the command line runs; only the interpreter start is shared. Anything else (``bash``,
``python -c``, a command that needs its own stdin) starts as a subprocess as before.

Safe to fork: the zygote imports, then waits on its pipe; it never runs a torch op or starts a
thread (torch's pools and gloo's threads appear in the children only). ``OMP_NUM_THREADS=1``
is fixed at its start, as every launch of the suite sets it (libgomp reads it when it loads).

Protocol (JSON lines): request ``{"argv", "cwd", "env", "out", "err"}`` on the zygote's stdin;
replies ``{"pid"}`` once forked, then ``{"status", "cpu"}`` (wait status, CPU seconds of the
child and its reaped descendants) once it ended.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent

# Imported once in the zygote; ``engram_train.train`` itself is not (runpy runs it as __main__).
PRELOAD = (
    "torch", "torch.distributed", "torch.distributed.launcher.api", "numpy", "hydra", "omegaconf",
    "safetensors", "megatron.core", "megatron.core.parallel_state", "megatron.core.models.gpt",
    "megatron.core.optimizer", "megatron.core.distributed", "megatron.core.dist_checkpointing",
    "megatron.core.pipeline_parallel", "megatron.core.transformer",
    "engram_train.runtime", "engram_train.models.builder", "engram_train.checkpoint",
    "engram_train.training.step", "engram_train.config",
)
# Imported when present: the trainer's loss plot and TensorBoard writer (the plot backend is
# the trainer's own, Agg).
OPTIONAL = ("matplotlib.pyplot", "torch.utils.tensorboard")

_TORCHRUN_VALUE_FLAGS = {"--nproc-per-node", "--nproc_per_node", "--master-port", "--master_port",
                         "--nnodes", "--node-rank", "--node_rank", "--master-addr", "--master_addr"}


def parse(argv: list[str]) -> dict | None:
    """What a command (without the interpreter) runs, or None when the zygote cannot run it."""
    if not argv:
        return None
    if argv[:2] == ["-m", "torch.distributed.run"] or (argv[0].endswith("forked_torchrun.py")):
        rest = argv[2:] if argv[0] == "-m" else argv[1:]
        options: dict[str, str] = {}
        while rest and rest[0].startswith("--"):
            flag, _, value = rest[0].partition("=")
            if flag not in _TORCHRUN_VALUE_FLAGS:
                return None
            if not value:
                if len(rest) < 2:
                    return None
                value, rest = rest[1], rest[1:]
            options[flag.replace("_", "-")] = value
            rest = rest[1:]
        if options.get("--nnodes", "1") not in ("1", "1:1") or options.get("--node-rank", "0") != "0":
            return None
        if not rest:
            return None
        nproc = int(options.get("--nproc-per-node", "1"))
        port = int(options.get("--master-port", "29500"))
        if rest[0] == "-m":
            if len(rest) < 2:
                return None
            return dict(kind="torchrun", nproc=nproc, port=port, module=rest[1], args=rest[2:])
        if not _in_repo(rest[0]):
            return None
        return dict(kind="torchrun", nproc=nproc, port=port, script=rest[0], args=rest[1:])
    if argv[0] == "-m" and len(argv) >= 2:
        return dict(kind="module", module=argv[1], args=argv[2:])
    if argv[0].endswith(".py") and _in_repo(argv[0]):
        return dict(kind="script", script=argv[0], args=argv[1:])
    return None


def _in_repo(script: str) -> bool:
    """The project's own scripts only: one written elsewhere may test an interpreter without
    the project (the exported folder's loader) and gets a fresh one."""
    return Path(script).resolve().is_relative_to(REPO)


# --- the zygote's side -------------------------------------------------------------------------


def _child(request: dict) -> None:
    """In the forked child: become the command, then exit as an interpreter would."""
    os.setsid()  # the test can kill the whole launch (ranks included) on a timeout
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    code = 1
    try:
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        for fd, path in ((1, request["out"]), (2, request["err"])):
            handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(handle, fd)
            os.close(handle)
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:0] = [p for p in extra if p not in sys.path]
        code = _run(request["command"])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
            _reap_children()
        finally:
            os._exit(code)


def _reap_children() -> None:
    """Wait for every child left (ranks the launcher ended but did not reap), so that the CPU
    time the zygote reads for this launch includes theirs."""
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def _run(command: dict) -> int:
    kind = command["kind"]
    if kind == "torchrun":
        import forked_torchrun  # imported by `serve` already, from the tests folder on its path

        target = command.get("module") or command["script"]
        forked_torchrun.launch(command["nproc"], command["port"], target, command["args"],
                               module="module" in command)
        return 0
    if kind == "module":
        sys.argv = [command["module"], *command["args"]]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(command["module"], run_name="__main__", alter_sys=True)
        return 0
    script = str(Path(command["script"]).resolve())
    sys.argv = [script, *command["args"]]
    sys.path.insert(0, str(Path(script).parent))
    runpy.run_path(script, run_name="__main__")
    return 0


def serve() -> None:
    """Import, then fork one child per request read from stdin, one at a time."""
    import importlib

    sys.path[:0] = [str(REPO), str(TESTS)]
    from engram_train.logs import quiet_known_warnings

    quiet_known_warnings()
    from engram_train.runtime.cpu_compat import end_with_parent

    # ends with its pytest worker, even if a fork of the worker that inherited the worker's
    # end of the request pipe outlives it
    end_with_parent(os.getppid())
    for name in PRELOAD:
        importlib.import_module(name)
    with contextlib.suppress(ImportError):
        import matplotlib

        matplotlib.use("Agg")
    for name in OPTIONAL:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    import forked_torchrun  # noqa: F401  (the launcher the children use)

    import gc

    gc.collect()
    gc.freeze()  # children share the imported objects' pages instead of touching them
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # nothing else may write to the reply pipe
    replies.write(json.dumps({"ready": os.getpid()}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        replies.write(json.dumps({"pid": pid}) + "\n")
        _, status, usage = os.wait4(pid, 0)
        replies.write(json.dumps({"status": status, "cpu": usage.ru_utime + usage.ru_stime}) + "\n")


# --- the pytest worker's side ------------------------------------------------------------------


class Zygote:
    """The client a pytest worker keeps: starts the zygote on first use, one launch at a time."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def _start(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
            self._proc = subprocess.Popen([sys.executable, __file__, "--serve"], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                          env=env, cwd=str(REPO), text=True, bufsize=1)
            ready = self._proc.stdout.readline()
            if not ready:
                raise RuntimeError("the test zygote did not start (run `python tests/zygote.py --serve`)")
            atexit.register(self.close)
        return self._proc

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.stdin.close()
            self._proc.wait(timeout=30)

    def run(self, command: dict, cwd: str, env: dict, out: Path, err: Path,
            timeout: float | None) -> tuple[int | None, float]:
        """(exit code, CPU seconds); exit code None after a timeout (the launch was killed)."""
        with self._lock:
            proc = self._start()
            request = dict(command=command, cwd=cwd, env=env, out=str(out), err=str(err))
            proc.stdin.write(json.dumps(request) + "\n")
            proc.stdin.flush()
            pid = json.loads(proc.stdout.readline())["pid"]
            ready, _, _ = select.select([proc.stdout], [], [], timeout)
            timed_out = not ready
            if timed_out:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError("the test zygote died during a launch")
            reply = json.loads(line)
            if timed_out:
                return None, reply["cpu"]
            return os.waitstatus_to_exitcode(reply["status"]), reply["cpu"]


if __name__ == "__main__":
    if sys.argv[1:] != ["--serve"]:
        sys.exit("usage: python tests/zygote.py --serve  (started by tests/launch.py)")
    serve()

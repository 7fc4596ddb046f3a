"""Run a script under real torchrun (gloo on CPU) and collect the JSON each rank writes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

DIST_DIR = Path(__file__).parent / "dist"
REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: str, nproc: int, out_dir: Path, *args: str, timeout: int = 600) -> list[dict]:
    """Launch ``tests/dist/<script>`` on ``nproc`` processes; return each rank's result dict.

    Each rank writes ``<out_dir>/rank<r>.json``; a non-zero exit fails with the log tail.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc-per-node={nproc}", f"--master-port={free_port()}",
        str(DIST_DIR / script), "--out", str(out_dir), *args,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(
            f"torchrun {script} failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        )
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nproc)]

"""Pieces every benchmark script shares (they run as ``python benchmarks/<name>.py``)."""

from __future__ import annotations

import json
import socket
from pathlib import Path


def write_result(out: Path, result: dict) -> None:
    """The benchmark's JSON result at ``out`` (its folder created), and where it went."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written {out}")


def free_port() -> int:
    """A TCP port free right now, for a rendezvous on this host."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

"""Damaging a checkpoint file the way a bad disk or a killed copy does (test helper)."""

from __future__ import annotations

import os
import random
from pathlib import Path


def corrupt(path: Path, *, truncate: bool = False, seed: int = 0) -> None:
    """64 KiB of random bytes in the middle of the file (same size), or cut it in half."""
    size = path.stat().st_size
    if truncate:
        os.truncate(path, size // 2)
        return
    with open(path, "r+b") as f:
        f.seek(size // 2)
        f.write(random.Random(seed).randbytes(65536))
    assert path.stat().st_size == size

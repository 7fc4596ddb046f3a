"""Output folders: the write probe a command runs before its work.

Plain ``os`` only, first in the package order, so every command (preprocessing, the trainer's
checks, export, logits) refuses an unwritable output before it spends time it could not keep.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def probe_write(folder: str | os.PathLike) -> None:
    """Create ``folder`` if needed and write and remove a probe file in it; raises the
    ``OSError`` a later write there would meet (read-only mount, no permission, a file in the
    way)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    fd, probe = tempfile.mkstemp(prefix=".write-check-", dir=folder)
    os.close(fd)
    os.remove(probe)

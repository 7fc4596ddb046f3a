"""Export formats, and the one way every format's folder reaches ``--out``.

``FORMATS`` is the table ``engram-export --format`` chooses from: a name, its writer (imported on
use, so that the command line loads only the chosen format) and the options it takes. Each
writer fills a folder; `publish` does the rest the same way for all: ``--out`` is checked first
(`check_out`: never a checkpoint, and ``--force`` replaces only a previous export, recognised by
its ``MARKER`` file), the folder is written as ``.<out>.<pid>.<random>.partial`` next to
``--out``, every file and the folder are fsynced, and one rename puts it in place. Partial
folders of the same target left by an interrupted export (its process gone) are removed first.
The marker records every file's size and SHA-256; `verify_export` (``engram-export --check
DIR``) names each file changed, missing or added since (a modified ``modeling_*.py`` would run
with ``trust_remote_code=True``). Messages go to stderr.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engram_train.checkpoint.layout import MANIFEST, TRACKER, fsync_dir
from engram_train.checkpoint.lock import process_alive
from engram_train.export.export_errors import ExportError
from engram_train.output_paths import probe_write

# Written into every export: what --force may replace.
MARKER = ".engram-export.json"
_MEGATRON_METADATA = "metadata.json"
_ITER_ENTRY = re.compile(r"^iter_\d{7,}")


@dataclass(frozen=True)
class ExportFormat:
    """One ``--format``: its writer ``module:function`` and the options only it takes."""

    name: str
    writer: str
    description: str
    options: tuple[str, ...] = ()

    def load(self) -> Callable:
        module, _, function = self.writer.partition(":")
        return getattr(importlib.import_module(module), function)


FORMATS = {
    f.name: f
    for f in (
        ExportFormat("engram", "engram_train.export.exporter:export_checkpoint",
                     "this project's inference export (docs/export.md)", options=("table_dtype",)),
        ExportFormat("hf", "engram_train.export.hf_export:export_hf",
                     "a transformers model folder (docs/huggingface.md)", options=("hf_layout",)),
    )
}


def stderr_log(message: str) -> None:
    print(f"engram-export: {message}", file=sys.stderr, flush=True)


def is_checkpoint_folder(path: Path) -> bool:
    """A ``checkpoint.save`` folder (tracker or ``iter_*`` entries) or one iteration's folder."""
    if not path.is_dir():
        return False
    if (path / TRACKER).exists() or (path / _MEGATRON_METADATA).is_file() or _ITER_ENTRY.match(path.name):
        return True
    if (path / MANIFEST).is_file() and not (path / MARKER).exists():
        return True
    try:
        return any(_ITER_ENTRY.match(p.name) for p in path.iterdir())
    except OSError:
        return False


def _within(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def check_out(out: str | os.PathLike, load: str | os.PathLike, *, force: bool) -> Path:
    """Refuse an ``--out`` that would lose data; returns it. An export never replaces, holds or
    lies inside a checkpoint folder or the ``--load`` folder, and ``--force`` replaces only a
    folder an earlier export wrote (it holds ``MARKER``)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} exists and is not a directory")
    target, source = out.resolve(), Path(load).resolve()
    if _ITER_ENTRY.match(source.name) and is_checkpoint_folder(source.parent):
        source = source.parent  # one iteration's folder: its whole checkpoint.save folder
    if _within(target, source) or _within(source, target):
        relation = "is" if target == source else ("lies inside" if _within(target, source) else "contains")
        raise ExportError(
            f"--out {out} {relation} the checkpoint folder {source} that --load reads; an export "
            "never writes there (--force included): choose an --out outside it"
        )
    for folder in (target, *target.parents):
        if is_checkpoint_folder(folder):
            where = "is" if folder == target else f"lies inside the checkpoint folder {folder}, so it"
            raise ExportError(
                f"--out {out} {where} a checkpoint folder; an export never writes there (--force "
                "included): choose an --out outside it"
            )
    try:
        probe_write(out.parent)
    except OSError as e:
        raise ExportError(f"--out {out}: cannot write in {out.parent} ({e.strerror or e}); choose an "
                          "--out in a folder this process can write to") from None
    if not (out.is_dir() and any(out.iterdir())):
        return out
    if not (out / MARKER).is_file():
        raise ExportError(
            f"--out {out} is not empty and is not an earlier export (it has no {MARKER}): choose "
            "another --out, or empty it yourself (--force replaces only an earlier export)"
        )
    for dirpath, dirnames, _ in os.walk(out):
        for name in dirnames:
            if is_checkpoint_folder(Path(dirpath) / name):
                raise ExportError(f"--out {out} contains the checkpoint folder {Path(dirpath) / name}; "
                                  "an export never replaces one: choose another --out")
    if not force:
        raise ExportError(f"--out {out} holds an earlier export; pass --force to replace it")
    return out


def _stale(out: Path) -> list[Path]:
    """Partial folders (and set-aside old exports) of ``out`` whose process is gone."""
    pattern = re.compile(rf"^\.{re.escape(out.name)}\.(?:(\d+)\.)?[A-Za-z0-9_]+\.(partial|old)$")
    found = []
    for path in out.parent.iterdir() if out.parent.is_dir() else ():
        m = pattern.match(path.name)
        if m and path.is_dir() and not (m.group(1) and process_alive(int(m.group(1)))):
            found.append(path)
    return found


def _fsync_tree(folder: Path) -> None:
    for dirpath, _, filenames in os.walk(folder):
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(dirpath)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def publish(out: str | os.PathLike, format_name: str, write: Callable[[Path], None],
            log: Callable[[str], None] = stderr_log) -> Path:
    """Run ``write(folder)`` into a temporary folder next to ``out`` and rename it to ``out``
    once complete and durable (an earlier export there, checked by `check_out`, is swapped
    out only then). A failure leaves ``out`` as it was and no temporary folder."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for path in _stale(out):
        shutil.rmtree(path, ignore_errors=True)
        log(f"removed {path}, left by an interrupted export")
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.{os.getpid()}.", suffix=".partial", dir=out.parent))
    try:
        write(tmp)
        marker = {"written_by": "engram-export", "format": format_name, "files": file_digests(tmp)}
        (tmp / MARKER).write_text(json.dumps(marker, indent=1, sort_keys=True) + "\n")
        _fsync_tree(tmp)
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp made it private
        old = None
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.{os.getpid()}.", suffix=".old", dir=out.parent))
            os.replace(out, old / out.name)
        os.replace(tmp, out)
        fsync_dir(out.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# Written by tools that read an export, not by it: not reported as added files.
_NOT_EXPORTED = ("__pycache__", ".cache", MARKER)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(folder: Path) -> list[str]:
    found = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if d not in _NOT_EXPORTED)
        found += [Path(dirpath, n).relative_to(folder).as_posix() for n in filenames
                  if n not in _NOT_EXPORTED]
    return sorted(found)


def file_digests(folder: Path) -> dict[str, dict]:
    """``{relative path: {"size", "sha256"}}`` of every file of an export folder (the marker,
    ``__pycache__`` and ``.cache`` left out)."""
    return {name: {"size": (folder / name).stat().st_size, "sha256": _sha256(folder / name)}
            for name in _files(folder)}


def verify_export(folder: str | os.PathLike) -> int:
    """Check every file of export `folder` against the sizes and SHA-256 its marker recorded;
    returns how many files match. `ExportError` (one line) names each file changed, missing or
    added since the export, and the marker's absence or an export written before it recorded
    hashes."""
    folder = Path(folder)
    marker_file = folder / MARKER
    if not marker_file.is_file():
        raise ExportError(f"{folder} is not an export: it has no {MARKER} (engram-export writes one)")
    try:
        recorded = json.loads(marker_file.read_text()).get("files")
    except (ValueError, AttributeError) as err:
        raise ExportError(f"{marker_file} is damaged ({err}): re-export the folder") from None
    if not isinstance(recorded, dict):
        raise ExportError(f"{marker_file} records no file hashes (written by an older engram-export): "
                          "its files cannot be checked; re-export the folder to record them")
    problems = []
    for name, entry in sorted(recorded.items()):
        path = folder / name
        if not path.is_file():
            problems.append(f"{name} missing")
        elif path.stat().st_size != entry.get("size"):
            problems.append(f"{name} changed ({path.stat().st_size} bytes, {entry.get('size')} recorded)")
        elif (digest := _sha256(path)) != entry.get("sha256"):
            problems.append(f"{name} changed (sha256 {digest[:12]}..., {str(entry.get('sha256'))[:12]}... "
                            "recorded)")
    problems += [f"{name} added" for name in _files(folder) if name not in recorded]
    if problems:
        raise ExportError(
            f"export {folder} does not match the SHA-256 its {MARKER} recorded: "
            + "; ".join(problems) + ". Do not load it (a changed modeling_*.py runs with "
            "trust_remote_code=True): restore the files, or export the checkpoint again with --force")
    return len(recorded)

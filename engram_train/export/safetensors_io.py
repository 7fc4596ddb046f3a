"""safetensors files written piece by piece and read as memory maps.

The layout of a file (names, dtypes, shapes, byte ranges) depends only on its tensor specs, so
it is fixed before any data is read: the writer lays the file out and the caller copies each
checkpoint shard straight into its place through a map of just that block. Peak memory is one
shard, whatever the size of the tensor. Tensors are ordered by element size (largest first),
then name, and the data starts on a 64-byte boundary, so every tensor is aligned to its element
size: readers can view it in place (the safetensors library orders files the same way).

Reading maps the file (`torch.from_file`, copy-on-write): a table of any size costs address
space, and pages are read from the page cache only where rows are gathered.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from engram_train.errors import EngramError, InputTypeError

DATA_ALIGNMENT = 64
_HEADER_LIMIT = 100_000_000  # the safetensors library refuses larger headers


class SafetensorsError(EngramError, ValueError):
    """A file that is not a well-formed safetensors file, or a write that does not fit its
    header (names the file or tensor)."""

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e8m0fnu: "F8_E8M0",
}
DTYPES: dict[str, torch.dtype] = {name: dtype for dtype, name in DTYPE_NAMES.items()}


@dataclass(frozen=True)
class TensorSpec:
    """What a file will hold under `name`, known before its data is read."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)


@dataclass(frozen=True)
class TensorEntry:
    """A tensor of a safetensors file: absolute byte range [start, end) in the file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise InputTypeError(f"dtype {dtype} has no safetensors name; supported: "
                        f"{sorted(DTYPE_NAMES.values())}") from None


def layout(specs: Iterable[TensorSpec], metadata: Mapping[str, str] | None = None
           ) -> tuple[bytes, dict[str, TensorEntry]]:
    """The header bytes (length prefix included) and each tensor's absolute byte range."""
    specs = list(specs)
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        duplicates = sorted({n for n in names if names.count(n) > 1})
        raise SafetensorsError(f"duplicate tensor names: {duplicates}")
    ordered = sorted(specs, key=lambda s: (-_itemsize(s.dtype), s.name))
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset, relative = 0, {}
    for spec in ordered:
        relative[spec.name] = (offset, offset + spec.nbytes)
        header[spec.name] = {
            "dtype": _dtype_name(spec.dtype),
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    padded = -(-(8 + len(text)) // DATA_ALIGNMENT) * DATA_ALIGNMENT - 8
    text += b" " * (padded - len(text))  # spaces after the JSON: allowed by the format
    if len(text) > _HEADER_LIMIT:
        raise SafetensorsError(f"safetensors header of {len(text)} bytes exceeds {_HEADER_LIMIT}")
    data_start = 8 + len(text)
    entries = {
        s.name: TensorEntry(s.name, s.dtype, tuple(s.shape), data_start + relative[s.name][0],
                            data_start + relative[s.name][1])
        for s in specs
    }
    return struct.pack("<Q", len(text)) + text, entries


class SafetensorsWriter:
    """A safetensors file of known tensors, filled in any order through memory maps.

    `region(name, offsets, lengths)` maps just the bytes of that block of the tensor and yields
    it as a writable tensor (the tensor's dtype, a strided view for blocks that do not span
    whole rows); what is copied into it lands in the file, and the map is dropped on exit, so
    written pages count against the page cache, not the process. Every byte of every tensor
    must be written by the caller (the file starts zeroed). `close()` fsyncs.
    """

    def __init__(self, path: str | os.PathLike, specs: Iterable[TensorSpec],
                 metadata: Mapping[str, str] | None = None) -> None:
        self.path = Path(path)
        header, self.entries = layout(specs, metadata)
        self.size = max((e.end for e in self.entries.values()), default=len(header))
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(self._fd, header)
        os.ftruncate(self._fd, self.size)

    @contextlib.contextmanager
    def region(self, name: str, offsets: Sequence[int] | None = None,
               lengths: Sequence[int] | None = None) -> Iterator[torch.Tensor]:
        """Writable view of `tensor[offsets : offsets + lengths]` (default: all of it). Keep no
        reference to it after the `with` block: the map closes there."""
        entry = self.entries[name]
        shape = entry.shape
        offsets = tuple(offsets) if offsets is not None else (0,) * len(shape)
        lengths = tuple(lengths) if lengths is not None else shape
        if len(offsets) != len(shape) or len(lengths) != len(shape) or any(
            o < 0 or n < 0 or o + n > d for o, n, d in zip(offsets, lengths, shape)
        ):
            raise SafetensorsError(f"{name}: block at {offsets} of size {lengths} is outside {shape}")
        if math.prod(lengths) == 0:
            yield torch.empty(lengths, dtype=entry.dtype)
            return
        item = _itemsize(entry.dtype)
        strides = [1] * len(shape)
        for dim in range(len(shape) - 2, -1, -1):
            strides[dim] = strides[dim + 1] * shape[dim + 1]
        first = sum(o * s for o, s in zip(offsets, strides))
        last = sum((o + n - 1) * s for o, n, s in zip(offsets, lengths, strides))
        byte_start = entry.start + first * item
        map_start = byte_start - byte_start % mmap.ALLOCATIONGRANULARITY
        mapping = mmap.mmap(self._fd, entry.start + (last + 1) * item - map_start,
                            offset=map_start)
        try:
            raw = torch.frombuffer(mapping, dtype=torch.uint8)[byte_start - map_start:]
            view = raw.view(entry.dtype).as_strided(lengths, strides)
            del raw
            yield view
            del view
        finally:
            mapping.close()  # BufferError here means a caller kept a view

    def write(self, name: str, value: torch.Tensor) -> None:
        """Copy a whole tensor (cast to the file's dtype)."""
        if tuple(value.shape) != self.entries[name].shape:
            raise SafetensorsError(f"{name}: value of shape {tuple(value.shape)} for a tensor of shape "
                             f"{self.entries[name].shape}")
        with self.region(name) as target:
            target.copy_(value)

    def close(self) -> None:
        if self._fd is None:
            return
        try:
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_header(path: str | os.PathLike) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """Entries (absolute byte ranges) and `__metadata__` of a safetensors file."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise SafetensorsError(f"{path} is not a safetensors file: shorter than 8 bytes")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(_HEADER_LIMIT, size - 8):
            raise SafetensorsError(f"{path} is not a safetensors file: header length {length} "
                             f"does not fit the file ({size} bytes)")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise SafetensorsError(f"{path} is not a safetensors file: bad header ({err})") from None
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + length
    entries = {}
    for name, info in header.items():
        if info["dtype"] not in DTYPES:
            raise SafetensorsError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        dtype, shape = DTYPES[info["dtype"]], tuple(int(d) for d in info["shape"])
        if end - begin != math.prod(shape) * _itemsize(dtype) or data_start + end > size:
            raise SafetensorsError(f"{path}: tensor {name} has a byte range [{begin}, {end}) that does "
                             f"not match its shape {shape} and dtype or the file size")
        entries[name] = TensorEntry(name, dtype, shape, data_start + begin, data_start + end)
    return entries, metadata


class MappedSafetensors:
    """Read-only memory map of a safetensors file; `tensor(name)` views it without copying.

    Views are copy-on-write mappings: reading costs page-cache pages only where touched, and
    writing to a view never reaches the file. Tensors stay valid after the object is dropped.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.entries, self.metadata = read_header(self.path)
        size = self.path.stat().st_size
        self._buffer = torch.from_file(str(self.path), shared=False, size=size, dtype=torch.uint8)

    def keys(self) -> list[str]:
        return list(self.entries)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def tensor(self, name: str) -> torch.Tensor:
        try:
            entry = self.entries[name]
        except KeyError:
            raise KeyError(f"{self.path} has no tensor {name!r}; it has {sorted(self.entries)}"
                           ) from None
        raw = self._buffer[entry.start:entry.end]
        if entry.start % _itemsize(entry.dtype):
            raw = raw.clone()  # written by another tool without alignment: copy this one
        return raw.view(entry.dtype).view(entry.shape)


def shard_groups(items: Sequence, max_bytes: int, first_bytes: int = 0) -> list[list]:
    """Consecutive groups of ``items`` (each with ``nbytes``) of at most ``max_bytes`` per file,
    the first file already holding ``first_bytes``; a larger item gets a file of its own. Always
    at least one group (empty when there are no items)."""
    groups: list[list] = [[]]
    size = first_bytes
    for item in items:
        if groups[-1] and size + item.nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += item.nbytes
    return groups

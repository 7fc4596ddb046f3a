"""The tensors of a transformers model folder, read one at a time (``engram-import-hf``; a
family's reader of another storage layout derives from `HFFolder`).

``model.safetensors.index.json`` says which file holds a tensor; without an index the weights
are ``model.safetensors`` alone when the folder has it (as transformers reads such a folder:
other safetensors beside it, a logits dump or an adapter, are ignored and named), else every
``*.safetensors`` file. Each tensor is read alone from its file's memory map. Block-scaled fp8 weights
(DeepSeek-V3's released format: ``<name>`` in float8_e4m3fn with ``<name>_scale_inv`` per
128 x 128 block) are dequantized on the fly, so memory holds one tensor at a time.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from engram_train.errors import EngramError

SCALE_SUFFIX = "_scale_inv"
SINGLE_FILE = "model.safetensors"


class HFSourceError(EngramError, ValueError):
    """A folder this import cannot read; the message names the file or tensor."""


def open_safetensors(path: Path):
    """``safe_open(path)``; a file safetensors cannot read (truncated by an interrupted
    download or copy, or not safetensors at all) raises `HFSourceError` naming it."""
    try:
        return safe_open(str(path), "pt")
    except Exception as err:  # safetensors' SafetensorError (Rust), or an OSError
        size = path.stat().st_size if path.is_file() else 0
        raise HFSourceError(
            f"{path} ({size} bytes) is truncated or damaged: safetensors cannot read it "
            f"({str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}); "
            "download or copy it again") from None


class HFFolder:
    """Names and lazily read tensors of a transformers checkpoint folder."""

    def __init__(self, folder: str | Path, block_size: tuple[int, int] = (128, 128)) -> None:
        self.folder = Path(folder)
        self.ignored: list[str] = []  # safetensors files beside model.safetensors, not read
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as err:
                raise HFSourceError(f"{index} is damaged or not a safetensors index ({err}): restore "
                                    "it from the model's source") from None
            self.files = {k: self._inside(v, f"{index.name}: weight_map entry {k!r} -> {v!r}")
                          for k, v in weight_map.items()}  # fmt: skip
        else:
            self.files = {}
            paths = sorted(self.folder.glob("*.safetensors"))
            single = self.folder / SINGLE_FILE
            if single.is_file():  # transformers' unsharded weights: the others are not read
                self.ignored = [p.name for p in paths if p.name != SINGLE_FILE]
                paths = [single]
            for path in paths:
                self._inside(path.name, f"weight file {path.name!r}")
                with open_safetensors(path) as f:
                    self.files.update({k: path for k in f.keys()})
        if not self.files:
            raise HFSourceError(f"{self.folder} holds no safetensors weights")
        self.block_size = tuple(block_size)
        self._open: dict[Path, object] = {}
        self.warnings: list[str] = []  # what a family's reader found odd (logged by the import)

    def _inside(self, name: str, what: str) -> Path:
        """``folder / name``, refused unless it resolves (symlinks followed) inside the folder,
        or, in a Hugging Face cache snapshot (``<repo>/snapshots/<rev>/``), into the same
        repository's ``blobs/``: an index must not make the import read other files."""
        root = self.folder.resolve()
        allowed = [root]
        if root.parent.name == "snapshots":
            allowed.append(root.parent.parent / "blobs")
        resolved = (root / name).resolve()
        if Path(name).is_absolute() or not any(resolved.is_relative_to(a) for a in allowed):
            raise HFSourceError(f"{what} resolves to {resolved}, outside {self.folder}: weight files "
                                "must lie inside the model folder")
        return self.folder / name

    def ignored_files_notes(self) -> list[str]:
        """The line that names the safetensors files not read (none: no line)."""
        if not self.ignored:
            return []
        return [f"ignored {', '.join(self.ignored)} in {self.folder}: without "
                f"model.safetensors.index.json the weights are {SINGLE_FILE} alone, as "
                "transformers reads the folder"]

    def close(self) -> None:
        """Drop the files' memory maps (their touched pages count as this process's memory)."""
        self._open.clear()

    def names(self) -> list[str]:
        """Tensor names, fp8 scales left out (they belong to their weight)."""
        return [k for k in self.files if not k.endswith(SCALE_SUFFIX)]

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def _handle(self, path: Path):
        if path not in self._open:
            if not path.is_file():
                raise HFSourceError(f"{path} is named by the index but missing")
            self._open[path] = open_safetensors(path)
        return self._open[path]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(self.files[name]).get_slice(name).get_shape())

    def read_block(self, name: str, start: tuple[int, ...], size: tuple[int, ...]) -> torch.Tensor:
        """``tensor[start : start + size]`` in float32, read alone (safetensors ``get_slice``:
        only those bytes leave the file); fp8 blocks are dequantized with their scales' block."""
        box = tuple(slice(int(a), int(a) + int(n)) for a, n in zip(start, size))
        value = self._handle(self.files[name]).get_slice(name)[box]
        if value.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            return value.float()
        scale_name = name + SCALE_SUFFIX
        if scale_name not in self.files:
            raise HFSourceError(f"{name} is fp8 but {scale_name} is missing")
        full = self.shape(name)
        expected = tuple(-(-d // b) for d, b in zip(full, self.block_size))
        scales = self._handle(self.files[scale_name]).get_slice(scale_name)
        if tuple(scales.get_shape()) != expected:
            raise HFSourceError(f"fp8 weight {full} with scales {tuple(scales.get_shape())}; "
                                f"blocks of {self.block_size} need {expected}")
        (r0, c0), (rows, cols), (b0, b1) = start, size, self.block_size
        scale = scales[r0 // b0: (r0 + rows - 1) // b0 + 1, c0 // b1: (c0 + cols - 1) // b1 + 1]
        scale = scale.float().repeat_interleave(b0, 0).repeat_interleave(b1, 1)
        return value.float() * scale[r0 % b0: r0 % b0 + rows, c0 % b1: c0 % b1 + cols]

    def read(self, name: str) -> torch.Tensor:
        """The tensor in float32 (fp8 weights dequantized with their block scales)."""
        value = self._handle(self.files[name]).get_tensor(name)
        if value.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            scale_name = name + SCALE_SUFFIX
            if scale_name not in self.files:
                raise HFSourceError(f"{name} is fp8 but {scale_name} is missing")
            scale = self._handle(self.files[scale_name]).get_tensor(scale_name)
            return dequantize(value, scale, self.block_size)
        return value.float()


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """fp8 [out, in] x per-block scales [ceil(out/b0), ceil(in/b1)] -> float32."""
    rows, cols = weight.shape
    expected = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != expected:
        raise HFSourceError(f"fp8 weight {tuple(weight.shape)} with scales {tuple(scale_inv.shape)}; "
                            f"blocks of {block} need {expected}")
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * scale

"""``engram-export --format hf`` of a family whose released folder stores converted tensors
(DeepSeek-V4.1's: ``models/deepseek_v41/hf/v41_hf_export.py``), i.e. the folder layout
``engram-import-hf`` reads back. The family's `ReleasedLayout` (``models/hf_mapping.py``)
gives the released names of each checkpoint tensor (its pieces), the tensors written beside
them as values, ``config.json``, and `encode`: the one place that turns a float tensor into
what the folder stores (a dtype per name; with ``quantized``, ``engram-export``'s default
``--hf-layout released``, quantized blocks with their scale tensors; ``--hf-layout bf16``: no
quantization; ``dtype`` float32 keeps all of them float32). The tensors go to
``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``; the tokenizer is
copied. `encode` accepts meta tensors (the files' layout is planned from shapes) and is
separable over row blocks of 32 rows (large tensors are converted a row block at a time, each
output written after the rows the earlier blocks gave it). An fp8 Engram table
(``engram_table_dtype: fp8_e4m3``) goes through with its stored codes and the family's
scales when the layout is quantized.

Streaming: one released tensor (or one row block of a large one) is read from the checkpoint's
stored chunks, converted and copied into a memory map of its output file at a time. The folder
is written next to ``--out`` and renamed into place once complete (``publish``): a failure
leaves nothing.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from engram_train.engram.fp8_table import FP8_DTYPE, dequantize_rows
from engram_train.export.checkpoint_reader import DistCheckpointReader
from engram_train.export.export_errors import ExportError
from engram_train.export.hf_files import FILE_METADATA, shard_file, write_index, write_tokenizer
from engram_train.export.publish import publish
from engram_train.export.safetensors_io import SafetensorsWriter, TensorSpec, shard_groups
from engram_train.models.hf_mapping import HFConfigError, Piece, ReleasedLayout, UnmappedTensorError

TABLE_WEIGHT = ".engram.multi_head_embedding.weight"
TABLE_SCALE = TABLE_WEIGHT + "_scale"  # an fp8 table's E8M0 scales (engram/fp8_table.py)
ROW_BLOCK_ELEMENTS = 1 << 26  # large tensors are converted in row blocks of about this size


class _Released:
    """One released tensor: its checkpoint tensor and block (a `Piece`), or a constant;
    `scale_key`: the E8M0 scales of an fp8 Engram table (``engram_table_dtype: fp8_e4m3``)."""

    def __init__(self, key: str | None, piece: Piece | None, name: str, shape: tuple,
                 value: torch.Tensor | None = None, scale_key: str | None = None) -> None:
        self.key, self.piece, self.name, self.shape, self.value = key, piece, name, shape, value
        self.scale_key = scale_key
        self.outputs: list[TensorSpec] = []

    @property
    def nbytes(self) -> int:
        return sum(torch.Size(s.shape).numel() * torch.empty((), dtype=s.dtype).element_size()
                   for s in self.outputs)


def plan_released(reader: DistCheckpointReader, vocab: int, encode: Callable,
                  layout: ReleasedLayout) -> list[_Released]:
    """Every released tensor of the checkpoint, with the output tensors `encode` makes of it
    (planned on meta tensors)."""
    released = []
    for key in reader.model_keys():
        if key.endswith("_extra_state") or key.endswith(TABLE_SCALE):
            continue  # an fp8 table's scales go with its rows
        try:
            pieces = layout.pieces(key, reader.tensors[key].shape, vocab)
        except UnmappedTensorError as err:
            raise ExportError(str(err)) from None
        scale_key = None
        if reader.tensors[key].dtype == FP8_DTYPE:
            scale_key = key + "_scale"
            if not key.endswith(TABLE_WEIGHT) or scale_key not in reader.tensors:
                raise ExportError(f"{key}: an fp8 tensor that is not an Engram table with its "
                                  f"scales ({scale_key})")
        for piece in pieces or ():
            released.append(_Released(key, piece, piece.name, tuple(piece.shape),
                                      scale_key=scale_key))
        for name, value in layout.constants(key, reader.tensors[key].shape):
            released.append(_Released(None, None, name, tuple(value.shape), value))
    for item in released:
        meta = torch.empty(item.shape, dtype=torch.float32, device="meta")
        item.outputs = [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in encode(item.name, meta)]
    return released


def _row_blocks(shape: tuple) -> list[tuple[int, int]]:
    rows = shape[0] if shape else 1
    per_row = max(1, torch.Size(shape[1:]).numel())
    step = max(32, ROW_BLOCK_ELEMENTS // per_row // 32 * 32)
    return [(r, min(step, rows - r)) for r in range(0, rows, step)] if shape else [(0, 1)]


def _block_outputs(reader: DistCheckpointReader, item: _Released, start: int, rows: int,
                   encode: Callable, layout: ReleasedLayout) -> list[tuple[str, torch.Tensor]]:
    """The outputs of rows ``[start, start + rows)`` of `item`: an fp8 table's stored codes
    and scales go through as they are (zero blocks given the release's scale), the rest is
    read as float32 and encoded."""
    if item.value is not None:
        return encode(item.name, item.value if not item.shape else item.value[start:start + rows])
    piece = item.piece
    offsets, sizes = list(piece.start), list(piece.size)
    lead = 1 if piece.squeeze else 0
    offsets[lead] += start
    sizes[lead] = rows
    value = reader.read_region(item.key, offsets, sizes)
    if item.scale_key is not None:
        scale = reader.read_region(item.scale_key, offsets,
                                   [rows, reader.tensors[item.scale_key].shape[1]])
        if len(item.outputs) == 2:  # the released layout stores the table as the trainer does
            return [(item.name, value),
                    (layout.scale_name(item.name), layout.table_scales(value, scale))]
        value = dequantize_rows(value, scale, torch.float32)
    value = value.float()
    value = value[0] if piece.squeeze else value
    if not item.shape:  # a 0-d tensor
        value = value.reshape(())
    return encode(item.name, value)


def write_released(writer: SafetensorsWriter, reader: DistCheckpointReader, item: _Released,
                   encode: Callable, layout: ReleasedLayout) -> None:
    """Read, convert and write `item` a row block at a time."""
    written = [0] * len(item.outputs)  # rows of each output the earlier blocks gave
    for start, rows in _row_blocks(item.shape):
        outputs = _block_outputs(reader, item, start, rows, encode, layout)
        for index, ((name, tensor), spec) in enumerate(zip(outputs, item.outputs)):
            if not spec.shape:
                writer.write(name, tensor)
                continue
            at, written[index] = written[index], written[index] + tensor.shape[0]
            with writer.region(name, [at, *[0] * (len(spec.shape) - 1)],
                               [tensor.shape[0], *spec.shape[1:]]) as target:
                target.copy_(tensor)
                del target


def export_released(out: Path, reader: DistCheckpointReader, run_config: dict, where: str,
                    tokenizer_file: Path, family, *, max_shard_bytes: int,
                    dtype: torch.dtype = torch.bfloat16, log: Callable[[str], None],
                    quantized: bool = False) -> Path:
    """Write the checkpoint of `reader` (its run config `run_config`, found at `where`) of
    model family `family` (``models/families.ModelFamily``, its ``hf.released`` layout) as its
    released folder `out` (module docstring); `quantized`: the layout's quantized form."""
    from engram_train.data import load_tokenizer
    from engram_train.engram.compressed_tokenizer import CompressedTokenizer

    layout = family.hf.released
    model = run_config.get("model", run_config)
    vocab = int(load_tokenizer(tokenizer_file).vocab_size)
    rows = reader.tensors["embedding.word_embeddings.weight"].shape[0]
    if rows < vocab:
        raise ExportError(f"the checkpoint's embedding has {rows} rows, the tokenizer "
                          f"{tokenizer_file} needs {vocab}: pass the run's tokenizer (--tokenizer)")
    compressed = CompressedTokenizer(tokenizer_file).vocab_size if model.get("use_engram") else None

    def encode(name, value):
        try:
            return layout.encode(name, value, dtype, quantized)
        except layout.encode_error as err:
            raise ExportError(str(err)) from None

    try:
        document = layout.config(model, vocab, layout.engram_rows(reader.tensors, model),
                                 compressed, str(dtype).removeprefix("torch."))
        released = plan_released(reader, vocab, encode, layout)
        if quantized:
            document["quantization_config"] = dict(layout.quantization_config)
    except HFConfigError as err:
        raise ExportError(f"{where}: {err}") from None

    def write(folder: Path) -> None:
        groups = shard_groups(released, max_shard_bytes)
        weight_map, total = {}, 0
        for index, group in enumerate(groups, start=1):
            name = shard_file(index, len(groups))
            specs = [spec for item in group for spec in item.outputs]
            with SafetensorsWriter(folder / name, specs, FILE_METADATA) as writer:
                for item in group:
                    write_released(writer, reader, item, encode, layout)
                    total += item.nbytes
            weight_map.update({s.name: name for s in specs})
        write_index(folder, weight_map, total)
        (folder / "config.json").write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
        write_tokenizer(folder, tokenizer_file)

    publish(out, "hf", write, log)
    form = "the released FP8/FP4 layout" if quantized else dtype
    log(f"wrote {out} ({family.name}, {len(released)} tensors, {form}) from {reader.path}")
    return out

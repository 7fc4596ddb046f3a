"""``engram-export --format hf`` of a DeepSeek-V4.1 checkpoint: the folder layout
``engram-import-hf`` reads (``hf/v41_import.py``), i.e. what NeMo Automodel writes for V4.1.

``config.json`` is the composite document (``model_type: deepseek_v41``, ``text_config`` from
the run's model section, ``vision_config`` with no layers; ``hf/v41_config_map.py``); the
tensors carry the released names (``hf/v41_names.py``) in ``model-0000i-of-0000n.safetensors``
with ``model.safetensors.index.json``; the tokenizer is copied. Each layer's ``bias_vl`` (the
router's bias for image tokens, which the text model does not hold) is written as zeros,
NeMo's initial value, so that NeMo loads the folder.

Stored dtypes (`stored_tensors`, the one place that turns a float tensor into what the folder
holds): with ``quantized`` (``engram-export``'s default, ``--hf-layout released``) the
release's layout (``hf/v41_quant_layout.py``: FP8 E4M3 with 32 x 32 E8M0 blocks, packed FP4
experts and FP8 Engram tables with per-row scales, each with its ``.scale`` tensor); the
tensors NeMo keeps in float32 (mHC, sinks, compressor, router bias, head) stay float32, every
other one is bf16 (``--hf-layout bf16``: no quantization; ``dtype`` float32 keeps all of them
float32). It accepts meta tensors (the files' layout is planned from shapes) and is separable
over row blocks of 32 rows (large tensors are converted a row block at a time, each output
written after the rows the earlier blocks gave it).

Streaming: one released tensor (or one row block of a large one) is read from the checkpoint's
stored chunks, converted and copied into a memory map of its output file at a time. The folder
is written next to ``--out`` and renamed into place once complete (``publish``): a failure
leaves nothing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import torch

from engram_train.export.checkpoint_reader import DistCheckpointReader
from engram_train.export.export_errors import ExportError
from engram_train.export.publish import publish
from engram_train.export.safetensors_io import SafetensorsWriter, TensorSpec, shard_groups
from engram_train.hf.config_map import HFConfigError
from engram_train.hf.names import Piece, UnmappedTensorError
from engram_train.hf.v41_config_map import v41_hf_config
from engram_train.hf.v41_names import VISION_BIAS, v41_pieces
from engram_train.engram.fp8_table import FP8_DTYPE, dequantize_rows
from engram_train.hf.v41_quant import V41QuantError, scale_name
from engram_train.hf.v41_quant_layout import (
    RELEASE_QUANTIZATION_CONFIG,
    quantize_for_release,
    release_table_scales,
)

INDEX_FILE = "model.safetensors.index.json"
TABLE_WEIGHT = ".engram.multi_head_embedding.weight"
TABLE_SCALE = TABLE_WEIGHT + "_scale"  # an fp8 table's E8M0 scales (engram/fp8_table.py)
ROW_BLOCK_ELEMENTS = 1 << 26  # large tensors are converted in row blocks of about this size
_FLOAT32 = re.compile(r"(\.hc_(attn|ffn)_(fn|base|scale)|\.attn\.attn_sink|\.compressor\.w(kv|gate)"
                      r"\.weight|\.ffn\.gate\.bias(_vl)?)$|^head\.weight$")


def stored_tensors(name: str, value: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                   quantized: bool = False) -> list[tuple[str, torch.Tensor]]:
    """What the folder stores for released tensor `name` of float `value`: [(name, tensor)],
    with its ``.scale`` where `quantized` quantizes it (module docstring)."""
    if quantized:
        return quantize_for_release(name, value)
    keep = torch.float32 if _FLOAT32.search(name) else dtype
    return [(name, value.to(keep))]


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


def plan_released(reader: DistCheckpointReader, vocab: int, encode: Callable) -> list[_Released]:
    """Every released tensor of the checkpoint, with the output tensors `encode` makes of it
    (planned on meta tensors)."""
    released = []
    for key in reader.model_keys():
        if key.endswith("_extra_state") or key.endswith(TABLE_SCALE):
            continue  # an fp8 table's scales go with its rows
        try:
            pieces = v41_pieces(key, reader.tensors[key].shape, vocab)
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
        if key.endswith(".ffn.gate.e_score_correction_bias"):  # the image tokens' bias: zeros
            layer = key[: -len("ffn.gate.e_score_correction_bias")]
            shape = reader.tensors[key].shape
            released.append(_Released(None, None, layer + VISION_BIAS, shape, torch.zeros(shape)))
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
                   encode: Callable) -> list[tuple[str, torch.Tensor]]:
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
            return [(item.name, value), (scale_name(item.name), release_table_scales(value, scale))]
        value = dequantize_rows(value, scale, torch.float32)
    value = value.float()
    value = value[0] if piece.squeeze else value
    if not item.shape:  # a 0-d tensor
        value = value.reshape(())
    return encode(item.name, value)


def write_released(writer: SafetensorsWriter, reader: DistCheckpointReader, item: _Released,
                   encode: Callable) -> None:
    """Read, convert and write `item` a row block at a time."""
    written = [0] * len(item.outputs)  # rows of each output the earlier blocks gave
    for start, rows in _row_blocks(item.shape):
        outputs = _block_outputs(reader, item, start, rows, encode)
        for index, ((name, tensor), spec) in enumerate(zip(outputs, item.outputs)):
            if not spec.shape:
                writer.write(name, tensor)
                continue
            at, written[index] = written[index], written[index] + tensor.shape[0]
            with writer.region(name, [at, *[0] * (len(spec.shape) - 1)],
                               [tensor.shape[0], *spec.shape[1:]]) as target:
                target.copy_(tensor)
                del target


def _engram_rows(reader: DistCheckpointReader, model: dict) -> list[int]:
    if not model.get("use_engram"):
        return []
    return [int(reader.tensors[f"layers.{layer}.engram.multi_head_embedding.weight"].shape[0])
            for layer in model["engram_layer_ids"]]


def export_v41_hf(out: Path, reader: DistCheckpointReader, run_config: dict, where: str,
                  tokenizer_file: Path, *, max_shard_bytes: int, dtype: torch.dtype = torch.bfloat16,
                  log: Callable[[str], None], quantized: bool = False) -> Path:
    """Write the V4.1 checkpoint of `reader` (its run config `run_config`, found at `where`)
    as the released folder layout `out` (module docstring); `quantized`: the release's
    FP8/FP4 layout."""
    from engram_train.data import load_tokenizer
    from engram_train.engram.compressed_tokenizer import CompressedTokenizer
    from engram_train.export.hf_export import shard_file, write_tokenizer

    model = run_config.get("model", run_config)
    vocab = int(load_tokenizer(tokenizer_file).vocab_size)
    rows = reader.tensors["embedding.word_embeddings.weight"].shape[0]
    if rows < vocab:
        raise ExportError(f"the checkpoint's embedding has {rows} rows, the tokenizer "
                          f"{tokenizer_file} needs {vocab}: pass the run's tokenizer (--tokenizer)")
    compressed = CompressedTokenizer(tokenizer_file).vocab_size if model.get("use_engram") else None

    def encode(name, value):
        try:
            return stored_tensors(name, value, dtype, quantized)
        except V41QuantError as err:
            raise ExportError(str(err)) from None

    try:
        document = v41_hf_config(model, vocab, _engram_rows(reader, model), compressed,
                                 str(dtype).removeprefix("torch."))
        released = plan_released(reader, vocab, encode)
        if quantized:
            document["quantization_config"] = dict(RELEASE_QUANTIZATION_CONFIG)
    except HFConfigError as err:
        raise ExportError(f"{where}: {err}") from None

    def write(folder: Path) -> None:
        groups = shard_groups(released, max_shard_bytes)
        weight_map, total = {}, 0
        for index, group in enumerate(groups, start=1):
            name = shard_file(index, len(groups))
            specs = [spec for item in group for spec in item.outputs]
            with SafetensorsWriter(folder / name, specs, {"format": "pt"}) as writer:
                for item in group:
                    write_released(writer, reader, item, encode)
                    total += item.nbytes
            weight_map.update({s.name: name for s in specs})
        (folder / INDEX_FILE).write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
            indent=2) + "\n")
        (folder / "config.json").write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
        write_tokenizer(folder, tokenizer_file)

    publish(out, "hf", write, log)
    layout = "the released FP8/FP4 layout" if quantized else dtype
    log(f"wrote {out} (deepseek_v41, {len(released)} tensors, {layout}) from {reader.path}")
    return out

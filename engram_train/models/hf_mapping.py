"""A model family's Hugging Face side, as ``engram-import-hf`` (``hf/importer.py``) and
``engram-export --format hf`` (``export/hf_export.py``, ``export/hf_released.py``) use it:
the pieces a checkpoint tensor maps to, the errors, and what a family hands the shared
commands (`HFMapping`; the family's own tables and config maps live in its folder).

A checkpoint tensor (its dist-checkpoint key and global shape) maps to one or more *pieces*
(`Piece`): axis-aligned blocks of it that are whole transformers tensors. One table serves both
directions: the import fills each piece from the folder, the export cuts it out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engram_train.errors import EngramError


@dataclass(frozen=True)
class Piece:
    """transformers tensor `name` = megatron tensor[start : start + size], with the leading
    axis dropped when `squeeze` (one expert of a stacked tensor)."""

    name: str
    start: tuple[int, ...]
    size: tuple[int, ...]
    squeeze: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        return self.size[1:] if self.squeeze else self.size


def whole(name: str, shape: tuple[int, ...]) -> list[Piece]:
    """The one piece that is all of a tensor of `shape`, named `name`."""
    return [Piece(name, (0,) * len(shape), tuple(shape))]


class UnmappedTensorError(EngramError, ValueError):
    """A checkpoint tensor with no transformers name (the message names it)."""


class HFConfigError(EngramError, ValueError):
    """A field that cannot be converted; the message names it and says what to change."""


class HFImportError(EngramError, ValueError):
    """The folder cannot be imported; the message names the field, tensor or option."""


# Fields of a transformers ``config.json`` that describe no weight or computation of the model
# (metadata, generation, the inference layout); an import accepts them as they are.
NOT_THE_MODEL = {
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "use_cache",
    "bos_token_id", "eos_token_id", "pad_token_id", "auto_map", "ep_size", "output_router_logits",
    "router_aux_loss_coef", "max_position_embeddings", "initializer_range", "_name_or_path",
    "head_dim", "qk_head_dim", "num_mtp_layers", "seq_aux", "tie_word_embeddings",
    "num_nextn_predict_layers", "quantization_config", "rope_interleave", "id2label",
    "label2id", "return_dict", "output_hidden_states", "output_attentions",
}


@dataclass(frozen=True)
class ImportOptions:
    """The options of ``engram-import-hf`` a family reads (it refuses those it has none of)."""

    engram_layer_ids: list[int] | None = None
    drop_mtp: bool = False
    table_dtype: str | None = None
    placement: str | None = None


@dataclass
class HFImport:
    """What a family's `HFMapping.import_plan` gives the shared import for one folder."""

    section: dict
    """The model preset the folder implies (written to ``CKPT_DIR/conf/model/NAME.yaml``)."""
    folder: Any
    """The folder's reader (``models/hf_folder.HFFolder`` or the family's subclass)."""
    names: Callable[[str, tuple, int], list[Piece] | None]
    """``(checkpoint key, global shape, vocabulary rows)`` -> its pieces (None: kept as built)."""
    vocab_names: tuple[str, str]
    """The folder's embedding and output layer."""
    fields: dict
    """The ``config.json`` fields the shard filling reads: ``vocab_size``,
    ``tie_word_embeddings``."""
    skip: set[str] = field(default_factory=set)
    """Folder tensors the model does not hold."""
    notes: list[str] = field(default_factory=list)
    """Lines logged (rank 0) before the warnings."""
    source_rows: Callable[[str, int], list[int] | None] | None = None
    """``(folder tensor, rows)`` -> the folder row of each checkpoint row (None: the same)."""
    table_names: Callable[[str, tuple, int], list[Piece] | None] | None = None
    """fp8 Engram tables copied as stored (codes and scales): `names` for them."""
    check_tokenizer: Callable[[Path], None] | None = None
    """Refuses a tokenizer the folder's Engram hash does not fit."""


@dataclass(frozen=True)
class ReleasedLayout:
    """A family whose released folder stores each tensor converted (a dtype per name,
    quantized blocks with their scale tensors): ``export/hf_released.py`` writes it a row block
    at a time."""

    pieces: Callable[[str, tuple, int], list[Piece] | None]
    """As `HFMapping.pieces`."""
    encode: Callable[..., list[tuple[str, Any]]]
    """``(name, float value, dtype, quantized)`` -> [(name, stored tensor)], its scale too."""
    constants: Callable[[str, tuple], list[tuple[str, Any]]]
    """``(checkpoint key, shape)`` -> released tensors written beside it, as values."""
    config: Callable[..., dict]
    """``(model section, vocab rows, Engram table rows, compressed vocab, dtype name)`` ->
    ``config.json``."""
    engram_rows: Callable[[dict, dict], list[int]]
    """``(checkpoint tensors by key, model section)`` -> each Engram layer's table rows."""
    table_scales: Callable[[Any, Any], Any]
    """An fp8 table's stored codes and scales -> the released scale tensor."""
    scale_name: Callable[[str], str]
    """A quantized tensor's name -> its scale tensor's."""
    quantization_config: dict
    """``config.json``'s ``quantization_config`` of the quantized layout."""
    encode_error: type[Exception]
    """What `encode` raises for a tensor it cannot store."""


@dataclass(frozen=True)
class HFMapping:
    """A family's Hugging Face side (its state-dict adapter): which ``config.json`` it reads,
    how a folder becomes a preset and shards, and how a checkpoint becomes a folder."""

    reads: Callable[[dict], bool]
    """Whether a ``config.json`` is this family's."""
    import_plan: Callable[[Path, dict, ImportOptions], HFImport]
    """``(folder, config.json, options)`` -> the import of that folder (`HFConfigError` and
    ``HFSourceError`` become the import's error)."""
    hf_config: Callable[[dict, int, int | None], dict] | None = None
    """``(model section, vocab rows, seq_length)`` -> ``config.json`` (pieces export)."""
    pieces: Callable[[str, tuple, int], list[Piece] | None] | None = None
    """``(checkpoint key, global shape, vocab rows)`` -> its pieces (pieces export)."""
    engram_model: dict | None = None
    """``config.json`` fields of the modeling code a folder with Engram or mHC needs (written
    beside it, ``hf/remote_code.py``); None: no such folder."""
    released: ReleasedLayout | None = None
    """The export of a family with a released (converted) layout, instead of pieces."""

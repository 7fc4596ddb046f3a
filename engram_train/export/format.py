"""The inference export format: file names, tensor names and ``engram_config.json``.

Words used here and in docs/export.md: a *layer file* holds one Engram layer's parameters under
the DeepSeek reference module's names; the *hash file* holds the constants that addresses
depend on (compressed-token lookup, multipliers, primes) as exact int64 tensors; the *backbone*
is every other model tensor under megatron's dist-checkpoint keys, at its global shape.

`ExportedEngram` is the parsed, checked ``engram_config.json``; readers accept exports whose
``format_version`` they know and refuse newer ones by name.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engram_train.engram.ngram_hash import _LAYER_SEED_STRIDE as LAYER_SEED_STRIDE
from engram_train.engram.engram_module import CONV_NORM_EPS, GATE_NORM_EPS, GATE_SCORE_FLOOR
from engram_train.engram.reference_io import OFFSETS, REFERENCE_TABLE
from engram_train.errors import EngramError

FORMAT_NAME = "engram_train.inference_export"
FORMAT_VERSION = 1

CONFIG_FILE = "engram_config.json"
HASH_FILE = "engram_hash.safetensors"
TOKENIZER_FILE = "tokenizer.json"
BACKBONE_INDEX = "backbone.safetensors.index.json"

LOOKUP_TENSOR = "compressed_lookup"
TABLE = REFERENCE_TABLE  # the reference's name of the table: [total rows, D]

# An Engram parameter in the checkpoint: decoder.layers.<global layer>.engram.<our name>.
ENGRAM_KEY = re.compile(r"^decoder\.layers\.(\d+)\.engram\.(.+)$")


def layer_file(layer_id: int) -> str:
    return f"engram_layer{layer_id}.safetensors"


def backbone_file(index: int, count: int) -> str:
    return f"backbone-{index:05d}-of-{count:05d}.safetensors"


def multipliers_tensor(layer_id: int) -> str:
    return f"layer{layer_id}.multipliers"


def primes_tensor(layer_id: int) -> str:
    return f"layer{layer_id}.primes"


def layer_tensor_names(hc_mult: int) -> list[str]:
    """The reference module's state-dict names of one Engram layer with `hc_mult` streams."""
    names = [TABLE, OFFSETS, "value_proj.weight", "value_proj.bias", "short_conv.conv.weight"]
    for g in range(hc_mult):
        names += [f"key_projs.{g}.weight", f"key_projs.{g}.bias", f"norm1.{g}.weight",
                  f"norm2.{g}.weight", f"short_conv.norms.{g}.weight"]
    return names


class ExportFormatError(EngramError, ValueError):
    """An export directory this reader cannot use; the message says what is wrong."""


@dataclass(frozen=True)
class ExportedLayer:
    layer_id: int
    file: str
    num_rows: int
    primes: tuple[tuple[int, ...], ...]  # [order n-2][head]
    offsets: tuple[int, ...]             # per head, 2-gram heads first
    multipliers: tuple[int, ...]         # one per n-gram position 0..N-1

    @property
    def flat_primes(self) -> tuple[int, ...]:
        return tuple(p for order in self.primes for p in order)


@dataclass(frozen=True)
class ExportedEngram:
    """Everything in ``engram_config.json`` that inference needs, checked on load."""

    path: Path
    layer_ids: tuple[int, ...]
    max_ngram_size: int
    n_head_per_ngram: int
    n_embed_per_ngram: int
    engram_vocab_size: tuple[int, ...]
    seed: int
    kernel_size: int
    hc_mult: int
    hidden_size: int
    pad_id: int
    compressed_pad_id: int
    reset_at_eos: bool
    eos_id: int | None
    num_raw_ids: int
    compressed_vocab_size: int
    tokenizer_sha256: str
    table_dtype: str
    layers: dict[int, ExportedLayer] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def head_dim(self) -> int:
        return self.n_embed_per_ngram // self.n_head_per_ngram

    @property
    def num_heads(self) -> int:
        return (self.max_ngram_size - 1) * self.n_head_per_ngram

    def engram_config(self):
        """An `EngramConfig` that builds this export's Engram modules (dense parts)."""
        from engram_train.config import EngramConfig

        return EngramConfig(
            use_engram=True,
            engram_tokenizer_name_or_path=str(self.path / TOKENIZER_FILE),
            engram_vocab_size=list(self.engram_vocab_size),
            max_ngram_size=self.max_ngram_size,
            n_embed_per_ngram=self.n_embed_per_ngram,
            n_head_per_ngram=self.n_head_per_ngram,
            engram_layer_ids=list(self.layer_ids),
            engram_pad_id=self.pad_id,
            engram_seed=self.seed,
            engram_kernel_size=self.kernel_size,
            engram_hc_mult=self.hc_mult,
            engram_reset_at_eos=self.reset_at_eos,
            engram_eos_id=self.eos_id,
        )


def config_document(
    *,
    engram,
    hidden_size: int,
    tokenizer,
    hash_mapping,
    table_dtype: str,
    backbone: dict[str, Any],
    source: dict[str, Any],
) -> dict[str, Any]:
    """The ``engram_config.json`` document of an export (see docs/export.md for each field)."""
    layers = {}
    for layer_id in hash_mapping.layer_ids:
        layers[str(layer_id)] = {
            "file": layer_file(layer_id),
            "num_rows": int(hash_mapping.num_rows[layer_id]),
            "primes": [list(map(int, heads)) for heads in hash_mapping.head_vocab_sizes[layer_id]],
            "offsets": [int(o) for o in hash_mapping.offsets[layer_id]],
            "multipliers": [int(m) for m in hash_mapping.multipliers[layer_id]],
        }
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "engram": {
            "layer_ids": [int(i) for i in engram.engram_layer_ids],
            "max_ngram_size": int(engram.max_ngram_size),
            "n_head_per_ngram": int(engram.n_head_per_ngram),
            "n_embed_per_ngram": int(engram.n_embed_per_ngram),
            "head_dim": int(engram.n_embed_per_ngram // engram.n_head_per_ngram),
            "engram_vocab_size": [int(v) for v in engram.engram_vocab_size],
            "seed": int(engram.engram_seed),
            "layer_seed_stride": LAYER_SEED_STRIDE,
            "kernel_size": int(engram.engram_kernel_size),
            "dilation": int(engram.max_ngram_size),
            "hc_mult": int(engram.engram_hc_mult),
            "hidden_size": int(hidden_size),
            "pad_id": int(engram.engram_pad_id),
            "compressed_pad_id": int(hash_mapping.pad_id),
            "reset_at_eos": bool(engram.engram_reset_at_eos),
            "eos_id": None if engram.engram_eos_id is None else int(engram.engram_eos_id),
            "table_dtype": table_dtype,
            "numerics": {
                "gate_norm_eps": GATE_NORM_EPS,
                "conv_norm_eps": CONV_NORM_EPS,
                "gate_score_floor": GATE_SCORE_FLOOR,
            },
        },
        "tokenizer": {
            "file": TOKENIZER_FILE,
            "sha256": tokenizer.sha256,
            "num_raw_ids": int(tokenizer.num_raw_ids),
            "compressed_vocab_size": int(tokenizer.vocab_size),
            "lookup": {"file": HASH_FILE, "tensor": LOOKUP_TENSOR},
        },
        "hash": {
            "file": HASH_FILE,
            "multipliers_tensor": "layer<L>.multipliers",
            "primes_tensor": "layer<L>.primes",
        },
        "layers": layers,
        "backbone": backbone,
        "source": source,
    }


def _need(doc: dict, path: str):
    node: Any = doc
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            raise ExportFormatError(f"{CONFIG_FILE}: missing field '{path}'")
        node = node[part]
    return node


def load_export_config(path: str | os.PathLike) -> ExportedEngram:
    """Parse and check ``<path>/engram_config.json``; the int64 hash tensors are checked against
    it by the reader that loads them (`engram_train.inference`)."""
    path = Path(path)
    if not path.is_dir():
        raise ExportFormatError(f"export directory {path} does not exist")
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        raise ExportFormatError(
            f"{path} is not an Engram export: it has no {CONFIG_FILE} (write one with "
            "engram-export --load CKPT_DIR --out DIR)"
        )
    doc = json.loads(config_file.read_text())
    if doc.get("format") != FORMAT_NAME:
        raise ExportFormatError(
            f"{config_file}: format {doc.get('format')!r} is not {FORMAT_NAME!r}"
        )
    version = doc.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION or version < 1:
        raise ExportFormatError(
            f"{config_file}: format_version {version!r} is not supported by this reader "
            f"(knows 1..{FORMAT_VERSION}); upgrade engram_train to read it"
        )
    e = _need(doc, "engram")
    layer_ids = tuple(int(i) for i in _need(doc, "engram.layer_ids"))
    layers = {}
    for layer_id in layer_ids:
        info = _need(doc, f"layers.{layer_id}")
        layers[layer_id] = ExportedLayer(
            layer_id=layer_id,
            file=str(info["file"]),
            num_rows=int(info["num_rows"]),
            primes=tuple(tuple(int(p) for p in heads) for heads in info["primes"]),
            offsets=tuple(int(o) for o in info["offsets"]),
            multipliers=tuple(int(m) for m in info["multipliers"]),
        )
    exported = ExportedEngram(
        path=path,
        layer_ids=layer_ids,
        max_ngram_size=int(_need(doc, "engram.max_ngram_size")),
        n_head_per_ngram=int(_need(doc, "engram.n_head_per_ngram")),
        n_embed_per_ngram=int(_need(doc, "engram.n_embed_per_ngram")),
        engram_vocab_size=tuple(int(v) for v in _need(doc, "engram.engram_vocab_size")),
        seed=int(_need(doc, "engram.seed")),
        kernel_size=int(_need(doc, "engram.kernel_size")),
        hc_mult=int(_need(doc, "engram.hc_mult")),
        hidden_size=int(_need(doc, "engram.hidden_size")),
        pad_id=int(_need(doc, "engram.pad_id")),
        compressed_pad_id=int(_need(doc, "engram.compressed_pad_id")),
        reset_at_eos=bool(e.get("reset_at_eos", False)),
        eos_id=None if e.get("eos_id") is None else int(e["eos_id"]),
        num_raw_ids=int(_need(doc, "tokenizer.num_raw_ids")),
        compressed_vocab_size=int(_need(doc, "tokenizer.compressed_vocab_size")),
        tokenizer_sha256=str(_need(doc, "tokenizer.sha256")),
        table_dtype=str(_need(doc, "engram.table_dtype")),
        layers=layers,
        raw=doc,
    )
    _check_consistent(exported, config_file)
    return exported


def _check_consistent(e: ExportedEngram, where: Path) -> None:
    n_orders, heads = e.max_ngram_size - 1, e.n_head_per_ngram
    for layer in e.layers.values():
        shape = [len(order) for order in layer.primes]
        if shape != [heads] * n_orders:
            raise ExportFormatError(
                f"{where}: layer {layer.layer_id} primes have shape {shape}, expected "
                f"{n_orders} orders x {heads} heads"
            )
        expected = np.concatenate([[0], np.cumsum(layer.flat_primes)[:-1]]).tolist()
        if list(layer.offsets) != expected or sum(layer.flat_primes) != layer.num_rows:
            raise ExportFormatError(
                f"{where}: layer {layer.layer_id} offsets/num_rows disagree with its primes"
            )
        if len(layer.multipliers) != e.max_ngram_size:
            raise ExportFormatError(
                f"{where}: layer {layer.layer_id} has {len(layer.multipliers)} multipliers, "
                f"max_ngram_size={e.max_ngram_size} needs {e.max_ngram_size}"
            )

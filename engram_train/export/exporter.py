"""engram-export: a trained checkpoint -> an inference export (format: docs/export.md).

    engram-export --load CKPT_DIR --out DIR [--iteration N] [--config RUN_CONFIG.yaml]

`plan_export` checks everything before a byte is written: the checkpoint's files against its
manifest (``locate.py``), the run config it was trained with and its hash identity
(``config_source.py``), every Engram tensor's shape (``engram_tensors.py``). `write_export`
then reads the megatron dist checkpoint of any layout tensor by tensor (one stored shard in
memory at a time) into the folder `publish` renames to DIR only when complete
(``publish.py``, shared with ``--format hf``). The command line is ``cli.py``.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engram_train.export.checkpoint_reader import (
    CheckpointFormatError,
    DistCheckpointReader,
    StoredTensor,
)
from engram_train.export.format import (
    BACKBONE_INDEX,
    CONFIG_FILE,
    HASH_FILE,
    LOOKUP_TENSOR,
    TABLE,
    TOKENIZER_FILE,
    backbone_file,
    config_document,
    layer_file,
    multipliers_tensor,
    primes_tensor,
)
from engram_train.config import ENGRAM_TABLE_DTYPES
from engram_train.engram.compressed_tokenizer import (
    CompressedTokenizer,
    TokenizerNotFoundError,
    resolve_tokenizer_file,
)
from engram_train.engram.variant import build_hash_mapping
from engram_train.engram.reference_io import PROJECT_TABLE, reference_name
from engram_train.export.config_source import (  # noqa: F401  (part of this module's API)
    check_run_identity,
    engram_from_run_config,
    find_run_config,
)
from engram_train.export.engram_tensors import check_engram_tensors
from engram_train.export.export_errors import ExportError
from engram_train.export.publish import check_out, publish, stderr_log
from engram_train.export.locate import resolve_checkpoint, verify_files
from engram_train.export.safetensors_io import DTYPE_NAMES, SafetensorsWriter, TensorSpec, shard_groups

# The training table dtypes, plus fp16 for serving (an export may store tables narrower).
# fp8_e4m3 tables need their scales: not an export dtype (yet)
TABLE_DTYPES = {**{n: getattr(torch, t) for n, t in ENGRAM_TABLE_DTYPES.items() if n != "fp8_e4m3"},
                "fp16": torch.float16}
DEFAULT_SHARD_BYTES = 5 * 2**30
FILE_METADATA = {"format": "pt"}  # what Hugging Face loaders expect in __metadata__
BACKBONE_NAMING = "megatron-core 0.16.1 dist-checkpoint keys, global (unsharded) shapes"


def _write_file(path: Path, reader: DistCheckpointReader, sources: dict[str, str],
                dtypes: dict[str, torch.dtype] | None = None) -> None:
    """A safetensors file of checkpoint tensors: {file name: checkpoint key}."""
    dtypes = dtypes or {}
    specs = [TensorSpec(name, dtypes.get(name, reader.tensors[key].dtype),
                        reader.tensors[key].shape) for name, key in sources.items()]
    with SafetensorsWriter(path, specs, FILE_METADATA) as writer:
        for name, key in sources.items():
            reader.copy_chunks(key, functools.partial(writer.region, name))


@dataclass
class ExportPlan:
    """What an export will hold, checked before anything is written."""

    directory: Path                  # the iteration's checkpoint folder
    iteration: int | None
    reader: DistCheckpointReader
    engram: Any                      # EngramConfig of the run
    hidden_size: int
    model: dict                      # the run config's model section
    where: str                       # where the run config came from
    tokenizer_file: Path
    tokenizer: Any                   # CompressedTokenizer
    mapping: Any                     # NgramHashMapping: primes, offsets, multipliers
    layers: dict[int, dict[str, str]]  # {layer: {our name: checkpoint key}}
    backbone: list[StoredTensor]


def plan_export(load, *, iteration=None, config=None, tokenizer=None, verify=True,
                log: Callable[[str], None] = lambda _: None) -> ExportPlan:
    """Locate the checkpoint, verify its files against its manifest (`verify_files`; with
    `verify` false sizes only), find its run config and build the hash constants, compare them
    with the run identity the manifest stores (`check_run_identity`) and check every Engram
    tensor of the checkpoint against them (`check_engram_tensors`)."""
    root, directory, iteration = resolve_checkpoint(load, iteration)
    manifest = verify_files(directory, checksums=verify, log=log)  # before anything is read
    try:
        reader = DistCheckpointReader(directory)
    except CheckpointFormatError as err:
        raise ExportError(f"--load {load}: {err}") from None
    common = reader.common_state()
    if iteration is None and common is not None and "iteration" in common:
        iteration = int(common["iteration"])
    run_config, where = find_run_config(config, root, common)
    engram, hidden_size, model = engram_from_run_config(run_config, where)
    if engram.engram_variant != "paper":
        raise ExportError(
            f"{where}: model.engram_variant={engram.engram_variant!r}: the export formats and "
            "their loaders (EngramMemory, --format hf) hold the paper variant's branch; the "
            "deepseek_v41 variant does not export yet (docs/deepseek-v41.md)")
    if getattr(engram, "engram_table_dtype", None) == "fp8_e4m3":
        raise ExportError(
            f"{where}: model.engram_table_dtype=fp8_e4m3: the export formats hold plain tables, "
            "fp8 tables with their E8M0 scales do not export yet (docs/host-tables.md)")
    log(f"checkpoint {directory} (iteration {iteration}); run config: {where}")

    try:
        tokenizer_file = resolve_tokenizer_file(
            tokenizer or engram.engram_tokenizer_name_or_path, field="--tokenizer",
            hint=f" (the run config names '{engram.engram_tokenizer_name_or_path}', relative to "
                 "the directory training ran in)")
    except TokenizerNotFoundError as err:
        raise ExportError(str(err)) from None
    compressed = CompressedTokenizer(tokenizer_file)
    try:
        mapping = build_hash_mapping(engram, compressed)
    except ValueError as err:
        raise ExportError(f"{where}: {err}") from None

    check_run_identity(manifest, engram, mapping, where if tokenizer is None else
                       f"{where} with --tokenizer {tokenizer}", directory, log)
    layers = check_engram_tensors(reader, engram, hidden_size, mapping, where)
    engram_keys = {key for keys in layers.values() for key in keys.values()}
    backbone = [reader.tensors[k] for k in reader.model_keys() if k not in engram_keys]
    return ExportPlan(directory, iteration, reader, engram, hidden_size, model, where,
                      tokenizer_file, compressed, mapping, layers, backbone)


def write_export(plan: ExportPlan, folder: Path, *, table_dtype: torch.dtype | None = None,
                 max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                 log: Callable[[str], None] = lambda _: None) -> None:
    """Write every file of the export into the existing, empty `folder`."""
    reader, mapping = plan.reader, plan.mapping
    # Hash constants as exact int64 tensors (JSON numbers above 2**53 lose digits elsewhere).
    constants = {LOOKUP_TENSOR: torch.from_numpy(plan.tokenizer.lookup)}
    for layer_id in mapping.layer_ids:
        constants[multipliers_tensor(layer_id)] = torch.from_numpy(mapping.multipliers[layer_id])
        constants[primes_tensor(layer_id)] = torch.from_numpy(mapping.primes[layer_id])
    specs = [TensorSpec(name, t.dtype, tuple(t.shape)) for name, t in constants.items()]
    with SafetensorsWriter(folder / HASH_FILE, specs, FILE_METADATA) as writer:
        for name, value in constants.items():
            writer.write(name, value)
    shutil.copyfile(plan.tokenizer_file, folder / TOKENIZER_FILE)

    first_table = reader.tensors[plan.layers[mapping.layer_ids[0]][PROJECT_TABLE]]
    table_dtype = table_dtype or first_table.dtype
    for layer_id in mapping.layer_ids:
        sources = {reference_name(name): key for name, key in sorted(plan.layers[layer_id].items())}
        _write_file(folder / layer_file(layer_id), reader, sources, {TABLE: table_dtype})
        table = reader.tensors[sources[TABLE]]
        log(f"layer {layer_id}: table {table.shape[0]} x {table.shape[1]} from "
            f"{len(table.chunks)} stored shard(s) -> {layer_file(layer_id)}")

    shards = [s for s in shard_groups(plan.backbone, max_shard_bytes) if s]
    weight_map = {}
    for index, shard in enumerate(shards, start=1):
        name = backbone_file(index, len(shards))
        _write_file(folder / name, reader, {t.key: t.key for t in shard})
        weight_map.update({t.key: name for t in shard})
    total = sum(t.nbytes for t in plan.backbone)
    (folder / BACKBONE_INDEX).write_text(json.dumps(
        {"metadata": {"total_size": total, "naming": BACKBONE_NAMING}, "weight_map": weight_map},
        indent=1, sort_keys=True) + "\n")
    log(f"backbone: {len(plan.backbone)} tensors, {total / 2**20:.1f} MiB in {len(shards)} "
        "file(s)")

    document = config_document(
        engram=plan.engram, hidden_size=plan.hidden_size, tokenizer=plan.tokenizer,
        hash_mapping=mapping, table_dtype=DTYPE_NAMES[table_dtype],
        backbone={
            "index": BACKBONE_INDEX,
            "naming": BACKBONE_NAMING,
            "num_tensors": len(plan.backbone),
            "vocab_size": _vocab_size(reader),
            "model": plan.model,
        },
        source={"checkpoint": str(plan.directory.resolve()), "iteration": plan.iteration},
    )
    (folder / CONFIG_FILE).write_text(_dumps(document) + "\n")


def export_checkpoint(
    load: str | os.PathLike,
    out: str | os.PathLike,
    *,
    iteration: int | None = None,
    config: str | os.PathLike | None = None,
    tokenizer: str | os.PathLike | None = None,
    force: bool = False,
    table_dtype: str | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    verify: bool = True,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Write the export of checkpoint `load` into `out` (see the module docstring); returns
    `out`. Nothing appears at `out` unless the whole export succeeded."""
    log = log or stderr_log
    out = check_out(out, load, force=force)
    if table_dtype is not None and table_dtype not in TABLE_DTYPES:
        raise ExportError(f"--table-dtype {table_dtype!r} must be one of {sorted(TABLE_DTYPES)}")
    if max_shard_bytes < 1:
        raise ExportError(f"--max-shard-size must be positive, got {max_shard_bytes}")

    plan = plan_export(load, iteration=iteration, config=config, tokenizer=tokenizer, verify=verify,
                       log=log)
    publish(out, "engram", lambda folder: write_export(
        plan, folder, table_dtype=TABLE_DTYPES.get(table_dtype), max_shard_bytes=max_shard_bytes, log=log),
        log)  # fmt: skip
    log(f"wrote {out}")
    return out


def _dumps(document: dict) -> str:
    """Indented JSON with lists of numbers kept on one line."""
    text = json.dumps(document, indent=2)
    return re.sub(r"\[[-\d,\s]*\]", lambda m: re.sub(r"\s+", "", m.group(0)).replace(",", ", "),
                  text)


def _vocab_size(reader: DistCheckpointReader) -> int | None:
    """Padded vocabulary of the input embedding (megatron pads it to a TP-friendly multiple)."""
    stored = reader.tensors.get("embedding.word_embeddings.weight")
    return int(stored.shape[0]) if stored is not None else None

"""``engram-export --format hf``: a training checkpoint -> a transformers model folder.

The checkpoint's model family (``models/families.py``, by the run config's ``model_family``)
maps it (its ``hf``, ``models/hf_mapping.HFMapping``). A family with a released layout
(DeepSeek-V4.1) is written by ``hf_released.py``; the others here: ``config.json`` from the
family's config map, the weights cut into the family's pieces under transformers' names in
``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``, and the tokenizer.
For DeepSeek-V3 without Engram (and mHC) the folder is a stock ``deepseek_v3`` one. With Engram
it is the family's Engram modeling (``engram_deepseek_v3`` for
`engram_train.hf.EngramDeepseekV3ForCausalLM`, its code written beside it): the same plus each
Engram layer's tensors under ``model.layers.<i>.engram.`` and the hash constants as exact
int64 tensors. The checkpoint is read with the export's reader (any TP/PP/VPP/EP/eps layout,
one stored shard in memory at a time, copied into memory maps of the output files), so every
layout gives the same bytes.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engram_train.config import EngramConfig, resolve
from engram_train.data import load_tokenizer
from engram_train.engram.compressed_tokenizer import TokenizerNotFoundError, resolve_tokenizer_file
from engram_train.export.checkpoint_reader import DistCheckpointReader, StoredTensor
from engram_train.export.config_source import find_run_config
from engram_train.export.export_errors import ExportError
from engram_train.export.exporter import plan_export
from engram_train.export.hf_files import FILE_METADATA, shard_file, write_index, write_tokenizer
from engram_train.export.hf_released import export_released
from engram_train.export.locate import resolve_checkpoint, verify_files
from engram_train.export.publish import check_out, publish, stderr_log
from engram_train.export.safetensors_io import SafetensorsWriter, TensorSpec, shard_groups
from engram_train.hf.remote_code import AUTO_MAP, write_remote_code
from engram_train.models.families import family_of_section
from engram_train.models.hf_mapping import HFConfigError, Piece, UnmappedTensorError
from engram_train.training.run_config import padded_vocab_size

HASH_PREFIX = "model.engram_hash."


@dataclass
class _Item:
    """One checkpoint tensor and the transformers tensors cut from it."""

    stored: StoredTensor
    pieces: list[Piece]

    @property
    def nbytes(self) -> int:
        return sum(_numel(p.shape) for p in self.pieces) * _itemsize(self.stored.dtype)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def plan_items(reader: DistCheckpointReader, vocab_size: int, pieces: Callable) -> list[_Item]:
    """Every model tensor of the checkpoint with its `pieces` (``_extra_state`` left out)."""
    items = []
    for key in reader.model_keys():
        if key.endswith("_extra_state"):
            continue
        stored = reader.tensors[key]
        try:
            items.append(_Item(stored, pieces(key, stored.shape, vocab_size)))
        except UnmappedTensorError as err:
            raise HFConfigError(str(err)) from None
    return items


def _scatter(writer: SafetensorsWriter, pieces: list[Piece]):
    """`copy_chunks` destination: each stored chunk is read into a buffer (one chunk in
    memory), then the parts of it that fall in a piece are copied into that piece's block."""

    @contextlib.contextmanager
    def block(offsets, lengths):
        buffer = torch.empty(lengths, dtype=writer_dtype(writer, pieces))
        yield buffer
        for piece in pieces:
            lo = [max(o, s) for o, s in zip(offsets, piece.start)]
            hi = [min(o + n, s + z) for o, n, s, z in zip(offsets, lengths, piece.start, piece.size)]
            if any(h <= lo_ for lo_, h in zip(lo, hi)):
                continue
            src = buffer
            for dim, (a, b, o) in enumerate(zip(lo, hi, offsets)):
                src = src.narrow(dim, a - o, b - a)
            at = [a - s for a, s in zip(lo, piece.start)]
            size = [b - a for a, b in zip(lo, hi)]
            if piece.squeeze:
                src, at, size = src[0], at[1:], size[1:]
            with writer.region(piece.name, at, size) as target:
                target.copy_(src)
                del target

    return block


def writer_dtype(writer: SafetensorsWriter, pieces: list[Piece]) -> torch.dtype:
    return writer.entries[pieces[0].name].dtype


def write_weights(folder: Path, reader: DistCheckpointReader, items: list[_Item],
                  extra: dict[str, torch.Tensor], max_shard_bytes: int) -> int:
    """The safetensors shards and their index; `extra` (small tensors) go into the first
    shard. Returns the total bytes."""
    extra_bytes = sum(t.numel() * t.element_size() for t in extra.values())
    shards = shard_groups(items, max_shard_bytes, first_bytes=extra_bytes)
    weight_map, total = {}, extra_bytes
    for index, shard in enumerate(shards, start=1):
        name = shard_file(index, len(shards))
        specs = [TensorSpec(p.name, item.stored.dtype, p.shape) for item in shard for p in item.pieces]
        if index == 1:
            specs += [TensorSpec(k, t.dtype, tuple(t.shape)) for k, t in extra.items()]
        with SafetensorsWriter(folder / name, specs, FILE_METADATA) as writer:
            for item in shard:
                reader.copy_chunks(item.stored.key, _scatter(writer, item.pieces))
                total += item.nbytes
            if index == 1:
                for k, t in extra.items():
                    writer.write(k, t)
        weight_map.update({s.name: name for s in specs})
    write_index(folder, weight_map, total)
    return total


def engram_extras(plan) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json's ``engram`` section, the hash-constant tensors) of an Engram export plan."""
    engram, mapping = plan.engram, plan.mapping
    section = {name: getattr(engram, name) for name in EngramConfig.field_names()
               if name not in ("engram_tokenizer_name_or_path",)}
    section = json.loads(json.dumps(section, default=list))
    section.update(num_raw_ids=int(mapping.num_raw_ids), compressed_pad_id=int(mapping.pad_id),
                   compressed_vocab_size=int(mapping.compressed_vocab_size))
    tensors = {HASH_PREFIX + "lookup": torch.from_numpy(plan.tokenizer.lookup).to(torch.int64)}
    for layer in mapping.layer_ids:
        tensors[f"{HASH_PREFIX}multipliers_{layer}"] = torch.from_numpy(mapping.multipliers[layer])
        tensors[f"{HASH_PREFIX}primes_{layer}"] = torch.from_numpy(mapping.primes[layer])
    return section, tensors


def mhc_section(model: dict) -> dict:
    """config.json's ``hyper_connections`` section: what the mHC mappings need."""
    mhc = resolve(model)
    return {"num_residual_streams": int(mhc["num_residual_streams"]),
            "sinkhorn_iterations": int(mhc["mhc_sinkhorn_iterations"]),
            "norm_eps": float(model.get("layernorm_epsilon", 1e-6))}


def _tokenizer_file(tokenizer, run_config: dict, where: str) -> Path:
    named = tokenizer or (run_config.get("data") or {}).get("tokenizer")
    if not named:
        raise ExportError(f"{where} names no data.tokenizer: pass --tokenizer")
    try:
        return resolve_tokenizer_file(named, field="--tokenizer")
    except TokenizerNotFoundError as err:
        raise ExportError(str(err)) from None


def export_hf(load, out, *, iteration=None, config=None, tokenizer=None, force=False,
              max_shard_bytes: int = 5 * 2**30, verify=True, hf_layout: str | None = None,
              log: Callable[[str], None] | None = None) -> Path:
    """Write checkpoint `load` as a transformers model folder `out` (module docstring);
    `hf_layout` (a family with a released layout, DeepSeek-V4.1): ``released`` (default:
    FP8/FP4 with scales) or ``bf16`` (unquantized)."""
    log = log or stderr_log
    out = check_out(out, load, force=force)
    root, directory, iteration = resolve_checkpoint(load, iteration)
    reader = DistCheckpointReader(directory)
    run_config, where = find_run_config(config, root, reader.common_state())
    model = run_config.get("model", run_config)
    family = family_of_section(model)
    if family.hf is None:
        raise ExportError(f"{where}: model_family={family.name} has no transformers mapping: "
                          "--format hf cannot write it")
    if family.hf.released is not None:  # the family's released layout
        verify_files(directory, checksums=verify, log=log)
        return export_released(out, reader, run_config, where,
                               _tokenizer_file(tokenizer, run_config, where), family,
                               max_shard_bytes=max_shard_bytes, log=log,
                               quantized=hf_layout in (None, "released"))
    if hf_layout is not None:
        raise ExportError(f"--hf-layout {hf_layout}: only DeepSeek-V4.1 checkpoints have a "
                          "quantized released layout; drop the option")
    plan = None
    if model.get("use_engram"):
        plan = plan_export(load, iteration=iteration, config=config, tokenizer=tokenizer,
                           verify=verify, log=log)
        tokenizer_file = plan.tokenizer_file
    else:
        verify_files(directory, checksums=verify, log=log)
        tokenizer_file = _tokenizer_file(tokenizer, run_config, where)
    vocab = padded_vocab_size(load_tokenizer(tokenizer_file).vocab_size, 1)
    stored = reader.tensors["embedding.word_embeddings.weight"]
    if stored.shape[0] < vocab:
        raise ExportError(f"the checkpoint's embedding has {stored.shape[0]} rows, the tokenizer "
                          f"{tokenizer_file} needs {vocab}: pass the run's tokenizer (--tokenizer)")
    try:
        document = family.hf.hf_config(model, vocab,
                                       (run_config.get("train") or {}).get("seq_length"))
        items = plan_items(reader, vocab, family.hf.pieces)
    except HFConfigError as err:
        raise ExportError(f"{where}: {err}") from None
    document["dtype"] = str(stored.dtype).removeprefix("torch.")
    extra = _engram_and_mhc(document, family, model, plan, reader, where)
    written = {}

    def write(folder: Path) -> None:
        written["total"] = write_weights(folder, reader, items, extra, max_shard_bytes)
        (folder / "config.json").write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
        write_tokenizer(folder, tokenizer_file)
        if "auto_map" in document:  # the modeling code, for trust_remote_code=True
            write_remote_code(folder)

    publish(out, "hf", write, log)
    total = written["total"]
    log(f"wrote {out} ({document['model_type']}, {len(items)} checkpoint tensors, "
        f"{total / 2**20:.1f} MiB) from {directory} (iteration {iteration})")
    return out


def _engram_and_mhc(document: dict, family, model: dict, plan, reader: DistCheckpointReader,
                    where: str) -> dict[str, torch.Tensor]:
    """With Engram (`plan`, its export plan) or mHC: their ``config.json`` sections and the
    family's Engram modeling (written beside the weights); returns the hash-constant tensors."""
    mhc = bool(model.get("enable_hyper_connections"))
    if plan is None and not mhc:
        return {}
    if family.hf.engram_model is None:
        raise ExportError(f"{where}: model_family={family.name} has no transformers modeling "
                          "with Engram or mHC; export without them")
    extra: dict[str, torch.Tensor] = {}
    if plan is not None:
        section, extra = engram_extras(plan)
        section["table_rows"] = {  # each layer's table, as stored (the modeling sizes it so)
            str(layer): int(reader.tensors[f"decoder.layers.{layer}.engram.multi_head_embedding"
                                           ".weight"].shape[0]) for layer in plan.mapping.layer_ids}
        document["engram"] = section
    if mhc:
        document["hyper_connections"] = mhc_section(model)
    document.update(**family.hf.engram_model, auto_map=dict(AUTO_MAP))
    return extra

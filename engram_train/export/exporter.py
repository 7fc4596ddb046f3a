"""engram-export: a trained checkpoint -> an inference export (format: docs/export.md).

    engram-export --load CKPT_DIR --out DIR [--iteration N] [--config RUN_CONFIG.yaml]

Reads a megatron dist checkpoint of any layout tensor by tensor (one stored shard in memory at
a time), checks it against the run config it was trained with, and writes the export into a
temporary folder next to DIR that is renamed to DIR only when complete.

The checkpoint holds weights only; the Engram hash constants come from the run config
(``config.yaml``, the resolved config engram-train writes into ``experiment.exp_dir``) and the
tokenizer it names. Searched in order: ``--config``; a ``run_config`` mapping in the
checkpoint's ``extra`` state; ``CKPT_DIR/config.yaml``; ``CKPT_DIR/../config.yaml`` when its
``checkpoint.save`` is CKPT_DIR.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engram_train.export.checkpoint_reader import (
    MEGATRON_METADATA,
    CheckpointFormatError,
    DistCheckpointReader,
    StoredTensor,
)
from engram_train.export.format import (
    BACKBONE_INDEX,
    CONFIG_FILE,
    ENGRAM_KEY,
    HASH_FILE,
    LOOKUP_TENSOR,
    OFFSETS,
    TABLE,
    TOKENIZER_FILE,
    backbone_file,
    config_document,
    layer_file,
    multipliers_tensor,
    primes_tensor,
)
from engram_train.export.safetensors_io import DTYPE_NAMES, SafetensorsWriter, TensorSpec

TABLE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_SHARD_BYTES = 5 * 2**30
FILE_METADATA = {"format": "pt"}  # what Hugging Face loaders expect in __metadata__
BACKBONE_NAMING = "megatron-core 0.16.1 dist-checkpoint keys, global (unsharded) shapes"


class ExportError(ValueError):
    """The export cannot be made; the message names the input to fix."""


# -- locating the checkpoint ----------------------------------------------------------------

def resolve_checkpoint(load: str | os.PathLike, iteration: int | None = None
                       ) -> tuple[Path, Path, int | None]:
    """(checkpoint root, iteration directory, iteration) for ``--load`` / ``--iteration``.

    `load` is a ``checkpoint.save`` folder (``latest_checkpointed_iteration.txt`` +
    ``iter_XXXXXXX/``) or one ``iter_XXXXXXX`` folder itself."""
    from engram_train.checkpointing import TRACKER, iteration_dir, latest_iteration

    root = Path(load)
    if not root.exists():
        raise ExportError(f"--load {load}: directory does not exist")
    if not root.is_dir():
        raise ExportError(f"--load {load}: not a directory (give the checkpoint.save folder)")
    if (root / MEGATRON_METADATA).is_file():  # an iteration directory
        match = re.fullmatch(r"iter_(\d+)", root.name)
        found = int(match.group(1)) if match else None
        if iteration is not None and iteration != found:
            raise ExportError(
                f"--iteration {iteration} does not match --load {load}, which is one iteration's "
                "folder: give the checkpoint.save folder with --iteration, or drop --iteration"
            )
        return root.parent, root, found
    available = sorted(int(p.name[5:]) for p in root.glob("iter_*")
                       if re.fullmatch(r"iter_\d+", p.name) and p.is_dir())
    if iteration is None:
        try:
            iteration = latest_iteration(root)
        except ValueError:
            raise ExportError(f"--load {load}: {TRACKER} is unreadable; pass --iteration") from None
        if iteration is None:
            if available:
                raise ExportError(
                    f"--load {load} has no {TRACKER}; pass --iteration (found iterations "
                    f"{available})"
                )
            raise ExportError(
                f"--load {load} is not a checkpoint: it has no {TRACKER} and no iter_XXXXXXX "
                "folders (give the folder checkpoint.save wrote into)"
            )
    directory = iteration_dir(root, iteration)
    if not directory.is_dir():
        raise ExportError(
            f"--load {load} has no iteration {iteration} ({directory.name} is missing; found "
            f"iterations {available})"
        )
    return root, directory, iteration


# -- verifying the checkpoint before reading it ---------------------------------------------

def verify_files(directory: Path, *, checksums: bool = True,
                 log: Callable[[str], None] = lambda _: None) -> dict | None:
    """The trainer's load check: every file's size (and with `checksums` its SHA-256) against
    the checkpoint's ``manifest.json``; returns the manifest (None, with a warning, for a
    checkpoint saved before manifests existed). `ExportError` naming each damaged file."""
    from engram_train.checkpointing import MANIFEST, DamagedCheckpointError, read_manifest
    from engram_train.checkpointing import check_checkpoint as check_files

    try:
        manifest = read_manifest(directory)
    except DamagedCheckpointError as err:
        raise ExportError(f"checkpoint {directory} is damaged; nothing was exported:\n  {err}") from None
    if manifest is None:
        log(f"warning: {directory} has no {MANIFEST} (saved before manifests existed): its files "
            "could not be checked for damage (sizes, SHA-256), nor its run identity (Engram hash "
            "seed, tokenizer, N, H, layer ids, primes, multipliers) against the run config; only "
            "the Engram tensor shapes and head offsets are checked")
        return None
    problems = check_files(directory, checksums=checksums)
    if problems:
        raise ExportError(
            f"checkpoint {directory} is damaged; nothing was exported:\n  " + "\n  ".join(problems)
            + "\nRestore these files, or export another iteration (--iteration N)"
        )
    size = sum(int(f["size"]) for f in manifest["files"].values())
    log(f"{len(manifest['files'])} files ({size / 2**20:.1f} MiB) match {MANIFEST} "
        + ("(sizes and SHA-256)" if checksums else "(sizes only: --no-verify)"))
    return manifest


def _changed(old: Any, new: Any) -> str:
    """Both values, or for mappings only the entries that differ."""
    if isinstance(old, dict) and isinstance(new, dict):
        keys = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
        return "; ".join(f"{k} {_short(old.get(k))} in the checkpoint, {_short(new.get(k))} in the run config"
                         for k in keys)
    return f"{_short(old)} in the checkpoint, {_short(new)} in the run config"


def _short(value: Any, limit: int = 70) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_run_identity(manifest: dict | None, engram, mapping, where: str, directory: Path,
                       log: Callable[[str], None] = lambda _: None) -> None:
    """The Engram hash identity the trainer stored in the manifest against the one the run
    config gives (training/run_identity.py): seed, tokenizer digest and sizes, N, H, layer ids,
    table sizes, pad id, primes, multipliers, conv and EOS settings. A difference would serve
    every n-gram from rows trained for another: `ExportError` naming each field, both values."""
    from engram_train.training.run_identity import ENGRAM_DERIVED, ENGRAM_FIELDS, engram_identity

    if manifest is None:
        return  # verify_files warned
    run = manifest.get("run")
    if not run:
        log(f"warning: {directory}/manifest.json records no run identity (saved by a tool, or "
            "before identities existed): the Engram hash seed, tokenizer, N, H, layer ids, primes "
            f"and multipliers could not be compared with {where}")
        return
    if not run.get("use_engram"):
        raise ExportError(f"{directory} was trained without Engram (its manifest says "
                          f"use_engram=false), but {where} has use_engram=true: there is no "
                          "Engram memory to export")  # fmt: skip
    saved, current = run.get("engram") or {}, engram_identity(engram, mapping)
    changes = [(k, saved.get(k), current.get(k)) for k in sorted(set(saved) | set(current))
               if saved.get(k) != current.get(k)]
    if any(k in ENGRAM_FIELDS or k == "tokenizer" for k, _, _ in changes):
        # what is derived from a changed setting says nothing new
        changes = [c for c in changes if c[0] in ENGRAM_FIELDS or c[0] == "tokenizer"]
    if not changes:
        return
    lines = []
    for key, old, new in changes:
        what = ENGRAM_DERIVED.get(key, f"model.{key}")
        if key == "tokenizer":
            what = "model.engram_tokenizer_name_or_path (or --tokenizer): the compressed vocabulary"
        lines.append(f"{what}: {_changed(old, new)}")
    raise ExportError(
        f"{where} does not match the run identity stored with checkpoint {directory}:\n  - "
        + "\n  - ".join(lines)
        + "\nThe export would hash tokens to rows trained for other n-grams. Pass the run config "
        "this checkpoint was trained with (--config <experiment.exp_dir>/config.yaml), or set "
        "these fields in it to the checkpoint's values"
    )


# -- the run config -------------------------------------------------------------------------

def _read_yaml(path: Path) -> dict:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except (OmegaConfBaseException, OSError, ValueError) as err:
        raise ExportError(
            f"--config {path}: cannot read it as a resolved run config ({err}); give the "
            "config.yaml that engram-train writes into experiment.exp_dir"
        ) from None


def find_run_config(config: str | os.PathLike | None, root: Path,
                    common: dict | None) -> tuple[dict, str]:
    """(run config mapping, where it came from); see the module docstring for the order."""
    if config is not None:
        path = Path(config)
        if not path.is_file():
            raise ExportError(f"--config {config}: file does not exist")
        return _read_yaml(path), str(path)
    extra = (common or {}).get("extra") or {}
    if isinstance(extra.get("run_config"), dict):
        return extra["run_config"], "the checkpoint's extra.run_config"
    candidate = root / "config.yaml"
    if candidate.is_file():
        return _read_yaml(candidate), str(candidate)
    candidate = root.parent / "config.yaml"
    if candidate.is_file():
        doc = _read_yaml(candidate)
        save = (doc.get("checkpoint") or {}).get("save")
        if save and _same_dir(save, root):
            return doc, str(candidate)
    raise ExportError(
        f"no run config for {root}: the checkpoint holds weights only, and the Engram hash "
        "constants come from the config it was trained with. Pass --config "
        "<experiment.exp_dir>/config.yaml (the resolved config engram-train writes)"
    )


def _same_dir(a: str | os.PathLike, b: Path) -> bool:
    try:
        return Path(a).resolve() == b.resolve()
    except OSError:
        return False


def engram_from_run_config(doc: dict, where: str):
    """(EngramConfig, hidden_size, model section) from a run config or a bare model section."""
    from engram_train.config import EngramConfig

    model = doc.get("model", doc) if isinstance(doc, dict) else None
    if not isinstance(model, dict):
        raise ExportError(f"{where}: no 'model' section")
    if not model.get("use_engram"):
        raise ExportError(
            f"{where}: model.use_engram is not true; there is no Engram memory to export"
        )
    fields = {k: model[k] for k in EngramConfig.field_names() if k in model}
    if fields.get("engram_hc_mult") is None and model.get("enable_hyper_connections"):
        # unset follows the backbone: Engram reads and writes every mHC residual stream
        fields["engram_hc_mult"] = model.get("num_residual_streams", 4)
    try:
        engram = EngramConfig.from_dict(fields)
    except (TypeError, ValueError) as err:
        raise ExportError(f"{where}: model section: {err}") from None
    hidden = model.get("hidden_size")
    if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1:
        raise ExportError(f"{where}: model.hidden_size={hidden!r} must be a positive int")
    return engram, hidden, model


# -- checking the checkpoint against the config ---------------------------------------------

def engram_layer_keys(reader: DistCheckpointReader) -> dict[int, dict[str, str]]:
    """{global layer: {our parameter name: checkpoint key}} of every Engram layer stored."""
    layers: dict[int, dict[str, str]] = {}
    for key in reader.model_keys():
        match = ENGRAM_KEY.match(key)
        if match:
            layers.setdefault(int(match.group(1)), {})[match.group(2)] = key
    return layers


def check_checkpoint(reader: DistCheckpointReader, engram, hidden_size: int, mapping,
                     where: str) -> dict[int, dict[str, str]]:
    """Every Engram tensor present with the shape the config implies (and the stored head
    offsets equal to the ones the config's primes give); returns `engram_layer_keys`."""
    from engram_train.engram.engram_module import Engram
    from engram_train.engram.reference_io import reference_name

    stored = engram_layer_keys(reader)
    expected_ids = sorted(engram.engram_layer_ids)
    if sorted(stored) != expected_ids:
        raise ExportError(
            f"the checkpoint has Engram layers {sorted(stored)}, {where} says engram_layer_ids="
            f"{list(engram.engram_layer_ids)}: pass the run config this checkpoint was trained "
            "with (--config)"
        )
    fix = ("engram_vocab_size, max_ngram_size, n_head_per_ngram, n_embed_per_ngram, "
           "engram_layer_ids, engram_hc_mult, engram_kernel_size or hidden_size in "
           f"{where} differ from training: pass the run config this checkpoint was trained with")
    for layer_id, keys in stored.items():
        module = Engram(engram, hidden_size, layer_id, device="meta")
        want = {name: tuple(t.shape) for name, t in module.state_dict().items()}
        missing, extra = sorted(set(want) - set(keys)), sorted(set(keys) - set(want))
        if missing or extra:
            raise ExportError(
                f"layer {layer_id}: the checkpoint's Engram tensors differ from the module the "
                f"config builds (missing {missing}, unexpected {extra}); {fix}"
            )
        for name, shape in want.items():
            got = reader.tensors[keys[name]].shape
            if got != shape:
                raise ExportError(
                    f"layer {layer_id}: {reference_name(name)} has shape {got} in the checkpoint, "
                    f"{shape} from the config; {fix}"
                )
        offsets = reader.read(keys[OFFSETS]).tolist()
        if offsets != mapping.offsets[layer_id].tolist():
            raise ExportError(
                f"layer {layer_id}: stored head offsets differ from the config's primes; {fix}"
            )
    return stored


# -- writing --------------------------------------------------------------------------------

def _write_file(path: Path, reader: DistCheckpointReader, sources: dict[str, str],
                dtypes: dict[str, torch.dtype] | None = None) -> None:
    """A safetensors file of checkpoint tensors: {file name: checkpoint key}."""
    dtypes = dtypes or {}
    specs = [TensorSpec(name, dtypes.get(name, reader.tensors[key].dtype),
                        reader.tensors[key].shape) for name, key in sources.items()]
    with SafetensorsWriter(path, specs, FILE_METADATA) as writer:
        for name, key in sources.items():
            reader.copy_chunks(key, functools.partial(writer.region, name))


def _shards(tensors: list[StoredTensor], max_bytes: int) -> list[list[StoredTensor]]:
    """Consecutive groups of at most `max_bytes` (a larger tensor gets a shard of its own)."""
    shards: list[list[StoredTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return [s for s in shards if s]


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
    tensor of the checkpoint against them (`check_checkpoint`)."""
    from engram_train.engram.ngram_hash import NgramHashMapping
    from engram_train.engram.compressed_tokenizer import (
        CompressedTokenizer,
        TokenizerNotFoundError,
        resolve_tokenizer_file,
    )

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
        mapping = NgramHashMapping(engram, compressed)
    except ValueError as err:
        raise ExportError(f"{where}: {err}") from None

    check_run_identity(manifest, engram, mapping, where if tokenizer is None else
                       f"{where} with --tokenizer {tokenizer}", directory, log)
    layers = check_checkpoint(reader, engram, hidden_size, mapping, where)
    engram_keys = {key for keys in layers.values() for key in keys.values()}
    backbone = [reader.tensors[k] for k in reader.model_keys() if k not in engram_keys]
    return ExportPlan(directory, iteration, reader, engram, hidden_size, model, where,
                      tokenizer_file, compressed, mapping, layers, backbone)


def write_export(plan: ExportPlan, folder: Path, *, table_dtype: torch.dtype | None = None,
                 max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                 log: Callable[[str], None] = lambda _: None) -> None:
    """Write every file of the export into the existing, empty `folder`."""
    from engram_train.engram.reference_io import PROJECT_TABLE, reference_name

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

    shards = _shards(plan.backbone, max_shard_bytes)
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
    log = log or (lambda message: print(f"engram-export: {message}", file=sys.stderr))
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"--out {out} is not empty; pass --force to replace it")
    if table_dtype is not None and table_dtype not in TABLE_DTYPES:
        raise ExportError(f"--table-dtype {table_dtype!r} must be one of {sorted(TABLE_DTYPES)}")
    if max_shard_bytes < 1:
        raise ExportError(f"--max-shard-size must be positive, got {max_shard_bytes}")

    plan = plan_export(load, iteration=iteration, config=config, tokenizer=tokenizer, verify=verify,
                       log=log)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        write_export(plan, tmp, table_dtype=TABLE_DTYPES.get(table_dtype),
                     max_shard_bytes=max_shard_bytes, log=log)
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp made it private
        _fsync_dir(tmp)
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"wrote {out}")
    return out


def _dumps(document: dict) -> str:
    """Indented JSON with lists of numbers kept on one line."""
    text = json.dumps(document, indent=2)
    return re.sub(r"\[[-\d,\s]*\]", lambda m: re.sub(r"\s+", "", m.group(0)).replace(",", ", "),
                  text)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _vocab_size(reader: DistCheckpointReader) -> int | None:
    """Padded vocabulary of the input embedding (megatron pads it to a TP-friendly multiple)."""
    stored = reader.tensors.get("embedding.word_embeddings.weight")
    return int(stored.shape[0]) if stored is not None else None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_dir(tmp: Path, out: Path) -> None:
    """Rename the finished export into place (replacing an old one: --force)."""
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
        os.replace(out, old / out.name)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# -- command line ---------------------------------------------------------------------------

def _parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B)?\s*", text, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 5GB or 500MB")
    scale = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[match.group(2).upper()]
    return int(float(match.group(1)) * scale)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="engram-export",
        description="Export a trained Engram checkpoint for inference: Engram layers under the "
                    "DeepSeek reference's names, hash constants, tokenizer and backbone "
                    "(format: docs/export.md).",
    )
    parser.add_argument("--load", required=True, metavar="CKPT_DIR",
                        help="checkpoint.save folder of the run (or one iter_XXXXXXX folder)")
    parser.add_argument("--out", required=True, metavar="DIR", help="export folder to create")
    parser.add_argument("--iteration", type=int, default=None,
                        help="iteration to export (default: the latest complete one)")
    parser.add_argument("--config", default=None, metavar="YAML",
                        help="the run's resolved config.yaml (engram-train writes it into "
                             "experiment.exp_dir); found next to CKPT_DIR when omitted")
    parser.add_argument("--tokenizer", default=None, metavar="PATH",
                        help="tokenizer.json (or its folder) if the run config's "
                             "engram_tokenizer_name_or_path does not resolve from here")
    parser.add_argument("--table-dtype", choices=sorted(TABLE_DTYPES), default=None,
                        help="store the Engram tables in this dtype (default: as trained)")
    parser.add_argument("--max-shard-size", type=_parse_size, default=DEFAULT_SHARD_BYTES,
                        metavar="SIZE", help="largest backbone file, e.g. 5GB (default)")
    parser.add_argument("--force", action="store_true", help="replace a non-empty --out")
    parser.add_argument("--no-verify", dest="verify", action="store_false",
                        help="skip the SHA-256 of every checkpoint file against its manifest "
                             "(sizes are still compared); for very large checkpoints")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        export_checkpoint(
            args.load, args.out, iteration=args.iteration, config=args.config,
            tokenizer=args.tokenizer, force=args.force, table_dtype=args.table_dtype,
            max_shard_bytes=args.max_shard_size, verify=args.verify,
        )
    except ExportError as err:
        raise SystemExit(f"engram-export: error: {err}") from None


if __name__ == "__main__":
    main()

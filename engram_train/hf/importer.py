"""``engram-import-hf``: a transformers DeepSeek-V3 folder -> a model-only checkpoint the
trainer continues from, on the layout it will train with.

    engram-import-hf --hf DIR --out CKPT_DIR [--tokenizer PATH] [--preset-name NAME]
    torchrun --nproc-per-node N -m engram_train.hf.importer --hf DIR --out CKPT_DIR \
        --tensor-model-parallel-size T --expert-model-parallel-size E --pipeline-parallel-size P

Each rank builds its shard of the backbone as the trainer does (without initialising it, no
DDP, no optimizer) and fills it from the folder: for every tensor of megatron's sharded state
dict it reads only the block of each folder tensor that lands in its shard (safetensors
``get_slice``; fp8 dequantized per block, ``rope_interleave: false`` rows reordered to
megatron's interleaved layout), one at a time, the files unmapped after each. The project's
checkpoint save then writes ``CKPT_DIR/iter_0000000``: weights only (manifest ``contents:
[model]``), which the trainer resumes on any layout with a fresh optimizer and the continuing
run's schedule from iteration 0. The model preset the folder implies goes to
``CKPT_DIR/conf/model/NAME.yaml`` (Engram off, ``engram_value_init: zero``); the trainer adds
Engram with ``checkpoint.load_engram=false`` (docs/huggingface.md). Peak memory per rank: its
shard in fp32, the save's copy of it, and one folder block.

The folder's family (``models/families.hf_family``: the one whose Hugging Face mapping reads
its ``config.json``; DeepSeek-V3's, or DeepSeek-V4.1's for ``model_type: deepseek_v41``) gives
the preset, the folder's reader and the tensor names (its ``import_plan``); this module builds
and fills the shards and saves them the same way for every family.
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engram_train.errors import EngramError
from engram_train.models.hf_folder import HFFolder, HFSourceError
from engram_train.models.hf_mapping import (  # noqa: F401  (HFImportError: re-exported)
    HFConfigError,
    HFImportError,
    ImportOptions,
    UnmappedTensorError,
)


_STACKED = re.compile(r"^(decoder\.layers\.)(\D.*)$")


def _global_view(sh) -> tuple[str, tuple, tuple, tuple]:
    """(dist-checkpoint key per layer, global shape, offset and local size) of a ShardedTensor;
    megatron's homogeneous layers stack the layer as the first axis of one key."""
    shape, offset = tuple(sh.global_shape), tuple(sh.global_offset)
    size = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
    match = _STACKED.match(sh.key)
    if match is None:
        return sh.key, shape, offset, size
    return f"{match.group(1)}{offset[0]}.{match.group(2)}", shape[1:], offset[1:], size[1:]


def _sharded_tensors(model: list) -> list:
    """This rank's ShardedTensors of `model` (factories such as SwiGLU's built into views of the
    parameters), as the checkpoint save lays them out."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    from engram_train.checkpoint.state import model_sharded_state_dict

    state = model_sharded_state_dict(model)
    apply_factories(state)
    return [v for v in nested_values(state) if isinstance(v, ShardedTensor)]


@torch.no_grad()
def fill_shard(model: list, folder: HFFolder, doc: dict, vocab: int, names: Callable,
               vocab_names: tuple[str, str], rows_of: Callable | None = None
               ) -> tuple[set[str], list[str]]:
    """Copy into this rank's shard of `model` (any TP, EP, PP) the blocks of the folder's
    tensors that land in it, one block at a time; returns (folder tensors used, warnings).
    `names(key, shape, rows)`: the folder tensors of a checkpoint tensor (None: kept as
    built); `vocab_names`: the folder's embedding and output layer; `rows_of(name, rows)`:
    the folder row of each checkpoint row (None: the same)."""
    tied = bool(doc.get("tie_word_embeddings")) and vocab_names[1] not in folder
    hf_rows = int(doc["vocab_size"])
    rows = min(vocab, hf_rows)
    used, warnings = set(), []
    for sh in _sharded_tensors(model):
        key, shape, offset, size = _global_view(sh)
        try:
            pieces = names(key, shape, rows)
        except UnmappedTensorError as err:
            raise HFImportError(str(err)) from None
        if pieces is None:
            continue
        target = sh.data
        lead = len(size) - target.dim()  # prepended axes (an expert's): size 1, not in the data
        filled = 0
        for piece in pieces:
            lo = [max(o, s) for o, s in zip(offset, piece.start)]
            hi = [min(o + n, s + z) for o, n, s, z in zip(offset, size, piece.start, piece.size)]
            if any(h <= low for low, h in zip(lo, hi)):
                continue
            source = vocab_names[0] if tied and piece.name == vocab_names[1] else piece.name
            if source not in folder:
                raise HFImportError(f"{folder.folder} has no {source} (megatron {key} needs it)")
            want = (hf_rows, *piece.shape[1:]) if piece.name in vocab_names else tuple(piece.shape)
            if folder.shape(source) != want:
                raise HFImportError(_shape_message(source, folder.shape(source), want,
                                                   piece.name in vocab_names, hf_rows))
            at = [a - s for a, s in zip(lo, piece.start)]
            extent = [b - a for a, b in zip(lo, hi)]
            box = target
            for dim, (a, o, n) in enumerate(zip(lo[lead:], offset[lead:], extent[lead:])):
                box = box.narrow(dim, a - o, n)
            if piece.squeeze:
                at, extent = at[1:], extent[1:]
            value = _read(folder, source, at, extent, rows_of)
            box.copy_(value.reshape(box.shape))
            filled += value.numel()
            used.add(source)
            folder.close()  # one block's pages at a time
        if key in ("embedding.word_embeddings.weight", "output_layer.weight") and rows < shape[0]:
            local_rows = range(offset[0], offset[0] + size[0])
            start = max(rows, local_rows.start)
            if start < local_rows.stop:
                target[start - offset[0]:].zero_()
                filled += (local_rows.stop - start) * target.shape[1]
            if offset[0] == 0:
                warnings.append(f"{key}: rows {rows}..{shape[0] - 1} (megatron's padding beyond "
                                f"config.json vocab_size={hf_rows}) start at zero")
        if filled != target.numel():
            raise HFImportError(f"{key}: the folder fills {filled} of this rank's "
                                f"{target.numel()} values")
    if hf_rows > vocab:
        warnings.append(f"config.json vocab_size={hf_rows} > the tokenizer's padded {vocab}: "
                        f"rows {vocab}.. of the embedding and lm_head are not imported")
    if tied:
        warnings.append("tie_word_embeddings: the output layer starts as a copy of the embedding "
                        "(the trainer keeps them apart)")
    return used, warnings


def _shape_message(source: str, stored: tuple, want: tuple, vocab: bool, hf_rows: int) -> str:
    """One line: the folder tensor's shape, the shape config.json implies, and the fix."""
    stored, want = tuple(stored), tuple(want)
    if vocab and stored[1:] == want[1:]:
        return (f"{source} has shape {stored}: {stored[0]} vocabulary rows, but config.json "
                f"vocab_size={hf_rows} needs {want}; set vocab_size to the tensor's "
                f"{stored[0]} rows (or give the folder's own weights)")
    return (f"{source} has shape {stored}, the model built from config.json needs {want}; "
            "give the config.json these weights were saved with")


def _read(folder: HFFolder, name: str, at: list[int], extent: list[int],
          rows_of: Callable | None) -> torch.Tensor:
    """The block ``[at, at + extent)`` of folder tensor `name` in megatron's row order."""
    order = rows_of(name, folder.shape(name)[0]) if extent and rows_of else None
    if order is None:
        return folder.read_block(name, at, extent)
    wanted = order[at[0]: at[0] + extent[0]]
    first, last = min(wanted), max(wanted)
    block = folder.read_block(name, [first, *at[1:]], [last - first + 1, *extent[1:]])
    return block[torch.tensor(wanted) - first]


def check_all_used(folder: HFFolder, used: set[str], skip: set[str]) -> None:
    """Every folder tensor landed on some rank (`skip` aside)."""
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sorted(used))
    left = sorted(set(folder.names()) - set().union(*map(set, gathered)) - skip)
    if left:
        raise HFImportError(f"{len(left)} tensors of {folder.folder} have no place in the model "
                            f"built from its config.json, e.g. {left[:4]}")


def _run_config(section: dict, tokenizer: Path, seq_length: int, tensor: int = 1,
                expert: int = 1, pipeline: int = 1):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf, open_dict

    from engram_train.config import register
    from engram_train.models.presets import CONF_DIR

    register()
    with initialize_config_dir(config_dir=str(Path(CONF_DIR).resolve()), version_base=None):
        cfg = compose("train", overrides=[
            f"data.tokenizer={tokenizer}", f"train.seq_length={seq_length}",
            f"system.tensor_model_parallel_size={tensor}",
            f"system.expert_model_parallel_size={expert}",
            f"system.pipeline_model_parallel_size={pipeline}"])
    with open_dict(cfg):
        cfg.model = OmegaConf.create(section)
    return cfg


def build_shard(cfg, vocab: int):
    """This rank's model chunks in the layout of ``cfg.system``, as the trainer builds them but
    without initialising the weights (every one is filled from the folder), DDP or optimizer."""
    import torch.distributed as dist

    from engram_train.models.builder import build_model
    from engram_train.runtime import initialize_distributed
    from engram_train.training.run_config import build_transformer_config, parallel_sizes

    config = build_transformer_config(cfg)
    config.perform_initialization = False
    sizes = parallel_sizes(cfg)
    world = dist.get_world_size() if dist.is_initialized() else int(
        __import__("os").environ.get("WORLD_SIZE", 1))
    if world % (sizes.tensor * sizes.pipeline) or (world // sizes.pipeline) % sizes.expert:
        raise HFImportError(f"{world} processes cannot hold tensor x pipeline = "
                            f"{sizes.tensor} x {sizes.pipeline} with expert parallel size "
                            f"{sizes.expert}: launch a multiple of their product (torchrun "
                            "--nproc-per-node)")
    if not dist.is_initialized():
        initialize_distributed(sizes, seed=int(cfg.train.seed))
    model = build_model(config, vocab, int(cfg.train.seq_length), wrap_with_ddp=False)
    return config, model


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def import_hf(hf: str | Path, out: str | Path, *, tokenizer: str | Path | None = None,
              preset_name: str = "hf_import", drop_mtp: bool = False, engram_layer_ids=None,
              seq_length: int = 4096, tensor: int = 1, expert: int = 1, pipeline: int = 1,
              table_dtype: str | None = None, placement: str | None = None,
              log: Callable[[str], None] | None = None) -> Path:
    """Write `hf` as model-only checkpoint `out` (iteration 0) in the layout tensor x expert x
    pipeline (torchrun, a multiple of tensor x pipeline processes), and its preset; returns the
    preset file. `table_dtype`, `placement` (DeepSeek-V4.1): the preset's Engram tables."""
    import torch.distributed as dist

    from engram_train.checkpoint import has_checkpoints
    from engram_train.config import uses_engram
    from engram_train.data import load_tokenizer
    from engram_train.engram.compressed_tokenizer import resolve_tokenizer_file
    from engram_train.models.families import hf_family
    from engram_train.training.run_config import padded_vocab_size

    log = log or (lambda message: print(f"engram-import-hf: {message}", flush=True))
    started = time.perf_counter()
    hf, out = Path(hf), Path(out)
    if not (hf / "config.json").is_file():
        raise HFImportError(f"--hf {hf}: no config.json (give a transformers model folder)")
    if has_checkpoints(out):
        raise HFImportError(f"--out {out} already holds checkpoints; choose an empty folder")
    doc = json.loads((hf / "config.json").read_text())
    options = ImportOptions(engram_layer_ids=engram_layer_ids, drop_mtp=drop_mtp,
                            table_dtype=table_dtype, placement=placement)
    try:
        plan = hf_family(doc).hf.import_plan(hf, doc, options)
    except (HFConfigError, HFSourceError) as err:
        raise HFImportError(str(err)) from None
    tokenizer_file = resolve_tokenizer_file(tokenizer or hf, field="--tokenizer")
    if plan.check_tokenizer is not None:
        plan.check_tokenizer(tokenizer_file)
    vocab = padded_vocab_size(load_tokenizer(tokenizer_file).vocab_size, tensor)
    cfg = _run_config(plan.section, tokenizer_file, seq_length, tensor, expert, pipeline)
    baseline = peak_rss_bytes()
    config, model = build_shard(cfg, vocab)
    folder = plan.folder
    used, warnings = fill_shard(model, folder, plan.fields, vocab, plan.names, plan.vocab_names,
                                plan.source_rows)
    if plan.table_names is not None:
        used |= fill_fp8_tables(model, folder, plan.table_names)
    folder.close()
    check_all_used(folder, used, plan.skip)
    if dist.get_rank() == 0:
        for note in plan.notes:
            log(note)
        for warning in [*folder.ignored_files_notes(), *folder.warnings, *warnings]:
            log(f"warning: {warning}")
    mapping = None
    if uses_engram(config):  # the run identity records the Engram hash
        from engram_train.engram.variant import build_hash_mapping

        mapping = build_hash_mapping(config)
    return write_import(out, hf, model, cfg, config, vocab, plan.section, preset_name, started,
                        baseline, log, mapping)


TABLE_KEY = ".engram.multi_head_embedding.weight"


def fill_fp8_tables(model: list, folder: HFFolder, names: Callable) -> set[str]:
    """This rank's rows of each fp8 Engram table: the folder's codes and scales as stored
    (a floating table quantized; the folder's ``read_table_rows``); `names`: the folder
    tensor of a table (`HFImport.table_names`). Returns the folder tensors used."""
    used = set()
    views = {view[0]: (sh, view) for sh in _sharded_tensors(model)
             for view in [_global_view(sh)]}
    for key, (sh, (_, shape, offset, size)) in views.items():
        if not key.endswith(TABLE_KEY):
            continue
        scale = views[key + "_scale"][0].data
        name = names(key, shape, 0)[0].name
        if name not in folder:
            raise HFImportError(f"{folder.folder} has no {name} (megatron {key} needs it)")
        if folder.shape(name) != tuple(shape):
            raise HFImportError(f"{name} has shape {folder.shape(name)}, the model built from "
                                f"config.json needs {tuple(shape)}")
        weight, rows = sh.data, int(size[0])
        step = max(1, (1 << 22) // max(1, int(shape[1])))
        for lo in range(0, rows, step):  # a bounded block of rows at a time
            codes, stored = folder.read_table_rows(name, int(offset[0]) + lo, min(step, rows - lo))
            weight.data[lo:lo + codes.shape[0]].view(torch.uint8).copy_(codes.view(torch.uint8))
            scale[lo:lo + codes.shape[0]].copy_(stored)
            folder.close()
        used.add(name)
    return used


def write_import(out: Path, hf: Path, model: list, cfg, config, vocab: int, section: dict,
                 preset_name: str, started: float, baseline: int,
                 log: Callable[[str], None], mapping=None) -> Path:
    """Save the filled shards as iteration 0 (model only), the preset and the ranks' memory;
    returns the preset file. `mapping`: the hash mapping of a model with Engram on."""
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from engram_train.checkpoint import save_checkpoint
    from engram_train.training.run_identity import run_identity

    save_checkpoint(out, 0, model, None,
                    extra={"consumed_samples": 0, "imported_from": str(hf.resolve()),
                           "run_config": OmegaConf.to_container(cfg, resolve=True)},
                    run_identity=run_identity(config, vocab, mapping))
    shard = sum(p.numel() for chunk in model for p in chunk.parameters())
    memory = {"rank": dist.get_rank(), "shard_parameters": shard, "peak_rss": peak_rss_bytes(),
              "rss_before_build": baseline}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, memory)
    preset_file = out / "conf" / "model" / f"{preset_name}.yaml"
    if dist.get_rank() == 0:
        preset_file.parent.mkdir(parents=True, exist_ok=True)
        section["engram_tokenizer_name_or_path"] = "${data.tokenizer}"
        preset_file.write_text(f"# Imported from {hf.resolve()} by engram-import-hf.\n"
                               + OmegaConf.to_yaml(OmegaConf.create(section)))
        (out / "import_memory.json").write_text(json.dumps(gathered, indent=1) + "\n")
        worst = max(gathered, key=lambda m: m["peak_rss"])
        log(f"wrote {out}/iter_0000000 (model only) and {preset_file} in "
            f"{time.perf_counter() - started:.1f} s; peak RSS {worst['peak_rss'] / 2**30:.2f} GiB "
            f"(rank {worst['rank']}, {worst['shard_parameters']} parameters in its shard)")
    dist.barrier()
    return preset_file


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="engram-import-hf",
        description="Import a transformers DeepSeek-V3 folder (Engram added) or a DeepSeek-V4.1 "
                    "folder (its Engram tables included) as a model-only checkpoint that "
                    "engram-train continues (docs/huggingface.md, docs/deepseek-v41.md).")
    parser.add_argument("--hf", required=True, metavar="DIR", help="config.json + safetensors")
    parser.add_argument("--out", required=True, metavar="CKPT_DIR", help="checkpoint folder to write")
    parser.add_argument("--tokenizer", default=None, metavar="PATH",
                        help="tokenizer.json or its folder (default: the one in --hf)")
    parser.add_argument("--preset-name", default="hf_import",
                        help="name of the model preset written to CKPT_DIR/conf/model/")
    parser.add_argument("--engram-layer-ids", type=int, nargs="+", default=None,
                        help="Engram layers of the preset (default: 1 and num_layers // 2)")
    parser.add_argument("--drop-mtp", action="store_true",
                        help="import without the multi-token-prediction layers")
    parser.add_argument("--seq-length", type=int, default=4096,
                        help="train.seq_length the model is built for (RoPE tables)")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1,
                        help="tensor-parallel size of the checkpoint (run under torchrun)")
    parser.add_argument("--expert-model-parallel-size", type=int, default=1,
                        help="expert-parallel size of the checkpoint (run under torchrun)")
    parser.add_argument("--pipeline-parallel-size", type=int, default=1,
                        help="pipeline stages the model is split over (run under torchrun)")
    parser.add_argument("--engram-table-dtype", default=None,
                        choices=("fp32", "bf16", "fp8_e4m3"),
                        help="DeepSeek-V4.1: the preset's Engram table dtype (fp8_e4m3 keeps the "
                             "release's FP8 codes and scales; default fp32)")
    parser.add_argument("--engram-table-placement", default=None, choices=("device", "host"),
                        help="DeepSeek-V4.1: where the preset keeps the Engram tables")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        import_hf(args.hf, args.out, tokenizer=args.tokenizer, preset_name=args.preset_name,
                  drop_mtp=args.drop_mtp, engram_layer_ids=args.engram_layer_ids,
                  seq_length=args.seq_length, tensor=args.tensor_model_parallel_size,
                  expert=args.expert_model_parallel_size, pipeline=args.pipeline_parallel_size,
                  table_dtype=args.engram_table_dtype, placement=args.engram_table_placement)
    except EngramError as err:
        raise SystemExit(f"engram-import-hf: error: {err}") from None


if __name__ == "__main__":
    main(sys.argv[1:])

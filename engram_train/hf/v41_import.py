"""``engram-import-hf`` of a DeepSeek-V4.1 folder (``importer.import_hf`` hands it over when
``config.json`` says ``model_type: deepseek_v41``).

The folder is what NeMo Automodel writes for V4.1 unquantized: the composite ``config.json``
(``text_config``, ``vision_config``) and safetensors under the released names (its state-dict
adapter's ``to_hf``: ``embed.weight``, ``layers.<i>.attn.wq_a.weight``,
``layers.<i>.ffn.experts.<e>.w1.weight``, ``layers.<i>.hc_attn_fn``,
``layers.<i>.engram.embed.weight``, ...; ``v41_names.py``). Each rank builds its shard of the
V4.1 model as the trainer does for the layout (TP x EP; the model's own refusals apply, e.g.
pipeline parallelism while V4.1 runs one stage) and reads only the blocks of the folder's
tensors that land in it (``importer.fill_shard``: safetensors ``get_slice``, one block at a
time). The preset (``model_family: deepseek_v41``, the folder's shapes, Engram on with the
folder's Engram fields: V4.1 ships its tables) goes to ``CKPT_DIR/conf/model/NAME.yaml``.

The folder may hold the release's quantized layout (FP8/FP4 weights with E8M0 ``.scale``
tensors, ``v41_quant_layout.py``): `V41Folder` dequantizes each block a rank reads from the
stored codes and scale blocks of that block alone. ``--engram-table-dtype fp8_e4m3``
(`table_fields`: fp8 tables trained by ``rowwise_adam`` without a master) copies the release's
FP8 codes and E8M0 scales of the Engram tables into the shards as stored (`fill_fp8_tables`);
``--engram-table-placement host`` builds the table shards in host memory and records it.

Skipped with one line saying how many: the DSpark/MTP draft (``mtp.*``) and the vision side
(``vision.*``, ``aligner.*``, ``image_*``, the routers' ``bias_vl``). Refused in one line: a
quantized weight without its scale or with a misshapen one, a dtype no V4.1 tensor uses, a
tensor the model has no place for, a tensor the model needs that the folder lacks, a shape
that differs from the one ``config.json`` implies, and Engram fields the tokenizer
contradicts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from engram_train.hf.config_map import HFConfigError
from engram_train.hf.importer import (
    HFImportError,
    _global_view,
    _run_config,
    _sharded_tensors,
    build_shard,
    check_all_used,
    fill_shard,
    peak_rss_bytes,
    write_import,
)
from engram_train.hf.source import HFFolder, HFSourceError
from engram_train.hf.v41_config_map import text_config, v41_preset_from_hf
from engram_train.hf.v41_names import skipped_kind, v41_pieces
from engram_train.hf.v41_quant_folder import V41Folder

VOCAB_NAMES = ("embed.weight", "head.weight")
TABLE_KEY = ".engram.multi_head_embedding.weight"
TABLE_DTYPES = ("fp32", "bf16", "fp8_e4m3")
# an fp8 table trains as docs/host-tables.md recommends (no float32 master: rowwise_adam)
FP8_TABLE_FIELDS = {"engram_table_dtype": "fp8_e4m3", "engram_optimizer": "rowwise_adam",
                    "engram_master_weights": False, "engram_optimizer_state_dtype": "bf16"}


def table_fields(table_dtype: str | None, placement: str | None) -> dict:
    """The preset's Engram table fields for ``--engram-table-dtype`` / ``--engram-table-placement``
    (None: the trainer's defaults, float32 tables with the model)."""
    fields: dict = {}
    if table_dtype not in (None, *TABLE_DTYPES):
        raise HFImportError(f"--engram-table-dtype {table_dtype}: one of {', '.join(TABLE_DTYPES)}")
    if table_dtype == "fp8_e4m3":
        fields.update(FP8_TABLE_FIELDS)
    elif table_dtype == "bf16":  # the 4-byte configuration
        fields.update(engram_table_dtype="bf16", engram_optimizer="rowwise_adam",
                      engram_master_weights=False, engram_optimizer_state_dtype="bf16")
    if placement is not None:
        fields["engram_table_placement"] = placement
    return fields


def _fp8_names(key: str, shape, vocab: int):
    """`v41_pieces`, with an fp8 table and its scales left to `fill_fp8_tables`."""
    if key.endswith(TABLE_KEY) or key.endswith(TABLE_KEY + "_scale"):
        return None
    return v41_pieces(key, shape, vocab)


def fill_fp8_tables(model: list, folder: V41Folder) -> set[str]:
    """This rank's rows of each fp8 Engram table: the folder's codes and scales as stored
    (a floating table quantized); returns the folder tensors used."""
    from engram_train.hf.v41_names import v41_pieces as pieces

    used = set()
    views = {view[0]: (sh, view) for sh in _sharded_tensors(model)
             for view in [_global_view(sh)]}
    for key, (sh, (_, shape, offset, size)) in views.items():
        if not key.endswith(TABLE_KEY):
            continue
        scale = views[key + "_scale"][0].data
        name = pieces(key, shape, 0)[0].name
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


def _skipped(folder: HFFolder) -> dict[str, list[str]]:
    kinds: dict[str, list[str]] = {"mtp": [], "vision": []}
    for name in folder.names():
        kind = skipped_kind(name)
        if kind:
            kinds[kind].append(name)
    return kinds


def check_engram_tokenizer(text: dict, tokenizer_file: Path) -> None:
    """The folder's compressed Engram vocabulary is the tokenizer's (the hash depends on it)."""
    if not text.get("engram_layer_ids"):
        return
    from engram_train.engram.compressed_tokenizer import CompressedTokenizer

    size = len(CompressedTokenizer(tokenizer_file))
    want = text.get("engram_compressed_vocab_size")
    if want is not None and int(want) != size:
        raise HFImportError(
            f"config.json text_config.engram_compressed_vocab_size={want}, the tokenizer "
            f"{tokenizer_file} compresses to {size}: the Engram hash needs the folder's own "
            "tokenizer (--tokenizer)")


def import_v41(hf: Path, out: Path, doc: dict, *, tokenizer=None, preset_name: str = "hf_import",
               engram_layer_ids=None, seq_length: int = 4096, tensor: int = 1, expert: int = 1,
               pipeline: int = 1, table_dtype: str | None = None, placement: str | None = None,
               log: Callable[[str], None] | None = None) -> Path:
    """`importer.import_hf` for a V4.1 folder (module docstring); returns the preset file."""
    import torch.distributed as dist

    from engram_train.data import load_tokenizer
    from engram_train.engram.compressed_tokenizer import resolve_tokenizer_file
    from engram_train.training.run_config import padded_vocab_size

    log = log or (lambda message: print(f"engram-import-hf: {message}", flush=True))
    started = time.perf_counter()
    if engram_layer_ids is not None:
        raise HFImportError("--engram-layer-ids: a DeepSeek-V4.1 folder ships its Engram layers "
                            "(config.json text_config.engram_layer_ids); drop the option")
    try:
        section = v41_preset_from_hf(doc)
        if section.get("use_engram"):
            section.update(table_fields(table_dtype, placement))
        elif table_dtype is not None or placement is not None:
            raise HFImportError("--engram-table-dtype/--engram-table-placement: the folder's "
                                "config.json has no Engram layers (text_config.engram_layer_ids)")
        text = text_config(doc)
        folder = V41Folder(hf)
        skipped = _skipped(folder)
        skip = {name for names in skipped.values() for name in names}
        folder.check(skip)  # quantized weights with their scales, known dtypes (headers)
    except (HFConfigError, HFSourceError) as err:
        raise HFImportError(str(err)) from None
    tokenizer_file = resolve_tokenizer_file(tokenizer or hf, field="--tokenizer")
    check_engram_tokenizer(text, tokenizer_file)
    vocab = padded_vocab_size(load_tokenizer(tokenizer_file).vocab_size, tensor)
    cfg = _run_config(section, tokenizer_file, seq_length, tensor, expert, pipeline)
    baseline = peak_rss_bytes()
    config, model = build_shard(cfg, vocab)
    fields = {"vocab_size": int(text["vocab_size"]), "tie_word_embeddings": False}
    fp8 = section.get("engram_table_dtype") == "fp8_e4m3"
    used, warnings = fill_shard(model, folder, fields, vocab,
                                names=_fp8_names if fp8 else v41_pieces, vocab_names=VOCAB_NAMES)
    if fp8:
        used |= fill_fp8_tables(model, folder)
    folder.close()
    check_all_used(folder, used, skip)
    if dist.get_rank() == 0:
        if skip:
            log(f"skipped {len(skipped['mtp'])} mtp.* tensors (the DSpark/MTP draft) and "
                f"{len(skipped['vision'])} vision tensors (vision.*, aligner.*, image_*, "
                "ffn.gate.bias_vl), which the text model does not hold")
        for warning in [*folder.ignored_files_notes(), *folder.warnings, *warnings]:
            log(f"warning: {warning}")
    mapping = None
    if config.use_engram:  # the run identity records the Engram hash
        from engram_train.engram.variant import build_hash_mapping

        mapping = build_hash_mapping(config)
    return write_import(out, hf, model, cfg, config, vocab, section, preset_name, started,
                        baseline, log, mapping)

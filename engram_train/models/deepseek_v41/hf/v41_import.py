"""``engram-import-hf`` of a DeepSeek-V4.1 folder: DeepSeek-V4.1's `HFMapping.import_plan`
(``hf/importer.import_hf`` asks for it when ``config.json`` says ``model_type: deepseek_v41``,
then builds and fills the shards as for every family).

The folder is what NeMo Automodel writes for V4.1 unquantized: the composite ``config.json``
(``text_config``, ``vision_config``) and safetensors under the released names (its state-dict
adapter's ``to_hf``: ``embed.weight``, ``layers.<i>.attn.wq_a.weight``,
``layers.<i>.ffn.experts.<e>.w1.weight``, ``layers.<i>.hc_attn_fn``,
``layers.<i>.engram.embed.weight``, ...; ``v41_names.py``). Each rank builds its shard of the
V4.1 model as the trainer does for the layout (TP x EP; the model's own refusals apply, e.g.
pipeline parallelism while V4.1 runs one stage) and reads only the blocks of the folder's
tensors that land in it (``hf/importer.fill_shard``: safetensors ``get_slice``, one block at
a time). The preset (``model_family: deepseek_v41``, the folder's shapes, Engram on with the
folder's Engram fields: V4.1 ships its tables) goes to ``CKPT_DIR/conf/model/NAME.yaml``.

The folder may hold the release's quantized layout (FP8/FP4 weights with E8M0 ``.scale``
tensors, ``v41_quant_layout.py``): `V41Folder` dequantizes each block a rank reads from the
stored codes and scale blocks of that block alone. ``--engram-table-dtype fp8_e4m3``
(`table_fields`: fp8 tables trained by ``rowwise_adam`` without a master) copies the release's
FP8 codes and E8M0 scales of the Engram tables into the shards as stored
(``hf/importer.fill_fp8_tables``);
``--engram-table-placement host`` builds the table shards in host memory and records it.

Skipped with one line saying how many: the DSpark/MTP draft (``mtp.*``) and the vision side
(``vision.*``, ``aligner.*``, ``image_*``, the routers' ``bias_vl``). Refused in one line: a
quantized weight without its scale or with a misshapen one, a dtype no V4.1 tensor uses, a
tensor the model has no place for, a tensor the model needs that the folder lacks, a shape
that differs from the one ``config.json`` implies, and Engram fields the tokenizer
contradicts.
"""

from __future__ import annotations

from pathlib import Path

from engram_train.models.deepseek_v41.hf.v41_config_map import (
    is_v41,
    text_config,
    v41_preset_from_hf,
)
from engram_train.models.deepseek_v41.hf.v41_names import skipped_kind, v41_pieces
from engram_train.models.deepseek_v41.hf.v41_quant_folder import V41Folder
from engram_train.models.hf_folder import HFFolder
from engram_train.models.hf_mapping import HFImport, HFImportError, ImportOptions

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
    """`v41_pieces`, with an fp8 table and its scales left to the table copy
    (`HFImport.table_names`)."""
    if key.endswith(TABLE_KEY) or key.endswith(TABLE_KEY + "_scale"):
        return None
    return v41_pieces(key, shape, vocab)


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


def reads(doc: dict) -> bool:
    """A DeepSeek-V4.1 ``config.json`` (composite or its text part)."""
    return is_v41(doc)


def import_plan(hf: Path, doc: dict, options: ImportOptions) -> HFImport:
    """The import of V4.1 folder `hf` (module docstring)."""
    if options.engram_layer_ids is not None:
        raise HFImportError("--engram-layer-ids: a DeepSeek-V4.1 folder ships its Engram layers "
                            "(config.json text_config.engram_layer_ids); drop the option")
    section = v41_preset_from_hf(doc)
    table_dtype, placement = options.table_dtype, options.placement
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
    notes = [f"skipped {len(skipped['mtp'])} mtp.* tensors (the DSpark/MTP draft) and "
             f"{len(skipped['vision'])} vision tensors (vision.*, aligner.*, image_*, "
             "ffn.gate.bias_vl), which the text model does not hold"] if skip else []
    fp8 = section.get("engram_table_dtype") == "fp8_e4m3"
    return HFImport(section=section, folder=folder, names=_fp8_names if fp8 else v41_pieces,
                    vocab_names=VOCAB_NAMES, skip=skip, notes=notes,
                    fields={"vocab_size": int(text["vocab_size"]), "tie_word_embeddings": False},
                    table_names=v41_pieces if fp8 else None,
                    check_tokenizer=lambda tokenizer: check_engram_tokenizer(text, tokenizer))

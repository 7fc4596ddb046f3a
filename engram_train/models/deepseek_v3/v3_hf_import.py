"""``engram-import-hf`` of a transformers DeepSeek-V3 folder: DeepSeek-V3's
`HFMapping.import_plan` (the shared import, ``hf/importer.py``, builds and fills the shards).

The preset is the folder's backbone (``v3_hf_config.preset_from_hf``) on the keys of the tiny
preset, Engram off and its value projection starting at zero (the trainer adds Engram with
``checkpoint.load_engram=false``); the tensors are read under transformers' names
(``v3_hf_names.hf_pieces``), block-scaled fp8 weights dequantized (``models/hf_folder.py``) and
``rope_interleave: false`` rows reordered to megatron's interleaved layout (`source_rows`).
Multi-token-prediction layers are refused unless dropped.
"""

from __future__ import annotations

import re
from pathlib import Path

from engram_train.models.deepseek_v3.v3_hf_config import preset_from_hf
from engram_train.models.deepseek_v3.v3_hf_names import hf_pieces, rope_permutation
from engram_train.models.hf_folder import HFFolder
from engram_train.models.hf_mapping import HFImport, HFImportError, ImportOptions

V3_VOCAB_NAMES = ("model.embed_tokens.weight", "lm_head.weight")


def model_section(preset: dict, layers: int, engram_layer_ids=None) -> dict:
    """The tiny preset's keys (Engram and mHC options included) with the folder's backbone,
    Engram off and its value projection starting at zero."""
    from omegaconf import OmegaConf

    from engram_train.models.presets import CONF_DIR

    section = OmegaConf.to_container(OmegaConf.load(Path(CONF_DIR) / "model" / "deepseek_v3_tiny.yaml"))
    section.update(preset)
    ids = engram_layer_ids or sorted({min(1, layers - 1), layers // 2})
    section.update(use_engram=False, engram_value_init="zero", engram_layer_ids=list(ids))
    return section


def _mtp_names(folder: HFFolder, layers: int) -> list[str]:
    pattern = re.compile(r"^model\.layers\.(\d+)\.")
    return [n for n in folder.names() if (m := pattern.match(n)) and int(m.group(1)) >= layers]


def source_rows(name: str, rows: int, doc: dict) -> list[int] | None:
    """For ``rope_interleave: false``: folder row of each megatron row of tensor `name`
    ([rows, ...]; transformers' rotary halves -> megatron's interleaved pairs); None when the
    rows are the same."""
    if doc.get("rope_interleave", True):
        return None
    rope, nope = int(doc["qk_rope_head_dim"]), int(doc["qk_nope_head_dim"])
    order = rope_permutation(rope)
    index = list(range(rows))
    if name.endswith(("self_attn.q_b_proj.weight", "self_attn.q_proj.weight")):
        for head in range(rows // (nope + rope)):
            base = head * (nope + rope) + nope
            index[base: base + rope] = [base + p for p in order]
        return index
    if name.endswith("self_attn.kv_a_proj_with_mqa.weight"):
        start = int(doc["kv_lora_rank"])
        index[start:] = [start + p for p in order]
        return index
    return None


def import_plan(hf: Path, doc: dict, options: ImportOptions) -> HFImport:
    """The import of DeepSeek-V3 folder `hf` (module docstring)."""
    if options.table_dtype is not None or options.placement is not None:
        raise HFImportError("--engram-table-dtype/--engram-table-placement: a DeepSeek-V3 import "
                            "has Engram off; the continued run sets its tables "
                            "(model.engram_table_dtype, model.engram_table_placement)")
    preset = preset_from_hf(doc)
    folder = HFFolder(hf, tuple((doc.get("quantization_config") or {}).get(
        "weight_block_size", (128, 128))))
    layers = int(doc["num_hidden_layers"])
    mtp = _mtp_names(folder, layers)
    if mtp and not options.drop_mtp:
        raise HFImportError(
            f"config.json num_nextn_predict_layers={doc.get('num_nextn_predict_layers')}: the "
            f"folder holds {len(mtp)} multi-token-prediction tensors (model.layers.{layers}.*), "
            "which the trainer does not train; pass --drop-mtp to import without them")
    return HFImport(section=model_section(preset, layers, options.engram_layer_ids),
                    folder=folder, names=hf_pieces, vocab_names=V3_VOCAB_NAMES, fields=doc,
                    skip=set(mtp), source_rows=lambda name, rows: source_rows(name, rows, doc))

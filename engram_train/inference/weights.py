"""An export's tensors for other consumers: one Engram layer under the reference's names, or
the whole model under megatron's single-rank state-dict names.

Everything is memory-mapped (`MappedSafetensors`): building these dicts reads no tensor data.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from engram_train.engram.reference_io import project_name
from engram_train.export.format import BACKBONE_INDEX, load_export_config
from engram_train.export.safetensors_io import MappedSafetensors
from engram_train.errors import InputError

# megatron's dist-checkpoint key of a SequentialMLP's experts: one [num_experts, out, in] tensor.
_STACKED_EXPERTS = re.compile(r"^(.+\.mlp\.experts)\.experts\.(linear_fc[12]\.weight)$")


def load_layer_state(path: str | os.PathLike, layer_id: int) -> dict[str, torch.Tensor]:
    """One Engram layer's tensors under the DeepSeek reference's names (its module's
    ``load_state_dict`` takes them as they are)."""
    export = load_export_config(path)
    if layer_id not in export.layers:
        raise InputError(f"layer {layer_id} is not an Engram layer of {path} "
                         f"({list(export.layer_ids)})")
    file = MappedSafetensors(Path(path) / export.layers[layer_id].file)
    return {name: file.tensor(name) for name in file.keys()}


def megatron_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The whole model under the state-dict names of a single-rank megatron model built by
    engram_train (``model.load_state_dict(..., strict=False)``: only ``_extra_state`` entries
    are absent). Converts the two naming differences: stacked experts
    (``mlp.experts.experts.linear_fc1.weight`` [E, out, in]) become
    ``mlp.experts.local_experts.<e>.linear_fc1.weight`` (SequentialMLP, moe_grouped_gemm off),
    and Engram tensors go back under ``decoder.layers.<L>.engram.`` with the table named
    ``multi_head_embedding.weight``."""
    path = Path(path)
    export = load_export_config(path)
    index = json.loads((path / BACKBONE_INDEX).read_text())
    files: dict[str, MappedSafetensors] = {}
    state: dict[str, torch.Tensor] = {}
    for key, name in index["weight_map"].items():
        file = files.setdefault(name, MappedSafetensors(path / name))
        tensor = file.tensor(key)
        match = _STACKED_EXPERTS.match(key)
        if match:
            for expert in range(tensor.shape[0]):
                state[f"{match.group(1)}.local_experts.{expert}.{match.group(2)}"] = tensor[expert]
        else:
            state[key] = tensor
    for layer_id in export.layer_ids:
        for name, tensor in load_layer_state(path, layer_id).items():
            state[f"decoder.layers.{layer_id}.engram.{project_name(name)}"] = tensor
    return state

"""Parameters per pipeline stage and rank, from the model built once on the meta device.

The whole model is built as one rank (TP = PP = EP = 1, ``training/param_count.build_on_meta``:
no weights, no initialization) and each parameter is assigned by name: to a pipeline stage
(its decoder layer; the embedding to the first stage, the output layer and final norms to the
last) and a share of it to a rank (split over TP, over EP x expert-TP, over the Engram table
shards, or replicated). Building one model and dividing is what keeps a 27B plan under a few
seconds: the rank's own model is never built.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from engram_train.models.families import family_of
from engram_train.memory_plan.plan_layout import Layout

# Parameter categories, by how a rank holds them: "dense" parameters are in megatron's DDP and
# optimizer (sharded over DP), "expert" ones over the expert data-parallel group, "table" ones
# in the Engram table optimizer.
GROUP = {
    "embedding": "dense", "output_layer": "dense", "attention": "dense", "dense_mlp": "dense",
    "shared_experts": "dense", "router": "dense", "norms": "dense", "mhc": "dense",
    "engram_branch": "dense", "routed_experts": "expert", "engram_tables": "table",
}
# Linear layers megatron splits over TP (column- or row-parallel); the MLA down-projections and
# latent norms, the router, norms, mHC mappings and the Engram branch are replicated.
_TP_SPLIT = re.compile(r"\.(linear_proj|linear_q_up_proj|linear_q_proj|linear_kv_up_proj|linear_fc1|linear_fc2)\.")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def category(name: str, param) -> str:
    if getattr(param, "is_engram_table", False):
        return "engram_tables"
    if getattr(param, "is_engram", False) or ".engram." in name:
        return "engram_branch"
    if name.startswith("embedding."):
        return "embedding"
    if name.startswith("output_layer."):
        return "output_layer"
    if ".mlp.experts." in name:
        return "routed_experts"
    if ".mlp.shared_experts." in name:
        return "shared_experts"
    if ".mlp.router." in name:
        return "router"
    if "_hc." in name or ".hc_head." in name:
        return "mhc"
    if ".self_attention." in name and "layernorm" not in name:
        return "attention"
    if ".mlp." in name:
        return "dense_mlp"
    return "norms"


def _divisor(cat: str, name: str, layout: Layout, terms=None) -> int:
    if terms is not None and cat in ("attention", "shared_experts"):
        return layout.tp if terms.tp_split(name) else 1
    if cat == "routed_experts":
        return layout.ep * layout.etp
    if cat == "engram_tables":
        return layout.table_shards
    if cat in ("embedding", "output_layer"):
        return layout.tp
    if cat in ("attention", "dense_mlp", "shared_experts") and _TP_SPLIT.search(name):
        return layout.tp
    return 1


def stage_of_layer(layer: int, num_layers: int, layout: Layout) -> int:
    """megatron's assignment: contiguous blocks, or round-robin chunks with a virtual pipeline."""
    chunks = layout.pp * (layout.vpp or 1)
    return (layer // (num_layers // chunks)) % layout.pp


@dataclass
class StageParams:
    """Parameters one rank of a pipeline stage holds, by category (after its share)."""

    stage: int
    params: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    table_rows: int = 0  # table rows of this rank (all its Engram layers)
    frozen: int = 0  # of the dense parameters: without a gradient (no grad buffer, no optimizer)
    fp32_kept: int = 0  # of the dense parameters: kept float32 under bf16 (V4.1's mHC, sinks, ...)
    largest: int = 0  # the largest single parameter shard (the optimizer steps one at a time)

    def group(self, name: str) -> int:
        return sum(n for cat, n in self.params.items() if GROUP[cat] == name)


def stage_params(model, config, layout: Layout) -> list[StageParams]:
    """``StageParams`` of every pipeline stage (each rank of a stage holds the same amounts)."""
    stages = [StageParams(s) for s in range(layout.pp)]
    seen: set[int] = set()
    terms = family_of(config).plan  # the family's own terms (DeepSeek-V4.1's), or None
    for name, param in model.named_parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        cat = terms.category(name, param) if terms is not None else category(name, param)
        match = (terms.layer_pattern if terms is not None else _LAYER).match(name)
        if match:
            where = [stage_of_layer(int(match.group(1)), config.num_layers, layout)]
        elif cat == "embedding":
            where = [0]
        else:  # output layer, final norm, mHC head
            where = [layout.pp - 1]
        div = _divisor(cat, name, layout, terms)
        if cat == "engram_tables":
            rows = -(-param.shape[0] // div)
            n = rows * param.shape[1]
        else:
            n = -(-param.numel() // div)
        for s in where:
            stages[s].params[cat] += n
            if cat != "engram_tables":  # the tables have their own optimizer
                stages[s].largest = max(stages[s].largest, n)
            if cat == "engram_tables":
                stages[s].table_rows += rows
            elif not param.requires_grad:
                stages[s].frozen += n
            if terms is not None and cat != "engram_tables" and param.dtype == torch.float32:
                stages[s].fp32_kept += n
    return stages


DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def weight_bytes(sp: StageParams, precision: str, table_dtype: str) -> dict[str, int]:
    """Weights of one rank by dtype: the model in ``system.precision``, the tables in
    ``model.engram_table_dtype`` (counted with the tables, engram_tables.py)."""
    n = sp.group("dense") + sp.group("expert")
    if precision == "fp32" or not sp.fp32_kept:
        return {f"weights_{precision}": n * DTYPE_BYTES[precision]}
    return {f"weights_{precision}": (n - sp.fp32_kept) * DTYPE_BYTES[precision],
            "weights_fp32_kept": sp.fp32_kept * 4}


def grad_buffer_bytes(sp: StageParams) -> int:
    """megatron DDP's gradient buffer: float32 for every dense and expert parameter
    (``grad_reduce_in_fp32``); the tables' gradients are rows (engram_tables.py)."""
    return 4 * (sp.group("dense") + sp.group("expert") - sp.frozen)

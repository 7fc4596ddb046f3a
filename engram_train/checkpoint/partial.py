"""Loading everything but Engram: the continued-pretraining recipe of
docs/engram-integration.md (backbone weights and their optimizer state from the checkpoint,
Engram keeps its fresh initialisation), and the way a checkpoint saved with Engram loads into a
model without it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import (
    dict_list_map_inplace,
    extract_matching_values,
    merge,
)
from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedTensor
from megatron.core.dist_checkpointing.utils import add_prefix_for_sharding
from megatron.core.optimizer import ChainedOptimizer

from engram_train.checkpoint.checkpoint_errors import CheckpointError
from engram_train.checkpoint.state import (
    OPTIMIZER_METADATA,
    check_loaded,
    is_engram_key,
    load_chunks,
    model_sharded_state_dict,
    saved_metadata,
)
from engram_train.runtime.optimizer_chain import CHAIN_BY_ROLE, ENGRAM_CHAIN_ROLE


def _is_table_optimizer(optimizer) -> bool:
    """The Engram table optimizer declares its ``chain_role``; megatron's optimizers do not."""
    return getattr(optimizer, "chain_role", None) == ENGRAM_CHAIN_ROLE


def optimizer_parts(optimizer) -> tuple[list, list]:
    """(megatron's optimizers, Engram table optimizers) of what `build_optimizer` returned."""
    chain = optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    parts = [o for o in chain if not _is_table_optimizer(o)]
    tables = [o for o in chain if _is_table_optimizer(o)]
    if chain[: len(parts)] != parts:
        raise CheckpointError("the Engram table optimizer must come after megatron's in the chain")
    return parts, tables


def _optimizer_request(ckpt: Path, model, parts: list, is_engram) -> tuple[Any, dict, dict]:
    """(how to load the loaded state into ``parts``, the Engram entries to start afresh, the
    request for everything else) of megatron's optimizers ``parts``, under the checkpoint's key
    layout: by role (see `load_checkpoint_dir`), or by position (older checkpoints)."""
    metadata = saved_metadata(ckpt)
    if metadata.get(CHAIN_BY_ROLE):
        chain = ChainedOptimizer(parts)
        request = chain.sharded_state_dict(model_sharded_state_dict(model), is_loading=True,
                                           metadata=metadata)
        fresh, request = extract_matching_values(request, is_engram)
        return chain.load_state_dict, fresh, request
    chained, fresh, request = _positional_request(ckpt, model, parts, is_engram)

    def load(loaded_optimizer):
        for i, part in enumerate(parts):
            part.load_state_dict(loaded_optimizer[i] if chained else loaded_optimizer)

    return load, fresh, request


def _positional_request(ckpt: Path, model, parts: list, is_engram) -> tuple[bool, dict, dict]:
    """(whether the checkpoint holds a chain, the Engram entries to start afresh, the request
    for everything else) of a checkpoint that keys its optimizer chain by position."""
    tensors = dist_checkpointing.load_tensors_metadata(str(ckpt))
    chained = any(key.startswith("chained_") for key in tensors)
    reference = model_sharded_state_dict(model)
    requests = []
    for i, part in enumerate(parts):
        sd = part.sharded_state_dict(dict(reference), is_loading=True, metadata=OPTIMIZER_METADATA)
        if chained:
            add_prefix_for_sharding(sd, f"chained_{i}.")
        requests.append(sd)
    if not chained and len(parts) != 1:
        raise CheckpointError(
            f"{ckpt} holds one optimizer's state but this run has {len(parts)} (MoE expert "
            "and dense parameters apart): load it with the layout it was saved with"
        )
    request = {i: sd for i, sd in enumerate(requests)} if chained else requests[0]
    fresh, request = extract_matching_values(request, is_engram)
    return chained, fresh, request


def _engram_in_megatron_optimizer(model) -> dict[str, torch.Tensor]:
    """{sharded key: tensor} of Engram's tensors that megatron's optimizer steps: those its
    dummy step before a load can change. The tables are hidden from it (the Engram table
    optimizer steps them): they are left out, so no copy of a (host-resident) table is made."""
    from engram_train.models.table_params import engram_table_params

    tables = {p.data_ptr() for p in engram_table_params(model)}
    return {
        sh.key: sh.data
        for chunk in model_sharded_state_dict(model).values()
        for sh in chunk.values()
        if isinstance(sh, ShardedTensor) and is_engram_key(sh.key)
        and sh.data.data_ptr() not in tables
    }


def load_without_engram(ckpt: Path, model, optimizer) -> tuple[int, dict[str, Any]]:
    """Everything but Engram: see `load_checkpoint_dir`.

    megatron's optimizers (not the Engram table optimizer) are requested under the key layout
    the checkpoint has: by role, or (older checkpoints) by position, where a single optimizer's
    keys carry no prefix and a chain's (several optimizers, or any Engram checkpoint) carry
    ``chained_<i>.``. The optimizer state of
    Engram's dense parameters (which sit in megatron's optimizer) is not read: its Adam moments
    start at zero and its fp32 master copy is the parameter as initialised.
    """

    def is_engram(x) -> bool:
        return isinstance(x, ShardedBase) and is_engram_key(x.key)

    state = model_sharded_state_dict(model)
    _, state = extract_matching_values(state, is_engram)
    # Engram's weights as they are now: preparing megatron's optimizer for a load runs a dummy
    # step (runtime/megatron_fixes.py) whose weight decay would otherwise reach them.
    engram_live = _engram_in_megatron_optimizer(model) if optimizer is not None else {}
    initial_engram = {key: data.detach().clone() for key, data in engram_live.items()}
    fresh_optim, load_optimizer = {}, None
    if optimizer is not None:
        parts, _ = optimizer_parts(optimizer)
        load_optimizer, fresh_optim, state["optimizer"] = _optimizer_request(
            ckpt, model, parts, is_engram)
    state["iteration"] = None
    state["extra"] = None

    loaded, not_in_ckpt, not_requested = dist_checkpointing.load(
        state, str(ckpt), strict="return_all"
    )
    not_in_ckpt = sorted(k for k in not_in_ckpt if not is_engram_key(k))
    not_requested = sorted(k for k in not_requested if not is_engram_key(k))
    if not_in_ckpt or not_requested:
        raise CheckpointError(
            f"{ckpt} does not match this model beyond Engram: missing {not_in_ckpt[:5]}, "
            f"unexpected {not_requested[:5]} ({len(not_in_ckpt)} and {len(not_requested)} keys)"
        )
    missing, unexpected = load_chunks(model, loaded, strict=False)
    other = [k for k in missing + unexpected if not is_engram_key(f".{k}") and "_extra_state" not in k]
    if other:
        raise CheckpointError(f"{ckpt}: model keys {other[:5]} did not load")
    if optimizer is not None:

        def initial(sh):
            if not isinstance(sh, ShardedTensor):
                raise CheckpointError(f"cannot initialise optimizer state {sh.key} afresh")
            kind, _, name = sh.key.split("optimizer.state.", 1)[1].partition(".")
            if kind == "param":  # the fp32 master copy: the parameter as initialised
                return initial_engram[name].to(sh.data.dtype).view_as(sh.data).clone()
            return torch.zeros_like(sh.data)

        dict_list_map_inplace(initial, fresh_optim)
        merge(loaded["optimizer"], fresh_optim)
        load_optimizer(loaded["optimizer"])
    with torch.no_grad():
        for key, data in engram_live.items():
            data.copy_(initial_engram[key])
    check_loaded(ckpt, model)
    return int(loaded["iteration"]), loaded.get("extra") or {}

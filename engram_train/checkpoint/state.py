"""What a checkpoint holds: megatron sharded state dicts of the model (and optimizer), which of
their entries are Engram's, and how large a checkpoint of a model is."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import is_main_replica
from megatron.core.utils import unwrap_model

from engram_train.checkpoint.checkpoint_errors import CheckpointError, DamagedCheckpointError
from engram_train.config import uses_engram
from engram_train.checkpoint.manifest import rank_world
from engram_train.runtime.optimizer_chain import CHAIN_BY_ROLE

# "fully_reshardable": the distributed optimizer's state is saved per model parameter, so a
# checkpoint loads under another (TP, PP, EP, DP) layout.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
# How checkpoints key the optimizer chain's state (the checkpoint's content metadata says which):
# by role (dense, expert, engram: the chain_optimizer_by_role patch), so that a checkpoint loads
# when expert parallelism changes the chain's shape; older checkpoints key it by position.
ROLE_KEYED_METADATA = {**OPTIMIZER_METADATA, CHAIN_BY_ROLE: True}
# Engram's parameters sit in each Engram layer's child module ``engram``
# (models/engram_layer.py), so their sharded keys, and the optimizer-state keys megatron derives
# from them, contain this part. Keys of a checkpoint can only be told apart by name: the model
# loading them may have no Engram at all.
ENGRAM_KEY_PART = ".engram."


def is_engram_key(key: str) -> bool:
    """Whether a sharded-state key (model or optimizer state) belongs to Engram."""
    return ENGRAM_KEY_PART in key


def model_sharded_state_dict(model: list[torch.nn.Module]) -> dict[str, Any]:
    """Keys as Megatron-LM writes them: ``model`` (or ``model0``, ``model1``... with VPP).

    Engram models are saved with global layer numbers in their keys (megatron's
    ``non_homogeneous_layers``): only some layers carry Engram, and the Engram tables are
    row-sharded tensors of their own (``MultiHeadEmbedding.sharded_state_dict``).
    """
    chunks = unwrap_model(model)

    def state(chunk):
        if uses_engram(chunk.config):
            return chunk.sharded_state_dict(metadata={"non_homogeneous_layers": True})
        return chunk.sharded_state_dict()

    if len(chunks) == 1:
        return {"model": state(chunks[0])}
    return {f"model{i}": state(chunk) for i, chunk in enumerate(chunks)}


def as_chain(optimizer):
    """``optimizer`` as a `ChainedOptimizer` (of one, when megatron built a single optimizer),
    so that every checkpoint keys its optimizer state the same way."""
    from megatron.core.optimizer import ChainedOptimizer

    return optimizer if isinstance(optimizer, ChainedOptimizer) else ChainedOptimizer([optimizer])


def save_metadata() -> dict:
    """The optimizer metadata new checkpoints are saved with (by role while its patch is on)."""
    by_role = "chained_optimizer_by_role" in _active()
    return dict(ROLE_KEYED_METADATA if by_role else OPTIMIZER_METADATA)


def saved_metadata(ckpt: Path, chain=None) -> dict:
    """The optimizer metadata to request ``ckpt``'s optimizer state with: its own content
    metadata, or for a checkpoint keyed by position, megatron's positional layout, refused when
    ``chain`` (this run's `ChainedOptimizer`) has another number of optimizers than it saved."""
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(str(ckpt))
    content = common.get("content_metadata") or {}
    if content.get(CHAIN_BY_ROLE):
        if "chained_optimizer_by_role" not in _active():
            raise CheckpointError(
                f"{ckpt} keys its optimizer state by role, which the chained_optimizer_by_role "
                "patch reads; it is disabled (ENGRAM_DISABLE_PATCHES): enable it to load"
            )
        return {**OPTIMIZER_METADATA, **content}
    saved = common.get("optimizer")
    if chain is not None and isinstance(saved, dict):
        count = len(saved) if saved and all(isinstance(k, int) for k in saved) else 1
        if count != len(chain.chained_optimizers):
            raise CheckpointError(
                f"{ckpt} keys its optimizer state by position in megatron's optimizer chain "
                f"(saved before checkpoints keyed it by role) and has {count} optimizer(s); this "
                f"run's chain has {len(chain.chained_optimizers)} (megatron keeps expert "
                "parameters in an optimizer of their own only with expert_model_parallel_size "
                "> 1). Resume it once with the expert_model_parallel_size it was saved with (1, "
                "or > 1) and save: the new checkpoint loads under any EP"
            )
    return dict(OPTIMIZER_METADATA)


def _active() -> list[str]:
    from engram_train.runtime.patches import active_patches

    return active_patches()


def full_sharded_state_dict(model, optimizer, is_loading: bool,
                            metadata: dict | None = None) -> dict[str, Any]:
    """The model's (and ``optimizer``'s, a `ChainedOptimizer`) sharded state; ``metadata`` is
    the optimizer's layout (default: `save_metadata`)."""
    state = model_sharded_state_dict(model)
    if optimizer is not None:
        # The optimizer finds each parameter's sharding in the nested model dicts (all chunks).
        state["optimizer"] = optimizer.sharded_state_dict(
            dict(state), is_loading=is_loading, metadata=metadata or save_metadata()
        )
    return state


def estimate_checkpoint_bytes(model: list[torch.nn.Module]) -> int:
    """Bytes a checkpoint of ``model`` takes, about: every tensor once (main replicas over all
    ranks) plus Adam's state of each parameter (two fp32 moments, and an fp32 master copy except
    for fp32 Engram tables, whose optimizer keeps none). Collective."""
    from engram_train.runtime.distributed import device

    total = 0
    for sh in nested_values(model_sharded_state_dict(model)):
        data = getattr(sh, "data", None)
        if not (isinstance(data, torch.Tensor) and is_main_replica(sh.replica_id)):
            continue
        state = 0
        if data.requires_grad:
            table_fp32 = sh.key.endswith("multi_head_embedding.weight") and data.element_size() == 4
            state = 8 if table_fp32 else 12
        total += data.numel() * (data.element_size() + state)
    if dist.is_initialized():
        t = torch.tensor([float(total)], dtype=torch.float64, device=device())
        dist.all_reduce(t)
        total = int(t.item())
    return total


# The NaN/inf check reads a tensor in blocks of rows of about this many bytes (as float32):
# torch.isfinite builds temporaries the size of its input (a bf16 abs, bools), which for a
# host-resident table would be several bytes per parameter beyond the steady state.
FINITE_CHECK_BLOCK_BYTES = 8 * 2**20


def all_finite(tensor: torch.Tensor, block_bytes: int = FINITE_CHECK_BLOCK_BYTES) -> bool:
    """Whether ``tensor`` holds no NaN or inf, checked by blocks of leading-dimension rows of
    about ``block_bytes`` (float32), so no temporary grows with the tensor. Device tensors
    synchronise once, at the end."""
    tensor = tensor.detach()
    if tensor.dtype == torch.float8_e4m3fn:  # no isfinite kernel: NaN is S.1111.111, no inf
        bits = tensor.reshape(max(1, tensor.shape[0]) if tensor.dim() else 1, -1).view(torch.uint8)
        step = max(1, block_bytes // max(1, bits.shape[1]))
        return not any(bool(bits[i:i + step].bitwise_and(0x7F).eq(0x7F).any())
                       for i in range(0, bits.shape[0], step))
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return True
    if tensor.dim() == 0 or tensor.numel() == 0:
        return bool(torch.isfinite(tensor).all())
    row = max(1, tensor[0].numel())
    step = max(1, block_bytes // (4 * row))
    on_device = tensor.device.type != "cpu"
    ok = None
    for start in range(0, tensor.shape[0], step):
        finite = torch.isfinite(tensor[start:start + step]).all()
        if not on_device:
            if not bool(finite):
                return False
        else:
            ok = finite if ok is None else ok.logical_and_(finite)
    return ok is None or bool(ok)


def nonfinite_parameter(model: list[torch.nn.Module],
                        block_bytes: int = FINITE_CHECK_BLOCK_BYTES) -> tuple[int, str] | None:
    """(rank, name) of a parameter holding NaN or inf on any rank, else None. Collective.
    Each parameter is read in blocks (`all_finite`)."""
    bad = None
    for chunk in unwrap_model(model):
        for name, param in chunk.named_parameters():
            if not all_finite(param, block_bytes):
                bad = name
                break
        if bad:
            break
    rank, world = rank_world()
    found = [bad]
    if world > 1:
        found = [None] * world
        dist.all_gather_object(found, bad)
    return next(((r, name) for r, name in enumerate(found) if name), None)


def load_chunks(model, loaded: dict, strict: bool) -> tuple[list[str], list[str]]:
    chunks = unwrap_model(model)
    missing, unexpected = [], []
    for i, chunk in enumerate(chunks):
        result = chunk.load_state_dict(loaded["model" if len(chunks) == 1 else f"model{i}"], strict=strict)
        if not strict:
            missing += result.missing_keys
            unexpected += result.unexpected_keys
    return missing, unexpected


def check_loaded(ckpt: Path, model) -> None:
    bad = nonfinite_parameter(model)
    if bad:
        raise DamagedCheckpointError(
            f"checkpoint {ckpt} loaded NaN or inf into parameter {bad[1]} (rank {bad[0]}): it is "
            "damaged, and its files were not verified against a manifest (checkpoint.verify=false, "
            "or saved before manifests existed). Use another checkpoint; with verification on, "
            "checkpoint.load_fallback=true passes over damaged ones"
        )

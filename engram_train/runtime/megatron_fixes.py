"""Repairs of megatron-core bugs: the bodies, probes and host conditions of those patches.

Which releases each repair is for, and why, is declared in ``runtime/patches.py`` (the patch
registry); nothing here runs except through it. The bugs show without Transformer Engine (a
CPU host, or a GPU host on the local spec) or with torch Adam (megatron's fallback when
neither TE nor Apex provides a fused Adam), on any device.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util

import torch

from engram_train.config import uses_hyper_connections
# The chained optimizer's state by role has a module of its own; the patch registry
# (runtime/patches.py) names its body here, with the other bodies.
from engram_train.runtime.optimizer_chain import (  # noqa: F401
    CHAIN_BY_ROLE,
    chain_keyed_by_position,
    key_chain_by_role,
)


def transformer_engine_available() -> bool:
    """True when transformer_engine.pytorch can be imported (the GPU extra is installed)."""
    try:
        return importlib.util.find_spec("transformer_engine") is not None and (
            importlib.util.find_spec("transformer_engine.pytorch") is not None
        )
    except (ImportError, ValueError):
        return False


def uses_torch_adam() -> bool:
    """megatron's optimizer falls back to torch Adam (no TE or Apex fused Adam)."""
    from megatron.core.optimizer import distrib_optimizer

    return not distrib_optimizer.HAVE_APEX_OR_TE


# ----------------------------------------------------------------- probes (still needed?)


def has_cuda_rng_state_helpers() -> bool:
    from megatron.core.tensor_parallel import random as mp_random

    return hasattr(mp_random, "_get_cuda_rng_state") and hasattr(mp_random, "_set_cuda_rng_state")


def te_general_gemm_unbound() -> bool:
    from megatron.core.transformer.moe import moe_utils

    return not hasattr(moe_utils, "te_general_gemm")


def mla_have_te_wrong() -> bool:
    from megatron.core.transformer import multi_latent_attention

    return multi_latent_attention.HAVE_TE is True


# ----------------------------------------------------------------------------- bodies


def bind_te_general_gemm(ctx) -> None:
    """``moe_utils.router_gating_linear`` reads ``te_general_gemm``, which is only bound when
    the TE import succeeds: without TE it raises NameError instead of taking the torch.mm path.
    """
    from megatron.core.transformer.moe import moe_utils

    ctx.set(moe_utils, "te_general_gemm", None)


def clear_mla_have_te(ctx) -> None:
    """``multi_latent_attention`` sets HAVE_TE = True even though its TELinear is a stand-in,
    and ``isinstance(x, TELinear)`` then raises TypeError. Without TE the flag must read False.
    """
    from megatron.core.transformer import multi_latent_attention

    ctx.set(multi_latent_attention, "HAVE_TE", False)


def unshare_torch_adam_step(ctx) -> None:
    """``DistributedOptimizer.load_state_dict`` gives every parameter's torch Adam state the
    *same* ``step`` tensor (its HybridDeviceOptimizer branch clones, the plain one does not).
    torch Adam increments ``step`` in place per parameter, so after a resume the shared counter
    grows by the number of parameters each step and the bias correction is wrong from the
    second step on: resume is no longer exact. Give each parameter its own copy.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.load_state_dict

    @functools.wraps(original)
    def load_state_dict(self, state_dict):
        result = original(self, state_dict)
        for state in self.optimizer.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                state["step"] = step.detach().clone()
        return result

    ctx.set(DistributedOptimizer, "load_state_dict", load_state_dict)


def init_states_before_load(ctx) -> None:
    """``DistributedOptimizer.sharded_state_dict(is_loading=True)`` calls ``self.state_dict()``,
    which with torch Adam asserts that the per-parameter ``step`` exists: loading a checkpoint
    into a freshly built optimizer (the normal resume) fails. megatron's own
    ``_init_optimizer_states_with_dummy_values`` (used on its FSDP path) creates the states that
    the load then overwrites in place.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.sharded_state_dict

    @functools.wraps(original)
    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading=False, *args, **kwargs):
        if is_loading and len(self.optimizer.state) == 0:
            self._init_optimizer_states_with_dummy_values()
        if model_sharded_state_dict is None:
            model_sharded_state_dict = {}
        return original(self, model_sharded_state_dict, is_loading, *args, **kwargs)

    ctx.set(DistributedOptimizer, "sharded_state_dict", sharded_state_dict)


def keep_torch_adam_step_on_load(ctx) -> None:
    """Without TE/Apex, megatron falls back to torch Adam, which keeps a per-parameter ``step``
    tensor in its state. ``DistributedOptimizer._set_main_param_and_optimizer_states`` copies
    every key of the destination state from the loaded tensors, but the reshardable loaders drop
    ``step`` (it is restored separately from the param groups) -> KeyError on every load.
    Supplying the destination's own ``step`` makes that copy a no-op.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states

    @functools.wraps(original)
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            state = self.optimizer.state[main_param]
            if "step" in state:
                tensors = dict(tensors, step=state["step"])
        return original(self, model_param, tensors)

    ctx.set(
        DistributedOptimizer, "_set_main_param_and_optimizer_states",
        _set_main_param_and_optimizer_states,
    )


def mixed_dtype_group_order(ctx) -> None:
    """``DistributedOptimizer`` numbers each model parameter's place in its optimizer group
    (``model_param_group_index_map``) in grad-buffer order, but fills the group's ``params`` with
    all float32 parameters' shards first, then the float16/bf16 ones' main shards. A group that
    holds both (float32 mHC mappings in a bf16 model) maps parameters to other parameters' main
    shards and Adam state: the checkpoint save fails on a size mismatch, or, where the sizes
    happen to agree, saves and loads the wrong tensors. The map is rebuilt in the groups' own
    order after construction (megatron-core 0.16.1-0.19.2 ``__init__``; the step is unaffected).
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if not hasattr(self, "model_fp32_groups"):  # megatron FSDP: no grad-buffer groups
            return
        groups = zip(self.model_fp32_groups, self.model_float16_groups, strict=True)
        for group_index, (fp32_params, float16_params) in enumerate(groups):
            for order, param in enumerate([*fp32_params, *float16_params]):
                self.model_param_group_index_map[param] = (group_index, order)

    ctx.set(DistributedOptimizer, "__init__", __init__)


def blended_dataset_rank_zero_alone(ctx) -> None:
    """``BlendedDataset._build_indices`` calls ``torch.distributed.get_rank()`` on a cache miss
    even when no process group exists (``GPTDataset`` checks ``is_initialized()`` first), so a
    weighted blend could not be built in a single process. Without a process group, the build
    runs with ``get_rank()`` answering 0; nothing changes when a process group exists.
    """
    from megatron.core.datasets.blended_dataset import BlendedDataset

    original = BlendedDataset._build_indices

    @functools.wraps(original)
    def _build_indices(self):
        import torch.distributed as dist

        if not dist.is_available() or dist.is_initialized():
            return original(self)
        with _get_rank_answers_zero(dist):
            return original(self)

    ctx.set(BlendedDataset, "_build_indices", _build_indices)


@contextlib.contextmanager
def _get_rank_answers_zero(dist):
    original = dist.get_rank
    dist.get_rank = lambda group=None: 0
    try:
        yield
    finally:
        dist.get_rank = original


def no_upstream_hyper_connections() -> bool:
    """megatron-core has no mHC of its own (upstream adds ``enable_hyper_connections``)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return "enable_hyper_connections" not in TransformerConfig.__dataclass_fields__


def _schedule_with_stream_rows(schedule):
    """``schedule`` whose P2P buffers hold n residual streams when the model enables mHC."""

    @functools.wraps(schedule)
    def run(*, model, seq_length, decoder_seq_length=None, **kwargs):
        from megatron.core.utils import get_model_config

        config = get_model_config(model[0] if isinstance(model, list) else model)
        if uses_hyper_connections(config):
            seq_length = seq_length * config.num_residual_streams
            if decoder_seq_length is not None:
                decoder_seq_length = decoder_seq_length * config.num_residual_streams
        return schedule(model=model, seq_length=seq_length,
                        decoder_seq_length=decoder_seq_length, **kwargs)

    return run


def pipeline_shapes_for_hyper_connections(ctx) -> None:
    from megatron.core.pipeline_parallel import schedules

    for name in ("forward_backward_pipelining_without_interleaving",
                 "forward_backward_pipelining_with_interleaving"):
        ctx.set(schedules, name, _schedule_with_stream_rows(getattr(schedules, name)))


# ----------------------------------------------- checkpoints megatron-core 0.19 wrote, on 0.16

# megatron-core 0.19 stores a checkpoint's common (non-tensor) state as one ShardedObject of this
# key inside the torch_dist files instead of ``common.pt``; 0.16 reads only ``common.pt``.
EMBEDDED_COMMON_STATE = "common_state"


def embedded_common_state_key() -> str:
    """The storage key of that object in the torch_dist files."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject(EMBEDDED_COMMON_STATE, None, (1,), (0,)).unique_key


def read_embedded_common_state(checkpoint_dir) -> dict:
    """The common state megatron-core 0.19 embeds in a checkpoint's torch_dist files, read in
    this process alone (no process group); only torch's safe types are unpickled."""
    import io

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load

    key = embedded_common_state_key()
    buffers = {key: io.BytesIO()}
    dcp_load(buffers, storage_reader=FileSystemReader(str(checkpoint_dir)), no_dist=True)
    loaded = buffers[key]
    if isinstance(loaded, io.BytesIO):
        loaded.seek(0)
        loaded = torch.load(loaded, weights_only=True)
    return loaded[0]


def _has_embedded_common_state(checkpoint_dir) -> bool:
    from pathlib import Path

    return not (Path(checkpoint_dir) / "common.pt").exists() and (
        Path(checkpoint_dir) / ".metadata").exists()


def load_embedded_common_state(ctx) -> None:
    """``dist_checkpointing.load`` and ``load_common_state_dict`` read a checkpoint without
    ``common.pt`` (written by 0.19) from its embedded common state: through a common-load
    strategy (megatron's own extension point) and a request for the embedded object, so that a
    strict load does not count it as a key the model lacks; its loaded copy is dropped."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    class EmbeddedCommonLoad(TorchCommonLoadStrategy):
        def load_common(self, checkpoint_dir):
            return read_embedded_common_state(checkpoint_dir)

    original_load = serialization.load
    original_common = serialization.load_common_state_dict

    @functools.wraps(original_load)
    def load(sharded_state_dict, checkpoint_dir, *args, **kwargs):
        if not _has_embedded_common_state(checkpoint_dir) or args or "common_strategy" in kwargs:
            return original_load(sharded_state_dict, checkpoint_dir, *args, **kwargs)
        rank = dist.get_rank() if dist.is_initialized() else 0
        sharded_state_dict[EMBEDDED_COMMON_STATE] = ShardedObject(
            EMBEDDED_COMMON_STATE, None, (1,), (0,), replica_id=rank)
        result = original_load(sharded_state_dict, checkpoint_dir,
                               common_strategy=EmbeddedCommonLoad(), **kwargs)
        sharded_state_dict.pop(EMBEDDED_COMMON_STATE, None)
        loaded = result[0] if isinstance(result, tuple) else result
        loaded.pop(EMBEDDED_COMMON_STATE, None)
        return result

    @functools.wraps(original_common)
    def load_common_state_dict(checkpoint_dir, *args, **kwargs):
        if _has_embedded_common_state(checkpoint_dir):
            return read_embedded_common_state(checkpoint_dir)
        return original_common(checkpoint_dir, *args, **kwargs)

    for owner in (dist_checkpointing, serialization):
        ctx.set(owner, "load", load)
        ctx.set(owner, "load_common_state_dict", load_common_state_dict)

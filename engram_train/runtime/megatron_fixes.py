"""Fixes for megatron-core 0.16.1 bugs that appear when Transformer Engine is absent.

These are independent of the device: they apply on any host without TE (a CPU box, or a
GPU box running the local spec). Each fix is a one-line attribute assignment on the
megatron module that has the bug; nothing is replaced when TE is importable.
Tracks megatron-core 0.16.1.
"""

from __future__ import annotations

import importlib.util

import torch

_APPLIED = False


def transformer_engine_available() -> bool:
    """True when transformer_engine.pytorch can be imported (the GPU extra is installed)."""
    try:
        return importlib.util.find_spec("transformer_engine") is not None and (
            importlib.util.find_spec("transformer_engine.pytorch") is not None
        )
    except (ImportError, ValueError):
        return False


def apply_megatron_fixes() -> None:
    """Idempotently patch the known TE-absent bugs of megatron-core 0.16.1."""
    global _APPLIED
    if _APPLIED or transformer_engine_available():
        return
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    # moe_utils.router_gating_linear reads `te_general_gemm`, which is only bound when the TE
    # import succeeds: without TE it raises NameError instead of taking the torch.mm path.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    # multi_latent_attention sets HAVE_TE = True even though its TELinear is a stand-in, and
    # `isinstance(x, TELinear)` then raises TypeError. Without TE the flag must read False.
    multi_latent_attention.HAVE_TE = False
    _fix_torch_adam_step_on_load()
    _fix_load_into_fresh_torch_adam()
    _fix_shared_torch_adam_step_after_load()
    _APPLIED = True


def _fix_shared_torch_adam_step_after_load() -> None:
    """``DistributedOptimizer.load_state_dict`` gives every parameter's torch Adam state the
    *same* ``step`` tensor (its HybridDeviceOptimizer branch clones, the plain one does not).
    torch Adam increments ``step`` in place per parameter, so after a resume the shared counter
    grows by the number of parameters each step and the bias correction is wrong from the
    second step on: resume is no longer exact. Give each parameter its own copy.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.load_state_dict

    def load_state_dict(self, state_dict):
        result = original(self, state_dict)
        for state in self.optimizer.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                state["step"] = step.detach().clone()
        return result

    DistributedOptimizer.load_state_dict = load_state_dict


def _fix_load_into_fresh_torch_adam() -> None:
    """``DistributedOptimizer.sharded_state_dict(is_loading=True)`` calls ``self.state_dict()``,
    which with torch Adam asserts that the per-parameter ``step`` exists: loading a checkpoint
    into a freshly built optimizer (the normal resume) fails. megatron's own
    ``_init_optimizer_states_with_dummy_values`` (used on its FSDP path) creates the states that
    the load then overwrites in place.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.sharded_state_dict

    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading=False, *args, **kwargs):
        if is_loading and len(self.optimizer.state) == 0:
            self._init_optimizer_states_with_dummy_values()
        if model_sharded_state_dict is None:
            model_sharded_state_dict = {}
        return original(self, model_sharded_state_dict, is_loading, *args, **kwargs)

    DistributedOptimizer.sharded_state_dict = sharded_state_dict


def _fix_torch_adam_step_on_load() -> None:
    """Without TE/Apex, megatron falls back to torch Adam, which keeps a per-parameter ``step``
    tensor in its state. ``DistributedOptimizer._set_main_param_and_optimizer_states`` copies
    every key of the destination state from the loaded tensors, but the reshardable loaders drop
    ``step`` (it is restored separately from the param groups) -> KeyError on every load.
    Supplying the destination's own ``step`` makes that copy a no-op.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            state = self.optimizer.state[main_param]
            if "step" in state:
                tensors = dict(tensors, step=state["step"])
        return original(self, model_param, tensors)

    DistributedOptimizer._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states

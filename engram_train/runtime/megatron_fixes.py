"""Fixes for megatron-core 0.16.1 bugs that appear when Transformer Engine is absent.

These are independent of the device: they apply on any host without TE (a CPU box, or a
GPU box running the local spec). Each fix is a one-line attribute assignment on the
megatron module that has the bug; nothing is replaced when TE is importable.
Tracks megatron-core 0.16.1.
"""

from __future__ import annotations

import importlib.util

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
    _APPLIED = True

"""The mHC backbone's fields (``docs/mhc.md``) and their rules, composed into the megatron
configs by ``engram_train.config``; `residual_streams`, the rule ``engram_hc_mult`` follows;
also the int check every config module shares."""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

from engram_train.errors import ConfigError, ConfigTypeError


def require_int(name: str, value: Any, element: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        what = "entries" if element else "value"
        raise ConfigTypeError(f"{name} {what} must be int, got {value!r}.")


@dataclass
class HyperConnectionConfig:
    """mHC fields of the backbone (``docs/mhc.md``), under upstream megatron-core's names (it
    adds them after 0.19), so that a config written for upstream means the same here."""

    enable_hyper_connections: bool = False
    """Multi-stream residual (DeepSeek's mHC): every attention and MLP/MoE sublayer reads and
    writes `num_residual_streams` streams through learned mappings."""

    num_residual_streams: int = 4
    """n: residual streams with mHC on (DeepSeek: 4)."""

    mhc_sinkhorn_iterations: int = 20
    """Sinkhorn iterations that make the stream-mixing matrix doubly stochastic."""

    mhc_init_gating_factor: float = 0.01
    """Initial `scale` of the mappings (0: the mappings start as constants, and an n-stream
    model without Engram computes the single-stream model's function)."""


def uses_hyper_connections(config: Any) -> bool:
    """mHC on: a config composed with `HyperConnectionConfig` that enables it (megatron's own
    config, which a DeepSeek-V3 spec also accepts, never is)."""
    return isinstance(config, HyperConnectionConfig) and config.enable_hyper_connections


def residual_streams(enable_hyper_connections: bool, num_residual_streams: int) -> int:
    """Streams of the backbone's residual: ``num_residual_streams`` with mHC on, else 1. What
    an unset ``engram_hc_mult`` (None) follows."""
    return int(num_residual_streams) if enable_hyper_connections else 1


MHC_RECOMPUTE_MODULE = "mhc"
"""The selective recompute module of the mHC mappings (upstream megatron-core's name)."""


def take_mhc_recompute_module(config) -> bool | None:
    """Remove ``"mhc"`` from ``recompute_modules`` before megatron's own validation (which does
    not know it) and say whether it was asked for: ``None`` when ``recompute_modules`` is unset
    (the default applies, ``check_hyper_connections``)."""
    modules = config.recompute_modules
    if modules is None:
        return None
    config.recompute_modules = [m for m in modules if m != MHC_RECOMPUTE_MODULE]
    return MHC_RECOMPUTE_MODULE in modules


def resolve_mhc_recompute(config, requested: bool | None) -> None:
    """``"mhc"`` back in ``recompute_modules`` when the mappings are recomputed: when asked for,
    and by default with mHC unless ``recompute_granularity`` is ``full`` (the whole layer is
    recomputed then). Recomputing the mapping from X costs one more mapping forward per
    sublayer and keeps X and the sublayer output instead of the float32 copies of the streams
    and the Sinkhorn iterations (``docs/mhc.md``). ``recompute_modules`` without ``"mhc"``
    turns it off."""
    if requested and not config.enable_hyper_connections:
        raise ConfigError(
            "recompute_modules contains 'mhc' but enable_hyper_connections=false: drop 'mhc' "
            "or set enable_hyper_connections: true"
        )
    if requested is None:
        requested = config.enable_hyper_connections and config.recompute_granularity != "full"
    if requested:
        config.recompute_modules = [*config.recompute_modules, MHC_RECOMPUTE_MODULE]


def check_hyper_connections(config, mhc_recompute: bool | None = None) -> None:
    """mHC rules, and `engram_hc_mult` resolved from the backbone (before Engram's checks);
    ``mhc_recompute``: ``take_mhc_recompute_module``'s answer."""
    if not isinstance(config.enable_hyper_connections, bool):
        raise ConfigTypeError(
            f"enable_hyper_connections must be a bool, got {config.enable_hyper_connections!r}."
        )
    for name in ("num_residual_streams", "mhc_sinkhorn_iterations"):
        require_int(name, getattr(config, name))
    value = config.mhc_init_gating_factor
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigTypeError(f"mhc_init_gating_factor must be a number, got {value!r}.")
    config.mhc_init_gating_factor = float(value)
    resolve_mhc_recompute(config, mhc_recompute)
    streams = residual_streams(config.enable_hyper_connections, config.num_residual_streams)
    hc_mult = config.engram_hc_mult
    # The ranges hold with mHC off as well: a value no mHC run could use is a mistake, and
    # turning mHC on later must not be the first time it is noticed.
    off = "" if config.enable_hyper_connections else " (checked with enable_hyper_connections=false too)"
    if config.num_residual_streams < 1:
        raise ConfigError(
            f"num_residual_streams={config.num_residual_streams} must be >= 1 (>= 2 with "
            f"enable_hyper_connections=true; DeepSeek uses 4){off}: set it to 4 or drop it"
        )
    if config.mhc_sinkhorn_iterations < 1:
        raise ConfigError(
            f"mhc_sinkhorn_iterations={config.mhc_sinkhorn_iterations} must be >= 1{off}: set it "
            "to 20 (the default) or drop it"
        )
    if config.mhc_init_gating_factor < 0:
        raise ConfigError(
            f"mhc_init_gating_factor={config.mhc_init_gating_factor} must be >= 0{off}: set it to "
            "0.01 (the default) or drop it"
        )
    if config.enable_hyper_connections:
        if config.num_residual_streams < 2:
            raise ConfigError(
                f"num_residual_streams={config.num_residual_streams} must be >= 2 with "
                "enable_hyper_connections=true (DeepSeek uses 4); or set "
                "enable_hyper_connections: false"
            )
        if config.mtp_num_layers:
            raise ConfigError(
                "enable_hyper_connections=true with mtp_num_layers: multi-token prediction "
                "layers take a single-stream input; set mtp_num_layers: null"
            )
        if (config.recompute_granularity == "selective"
                and "layernorm" in (config.recompute_modules or [])):
            raise ConfigError(
                "enable_hyper_connections=true with recompute_modules containing 'layernorm': "
                "the mHC layer does not recompute its norms; drop 'layernorm' (core_attn, mlp, "
                "moe and the other modules are recomputed as usual)"
            )
        if config.cuda_graph_impl not in (None, "none"):
            raise ConfigError(
                f"enable_hyper_connections=true with cuda_graph_impl={config.cuda_graph_impl!r}: "
                "CUDA graphs of the mHC layer are not supported; set cuda_graph_impl: none"
            )
        if hc_mult is not None and hc_mult != streams:
            raise ConfigError(
                f"engram_hc_mult={hc_mult} differs from num_residual_streams={streams}: the "
                "Engram branch reads and writes every residual stream. Leave engram_hc_mult "
                f"unset (null: it follows the backbone) or set it to {streams}"
            )
    elif hc_mult is not None and hc_mult != 1 and config.use_engram:
        raise ConfigError(
            f"engram_hc_mult={hc_mult} needs a multi-stream backbone: set "
            f"enable_hyper_connections: true and num_residual_streams: {hc_mult}, or leave "
            "engram_hc_mult unset (null) / 1 for the single-stream backbone"
        )
    if hc_mult is None:
        config.engram_hc_mult = streams

"""Engram configuration: `EngramConfig`, every Engram field with the paper's defaults, its
validation, and `resolve` (a model section with every Engram and mHC field present).

The option names live in `choices`; megatron's configs composed with `EngramConfig`
(`EngramTransformerConfig`, `EngramMLATransformerConfig`) in `composed`, built on first access
so that ``import engram_train`` does not import megatron.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engram_train.config.choices import CHOICES
from engram_train.config.family import check_family_fields
from engram_train.config.mhc import HyperConnectionConfig, require_int, residual_streams
from engram_train.errors import ConfigError, ConfigTypeError


@dataclass
class EngramConfig:
    """Engram fields (spec sections 1-4). Engram checks run only when `use_engram` is True."""

    use_engram: bool = False
    """Add Engram branches to the layers in `engram_layer_ids`."""

    engram_variant: str = "paper"
    """Which Engram branch: 'paper' (DeepSeek's Engram paper: short conv, per-stream key
    projections with biases) or 'deepseek_v41' (DeepSeek-V4.1's: one fused ``wkv``, no conv,
    look-back that stops at document starts and padding). The hash, table and optimizer
    fields mean the same under both; V4.1's names and the rules are in docs/deepseek-v41.md."""

    engram_tokenizer_name_or_path: str | None = None
    """Local `tokenizer.json`, or a folder holding it; defines the compressed vocabulary."""

    engram_vocab_size: list[int] = field(default_factory=lambda: [1131200, 1131200])
    """Minimum table size per n-gram order 2..N; each head gets the next unused prime above it."""

    max_ngram_size: int = 3
    """N: n-grams of orders 2..N are hashed."""

    n_embed_per_ngram: int = 512
    """Memory width per n-gram order, split evenly over its heads."""

    n_head_per_ngram: int = 8
    """H: hash heads (separate prime-sized tables) per n-gram order."""

    engram_layer_ids: list[int] = field(default_factory=lambda: [1, 15])
    """0-based global layer numbers that carry an Engram branch; kept sorted (the order given
    does not matter: table primes are assigned in increasing layer order)."""

    engram_pad_id: int = 0
    """Raw tokenizer id used to pad n-grams at the start of a row (its compressed id is used)."""

    engram_seed: int = 0
    """Seeds the hash multipliers and the partition-invariant table init."""

    engram_kernel_size: int = 4
    """Kernel of the short causal depthwise conv (dilation = max_ngram_size)."""

    engram_hc_mult: int | None = None
    """G: residual streams the Engram branch reads and writes. Unset (None): follows the
    backbone (``num_residual_streams`` with mHC on, else 1); an explicit value must match it.
    The standalone module (reference parity, export) takes any G >= 1."""

    engram_embedding_parallel_size: int = 1
    """Ranks that share (row-shard) each Engram table with method 'alltoall'."""

    engram_embedding_parallel_method: str = "alltoall"
    """'alltoall' (own group, independent of TP) or 'allreduce' (vocab-parallel over TP)."""

    engram_offload_embedding_optimizer_states: bool = False
    """Keep the Engram tables' optimizer states (and fp32 master) in host memory."""

    engram_prefetch: bool = True
    """Start every Engram layer's lookup at the start of its model chunk's forward, so the row
    exchange runs while the layers before it compute (False: each layer looks up when it runs)."""

    engram_optimizer: str = "sparse_adam"
    """Table optimizer: 'sparse_adam' (lazy row-wise Adam: a step costs the rows its tokens
    touch) or 'adam' (dense Adam: every row moves every step, cost scales with the table)."""

    engram_table_placement: str = "device"
    """Where the table shards live: 'device' (with the model) or 'host' (host memory, pinned
    under CUDA, with their optimizer state; rows are gathered on the host and copied to the
    device per lookup, gradient rows come back and the table's Adam runs on the host)."""

    engram_lr_multiplier: float = 5.0
    """Engram table learning rate = base learning rate x this (paper: 5)."""

    engram_weight_decay: float = 0.0
    """Weight decay of the Engram tables (paper: none)."""

    engram_reset_at_eos: bool = False
    """Opt-in: n-grams do not cross an EOS in packed sequences (the reference does not reset)."""

    engram_eos_id: int | None = None
    """Raw tokenizer id of EOS; required by `engram_reset_at_eos`."""

    engram_init_std: float = 0.02
    """Std of the normal init of Engram tables and projections."""

    engram_gate_eps: float | None = None
    """``engram_variant=deepseek_v41``: epsilon of the gate's RMS norms (V4.1's
    ``rms_norm_eps``). None: the backbone's ``layernorm_epsilon`` (V4.1 uses one epsilon for
    both), or V4.1's 1e-20 for a config without a backbone. The paper gate keeps float32's
    machine epsilon, so the field is refused there."""

    engram_value_init: str = "normal"
    """Init of Engram's value projection: 'normal' (N(0, engram_init_std^2)) or 'zero': the branch
    then adds nothing at step 0, so Engram added to a trained model starts from its function
    (docs/huggingface.md, continued pretraining)."""

    engram_table_dtype: str = "fp32"
    """Storage dtype of the Engram tables: 'fp32', 'bf16' (the optimizer keeps float32
    master rows for bf16 tables) or 'fp8_e4m3' (FP8 E4M3 rows with one E8M0 scale per row and
    32 columns, as DeepSeek-V4.1's release stores them; frozen with `engram_freeze_tables`, or
    trained by rowwise_adam without master, re-quantized with stochastic rounding:
    docs/host-tables.md). The Engram projections, norms and conv follow the model's
    `params_dtype`."""

    engram_master_weights: bool = True
    """bf16 tables: keep a float32 master copy in the optimizer (True) or update the bf16 values
    in float32 and round them back stochastically, with bits hashed from (engram_seed, step,
    row, column) so every layout gives the same tables (False; needs rowwise_adam)."""

    engram_optimizer_state_dtype: str = "fp32"
    """dtype of rowwise_adam's per-element first moment: 'fp32' or 'bf16' (stochastically
    rounded like the values); its second moment is one float32 per row (bf16, stochastically
    rounded, for fp8_e4m3 tables)."""

    engram_overlap_host_update: bool = True
    """Host-resident tables: run step t's table update on a host thread while step t+1 starts;
    a lookup waits only for the rows step t is still updating (the result is bit-identical)."""

    engram_one_row_per_head: bool = False
    """Ablation control: every head's table is one row (every n-gram reads the same row), so the
    memory is gone while the projections, gate and conv stay; `engram_vocab_size` is ignored."""

    engram_freeze_tables: bool = False
    """Ablation control: the tables keep their initial values (their learning rate is 0); the
    rest of the Engram branch trains as usual. With `engram_table_dtype: fp8_e4m3` the tables
    are fixed data: no gradient and no optimizer state (1.03 bytes per parameter)."""

    def __post_init__(self) -> None:
        self._check_engram_types()
        if self.use_engram:
            self._check_engram_values()

    # -- helpers for loaders ------------------------------------------------------------

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """Names of the Engram fields (handy to split a YAML section from megatron's)."""
        return tuple(f.name for f in dataclasses.fields(EngramConfig))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]):
        """Build from a mapping; unknown keys are an error rather than silently ignored."""
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(
                f"{cls.__name__}.from_dict: unknown field(s) {unknown}; fix the spelling or drop "
                f"them (Engram fields: {list(cls.field_names())})."
            )
        return cls(**dict(values))

    # -- validation ---------------------------------------------------------------------

    def validate_num_layers(self, num_layers: int) -> None:
        """Every Engram layer id must name a layer of the model."""
        if not self.use_engram:
            return
        bad = [i for i in self.engram_layer_ids if i >= num_layers]
        if bad:
            raise ConfigError(
                f"engram_layer_ids {bad} are out of range for num_layers={num_layers}: "
                f"ids are 0-based global layer numbers, use values in [0, {num_layers - 1}]."
            )

    def validate_hidden_size(self, hidden_size: int) -> None:
        """The Engram gate and projections need a positive model width."""
        if not self.use_engram:
            return
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, numbers.Integral):
            raise ConfigTypeError(f"hidden_size must be an int, got {hidden_size!r}.")
        if hidden_size < 1:
            raise ConfigError(f"hidden_size={hidden_size} must be >= 1 for Engram layers.")

    def _check_engram_types(self) -> None:
        """Each field against its annotation (the dataclass is the only list of types)."""
        for f in dataclasses.fields(EngramConfig):
            name, kind, value = f.name, f.type, getattr(self, f.name)
            if kind == "bool" and not isinstance(value, bool):
                raise ConfigTypeError(f"{name} must be a bool (True/False), got {value!r}.")
            if kind == "int" or (kind == "int | None" and value is not None):
                require_int(name, value)
            if kind == "float" or (kind == "float | None" and value is not None):
                if isinstance(value, bool) or not isinstance(value, numbers.Real):
                    raise ConfigTypeError(f"{name} must be a number, got {value!r}.")
                setattr(self, name, float(value))
            if kind == "list[int]":
                if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
                    # OmegaConf ListConfig is a Sequence; a bare int is the common mistake.
                    raise ConfigTypeError(f"{name} must be a list of ints, got {value!r}.")
                for item in value:
                    require_int(name, item, element=True)
                ints = [int(v) for v in value]
                # Layer ids are kept sorted: table primes are handed out layer by layer in this
                # order, so [3, 1] and [1, 3] build the same tables (and load the same checkpoints).
                setattr(self, name, sorted(ints) if name == "engram_layer_ids" else ints)
        if self.engram_hc_mult is None:  # a composed config resolved it from its backbone first
            self.engram_hc_mult = 1  # the standalone module: a single-stream backbone
        path = self.engram_tokenizer_name_or_path
        if path is not None:
            if not isinstance(path, (str, os.PathLike)):
                raise ConfigTypeError(
                    f"engram_tokenizer_name_or_path must be a path string, got {path!r}."
                )
            self.engram_tokenizer_name_or_path = os.fspath(path)
        self._check_choices(values=False)

    def _check_choices(self, values: bool) -> None:
        """Every `CHOICES` field is a name (always), one of its names (``values``)."""
        for name, (allowed, meaning) in CHOICES.items():
            value = getattr(self, name)
            if not isinstance(value, str):
                raise ConfigTypeError(f"{name} must be a string, one of {allowed}, got {value!r}.")
            if values and value not in allowed:
                raise ConfigError(f"{name}={value!r} must be one of {allowed}: {meaning}.")

    def _check_layer_ids(self) -> None:
        ids = self.engram_layer_ids
        if not ids:
            raise ConfigError(
                "engram_layer_ids is empty: list the layers to augment, or set use_engram=False."
            )
        negative = [i for i in ids if i < 0]
        if negative:
            raise ConfigError(
                f"engram_layer_ids {negative} are negative: use 0-based global layer numbers."
            )
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        if duplicates:
            raise ConfigError(f"engram_layer_ids repeats {duplicates}: list each layer once.")

    def _check_engram_values(self) -> None:
        self._check_choices(values=True)
        n = self.max_ngram_size
        if n < 2:
            raise ConfigError(
                f"max_ngram_size={n} must be >= 2: Engram hashes n-grams of orders "
                "2..max_ngram_size."
            )
        if len(self.engram_vocab_size) != n - 1:
            raise ConfigError(
                f"engram_vocab_size has {len(self.engram_vocab_size)} entries but "
                f"max_ngram_size={n} needs {n - 1} (one per n-gram order 2..{n}): "
                "give one table size per order."
            )
        small = [v for v in self.engram_vocab_size if v < 2]
        if small:
            raise ConfigError(f"engram_vocab_size entries {small} must be >= 2 (table sizes).")
        if self.n_head_per_ngram < 1:
            raise ConfigError(f"n_head_per_ngram={self.n_head_per_ngram} must be >= 1.")
        if self.n_embed_per_ngram < 1 or self.n_embed_per_ngram % self.n_head_per_ngram:
            raise ConfigError(
                f"n_embed_per_ngram={self.n_embed_per_ngram} must be a positive multiple of "
                f"n_head_per_ngram={self.n_head_per_ngram}: each head's row width is "
                "n_embed_per_ngram // n_head_per_ngram."
            )
        self._check_layer_ids()
        if self.engram_pad_id < 0:
            raise ConfigError(f"engram_pad_id={self.engram_pad_id} must be a raw token id >= 0.")
        if self.engram_seed < 0:
            raise ConfigError(
                f"engram_seed={self.engram_seed} must be >= 0 (numpy seeds are unsigned)."
            )
        if self.engram_kernel_size < 1:
            raise ConfigError(f"engram_kernel_size={self.engram_kernel_size} must be >= 1.")
        if self.engram_hc_mult < 1:
            raise ConfigError(
                f"engram_hc_mult={self.engram_hc_mult} must be >= 1 (1 for a plain backbone)."
            )
        if self.engram_embedding_parallel_size < 1:
            raise ConfigError(
                "engram_embedding_parallel_size="
                f"{self.engram_embedding_parallel_size} must be >= 1."
            )
        if self.engram_embedding_parallel_method == "allreduce" and self.engram_embedding_parallel_size != 1:
            raise ConfigError(
                "engram_embedding_parallel_size only applies to engram_embedding_parallel_method="
                "'alltoall'; 'allreduce' shards the tables over the tensor-parallel group: set "
                "engram_embedding_parallel_size=1 or use 'alltoall'."
            )
        if not self.engram_tokenizer_name_or_path:
            raise ConfigError(
                "engram_tokenizer_name_or_path is required when use_engram=True: give a local "
                "tokenizer.json or the folder holding it."
            )
        if self.engram_reset_at_eos and self.engram_eos_id is None:
            raise ConfigError(
                "engram_reset_at_eos=True needs engram_eos_id: set it to the tokenizer's raw "
                "EOS id."
            )
        if self.engram_eos_id is not None and self.engram_eos_id < 0:
            raise ConfigError(f"engram_eos_id={self.engram_eos_id} must be a raw token id >= 0.")
        if not self.engram_lr_multiplier > 0:
            raise ConfigError(
                f"engram_lr_multiplier={self.engram_lr_multiplier} must be > 0 (paper: 5.0)."
            )
        if self.engram_weight_decay < 0:
            raise ConfigError(f"engram_weight_decay={self.engram_weight_decay} must be >= 0.")
        if not self.engram_init_std > 0:
            raise ConfigError(f"engram_init_std={self.engram_init_std} must be > 0.")
        self._check_table_precision()
        self._check_variant()

    def _check_variant(self) -> None:
        """The fields one variant cannot honour, each refused in one line naming the fix."""
        eps = self.engram_gate_eps
        if self.engram_variant != "deepseek_v41":
            if eps is not None:
                raise ConfigError(
                    f"engram_gate_eps={eps} applies to engram_variant=deepseek_v41 (the paper "
                    "gate's norms use float32's machine epsilon): drop it or set the variant.")
            return
        if eps is not None and not (math.isfinite(eps) and eps > 0):
            raise ConfigError(f"engram_gate_eps={eps} must be finite and > 0 (V4.1: 1e-20).")
        if len(set(self.engram_vocab_size)) != 1:
            raise ConfigError(
                f"engram_vocab_size={self.engram_vocab_size} differs between n-gram orders; "
                "engram_variant=deepseek_v41 has one table size for every order: give "
                f"{self.max_ngram_size - 1} equal values.")
        if self.engram_kernel_size != _default_of("engram_kernel_size"):
            raise ConfigError(
                f"engram_kernel_size={self.engram_kernel_size} has no meaning under "
                "engram_variant=deepseek_v41 (V4.1's branch has no short conv): drop it or "
                f"leave the default {_default_of('engram_kernel_size')}.")
        if self.engram_value_init != "normal":
            raise ConfigError(
                f"engram_value_init={self.engram_value_init!r} is not supported with "
                "engram_variant=deepseek_v41 (its value is a slice of the fused wkv): set "
                "engram_value_init=normal.")
        if self.engram_one_row_per_head:
            raise ConfigError(
                "engram_one_row_per_head=true is not supported with engram_variant=deepseek_v41 "
                "(V4.1's table rows are the sums of its primes): set it to false.")

    def _check_table_precision(self) -> None:
        """Master weights and the moment dtype only apply where they change something."""
        rowwise = self.engram_optimizer == "rowwise_adam"
        if self.engram_table_dtype == "fp8_e4m3":
            self._check_fp8_tables()
            return
        if not self.engram_master_weights:
            if self.engram_table_dtype != "bf16":
                raise ConfigError(
                    "engram_master_weights=false applies to bf16 tables and fp8_e4m3 ones (an "
                    "fp32 table is its own master): set engram_table_dtype=bf16 or "
                    "engram_master_weights=true."
                )
            if not rowwise:
                raise ConfigError(
                    f"engram_master_weights=false needs engram_optimizer=rowwise_adam (got "
                    f"{self.engram_optimizer!r}): it is the optimizer that rounds stochastically."
                )
            if self.engram_offload_embedding_optimizer_states:
                raise ConfigError(
                    "engram_master_weights=false with engram_offload_embedding_optimizer_states: "
                    "there is no master to offload; use engram_table_placement=host to keep the "
                    "tables and their state in host memory."
                )
        if self.engram_optimizer_state_dtype != "fp32" and not rowwise:
            raise ConfigError(
                f"engram_optimizer_state_dtype={self.engram_optimizer_state_dtype!r} needs "
                f"engram_optimizer=rowwise_adam (got {self.engram_optimizer!r})."
            )

    def _check_fp8_tables(self) -> None:
        """fp8_e4m3 tables: frozen (no optimizer state at all), or rowwise_adam re-quantizing
        the rows it updates, without a float32 master."""
        if self.engram_offload_embedding_optimizer_states:
            raise ConfigError(
                "engram_table_dtype=fp8_e4m3 with engram_offload_embedding_optimizer_states: fp8 "
                "tables keep no master to offload; use engram_table_placement=host instead.")
        if self.engram_freeze_tables:
            return
        if self.engram_optimizer != "rowwise_adam" or self.engram_master_weights:
            raise ConfigError(
                f"engram_table_dtype=fp8_e4m3 trains with engram_optimizer=rowwise_adam and "
                f"engram_master_weights=false only (got {self.engram_optimizer!r}, "
                f"master {str(self.engram_master_weights).lower()}): set both, or "
                "engram_freeze_tables=true for fixed tables, or engram_table_dtype=bf16.")


def uses_engram(config: Any) -> bool:
    """Engram on: a config composed with `EngramConfig` that enables it (megatron's own config,
    which the builder also accepts, never is)."""
    return isinstance(config, EngramConfig) and config.use_engram


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _default_of(name: str) -> Any:
    """EngramConfig's default of field ``name``."""
    return next(_default(f) for f in dataclasses.fields(EngramConfig) if f.name == name)


def resolve(model: Mapping[str, Any]) -> dict[str, Any]:
    """A model section (a preset, a saved run config's ``model``, an export's config) with
    every Engram and mHC field present: its value, else the schema's default, and
    ``engram_hc_mult`` derived from the backbone (`residual_streams`) when unset. The one
    derivation the trainer, export, transformers interop and sweep share; the composed
    megatron configs apply the same rule in `check_hyper_connections`."""
    check_family_fields(model)
    fields = dataclasses.fields(EngramConfig) + dataclasses.fields(HyperConnectionConfig)
    out = {f.name: _default(f) for f in fields}
    out.update(model.items())
    if out["engram_hc_mult"] is None:
        out["engram_hc_mult"] = residual_streams(out["enable_hyper_connections"],
                                                 out["num_residual_streams"])
    return out

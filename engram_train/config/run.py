"""The run config's typed sections (``experiment``, ``system``, ``train``, ``checkpoint``,
``data``): each field's default and one-line doc live here, once.

Registered with Hydra's ConfigStore as ``engram_run`` (`register`), the base of
``conf/train.yaml``'s defaults list, so that the YAML only overrides them and Hydra refuses a
wrong type (``train.lr=abc``) or an unknown key while composing, naming the field. The ``model``
section stays a mapping: its fields are megatron's and `EngramConfig`'s, validated where the
model config is built. `typed_run_config` puts a run config saved by an older version (or
built by hand) on the same schema, so that a key it lacks reads as its default.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from engram_train.errors import ConfigError

SCHEMA_NAME = "engram_run"
MEMORY_CHECKS = ("refuse", "warn", "off")
"""`system.memory_check`'s values"""


@dataclass
class ExperimentConfig:
    """Where a run writes."""

    exp_name: str = "demo"
    """run name"""

    exp_dir: str = "outputs/${experiment.exp_name}"
    """where metrics, TensorBoard, plots, checkpoints by default and the resolved config go"""


@dataclass
class SystemConfig:
    """The parallel layout and numerics."""

    tensor_model_parallel_size: int = 1
    """TP"""

    pipeline_model_parallel_size: int = 1
    """PP; must divide `model.num_layers`"""

    virtual_pipeline_model_parallel_size: Optional[int] = None
    """interleaved schedule chunks per stage"""

    expert_model_parallel_size: int = 1
    """EP; must divide DP x CP and `num_moe_experts`"""

    context_parallel_size: int = 1
    """CP: TE's attention on GPUs, an all-gather CP attention without TE; Engram exact across chunks"""

    sequence_parallel: Any = "auto"
    """`auto` = on when TP > 1 (MoE with TP requires it), or true / false"""

    use_distributed_optimizer: bool = True
    """megatron's ZeRO-1 distributed optimizer"""

    precision: str = "fp32"
    """`fp32` or `bf16` (CPU and GPU); `fp16` only without Engram"""

    recompute_granularity: Optional[str] = None
    """`null`, `selective`, `full`"""

    recompute_modules: Optional[List[str]] = None
    """with `selective`: megatron's modules (`core_attn`, `mlp`, `moe`, ...); `mhc` recomputes the mHC mappings (null: megatron's default, plus `mhc` with mHC unless `full`; docs/mhc.md)"""

    recompute_method: str = "uniform"
    """with `full`: `uniform` or `block`"""

    recompute_num_layers: int = 1
    """with `full`: layers per recomputed chunk"""

    overlap_grad_reduce: bool = False
    """megatron DDP overlap"""

    distributed_timeout_minutes: int = 10
    """process-group timeout"""

    memory_check: str = "refuse"
    """at start-up, before the model is built: the memory plan of this run against this machine's memory (docs/memory.md); `refuse` a run it says does not fit, `warn` and start anyway, or `off`; `tight` warns"""


@dataclass
class TrainConfig:
    """Steps, batch, optimizer, schedule, and when a run stops on its own."""

    train_iters: int = 200
    """optimizer steps"""

    micro_batch_size: int = 2
    """samples per forward/backward per rank"""

    global_batch_size: int = 8
    """samples per step over all DP ranks (divisible by micro x DP)"""

    seq_length: int = 128
    """tokens per sample"""

    lr: float = 3.0e-3
    """peak LR"""

    min_lr: float = 3.0e-4
    """final LR"""

    lr_warmup_iters: int = 20
    """linear warmup"""

    lr_decay_iters: Optional[int] = None
    """null = `train_iters`"""

    lr_decay_style: str = "cosine"
    """megatron's `OptimizerParamScheduler` styles: constant, linear, cosine, inverse-square-root, WSD"""

    weight_decay: float = 0.1
    """AdamW weight decay (biases and norms excluded, megatron's rule)"""

    adam_beta1: float = 0.9
    """Adam beta1"""

    adam_beta2: float = 0.95
    """Adam beta2"""

    adam_eps: float = 1.0e-8
    """Adam epsilon"""

    clip_grad: float = 1.0
    """global grad-norm clip"""

    seed: int = 1234
    """seeds data order and init"""

    log_interval: Optional[int] = 10
    """iterations between log lines / metrics records (the last iteration is always logged)"""

    eval_interval: Optional[int] = 50
    """iterations between validations (and at the end); null = never"""

    eval_iters: int = 4
    """validation global batches per evaluation"""

    nonfinite_skip_budget: int = 0
    """steps with a NaN/inf loss or grad norm whose update is skipped before the run stops (without saving)"""

    divergence_guard: bool = True
    """stop on a loss spike, a collapsed model or NaN/inf before the next save, setting aside the checkpoints the abnormal loss judged ([docs/reliability.md](docs/reliability.md#divergence-guard))"""

    divergence_spike_factor: float = 10.0
    """spike: a loss above this x the largest of the last `divergence_window` losses (Megatron-LM's factor)"""

    divergence_window: int = 100
    """recent losses the spike rule compares with"""

    divergence_collapse_steps: int = 2
    """collapse: consecutive steps with grad norm exactly 0 while the loss is ln(vocab)"""

    exit_signal_handler: bool = True
    """SIGTERM: save a checkpoint at the end of the iteration, then exit"""

    exit_duration_in_mins: Optional[float] = None
    """wall-clock limit: save a checkpoint and exit once passed; null = none"""


@dataclass
class CheckpointConfig:
    """Saving, resuming and what a resume may change."""

    save: Optional[str] = None
    """directory for checkpoints (null: none); checked for write access and free space before training"""

    load: Optional[str] = None
    """resume from the tracker's iteration here (without a tracker: the newest complete `iter_*`)"""

    save_interval: Optional[int] = None
    """iterations between saves; the last iteration is always saved when `save` is set"""

    verify: bool = True
    """check every file's SHA-256 against the checkpoint's manifest before loading"""

    load_fallback: bool = False
    """the checkpoint to resume from is damaged: load the newest intact older one instead of failing"""

    overwrite: bool = False
    """a run starting from scratch may delete the checkpoints already in `save` (else it refuses)"""

    check_free_space: bool = True
    """refuse to start a save the disk cannot hold"""

    load_engram: bool = True
    """false: load everything but Engram, which starts afresh (add Engram to a checkpoint without it, remove it, or change its hash identity)"""

    override_opt_param_scheduler: bool = False
    """on resume, follow this config's LR schedule (Megatron-LM's flag)"""

    use_checkpoint_opt_param_scheduler: bool = False
    """on resume, keep the checkpoint's LR schedule (Megatron-LM's flag); with neither, a changed schedule is an error"""


@dataclass
class DataConfig:
    """The corpus, its tokenizer and how batches are prepared."""

    path: Any = "${oc.env:ENGRAM_DATA_PATH,examples/data/demo_text_document}"
    """indexed-dataset prefix, or a blend `[w1, p1, w2, p2, ...]` (default: `$ENGRAM_DATA_PATH`, else the demo corpus)"""

    split: str = "90,10,0"
    """train/valid/test shares"""

    tokenizer: str = "examples/data/tokenizer"
    """local `tokenizer.json` or its folder"""

    cache_dir: Optional[str] = None
    """megatron's dataset index cache (null: `<exp_dir>/data_cache`)"""

    hash_prefetch: bool = True
    """hash the next step's micro-batches on a CPU thread while this step computes ([docs/sparse-tables.md](docs/sparse-tables.md))"""

    hash_threads: int = 1
    """threads that hash a micro-batch's Engram layers concurrently (many Engram layers, long sequences)"""

    reset_position_ids: bool = False
    """megatron GPT dataset option"""

    reset_attention_mask: bool = False
    """refused when true: the attention (local and Transformer Engine) has no per-document mask; `model.engram_reset_at_eos` keeps Engram within documents"""

    eod_mask_loss: bool = False
    """megatron GPT dataset option"""


@dataclass
class RunConfig:
    """The whole run config: the five typed sections and the model preset's fields."""

    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)
    system: SystemConfig = field(default_factory=SystemConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: Dict[str, Any] = field(default_factory=dict)


SECTIONS = {
    "experiment": ExperimentConfig,
    "system": SystemConfig,
    "train": TrainConfig,
    "checkpoint": CheckpointConfig,
    "data": DataConfig,
}


def register() -> None:
    """Put `RunConfig` into Hydra's ConfigStore (``conf/train.yaml`` names it first in its
    defaults list). Called where Hydra composes ``conf/train.yaml`` (the trainer's `main`,
    ``training/param_count.compose_config``, the transformers importer, tests), before it
    composes; registering twice is harmless. Importing the package registers nothing."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NAME, node=RunConfig)


def typed_run_config(cfg):
    """``cfg`` (a DictConfig or a plain mapping, e.g. a run config saved by an older version)
    merged onto the schema: every section key present with its type. A key the schema does not
    know (also one added with ``+train.foo=...``, which Hydra lets through: `check_known_keys`)
    or a value of the wrong type raises `ConfigError` naming the key and the expected type."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    check_known_keys(cfg)
    try:
        typed = OmegaConf.merge(OmegaConf.structured(RunConfig), cfg)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        raise ConfigError(f"{key}: {str(e).splitlines()[0]} (README 'Configuration reference' "
                          "lists every key with its type)") from None
    OmegaConf.set_struct(typed, True)
    return typed


def check_known_keys(cfg) -> None:
    """Refuse a key that no typed section defines, naming it and the closest known key.

    Hydra refuses ``train.lrr=1e-3`` while composing, but it adds ``+train.lrr=1e-3`` (and
    ``++``) to a structured section without a word; nothing would read the key. Called on the
    composed config before anything else (`typed_run_config`, the trainer's first step;
    ``validate_run_config`` for the planning tools), so that such a run stops at once."""
    import dataclasses

    known_sections = [f.name for f in dataclasses.fields(RunConfig)]
    for section in cfg.keys() if hasattr(cfg, "keys") else ():
        if section not in known_sections:
            _refuse_unknown(str(section), "RunConfig", "", known_sections)
        schema = SECTIONS.get(section)
        node = cfg[section] if schema is not None else None
        if not hasattr(node, "keys"):
            continue  # `model` is free-form; a non-mapping section is a type error for merge
        fields = [f.name for f in dataclasses.fields(schema)]
        for key in node.keys():
            if key not in fields:
                _refuse_unknown(str(key), schema.__name__, f"{section}.", fields)


def _refuse_unknown(key: str, schema: str, prefix: str, known: list[str]) -> None:
    import difflib

    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f"did you mean {prefix}{close[0]}? " if close else ""
    where = ("a '+' does not add keys to a typed section" if prefix else
             "the run config's sections are " + ", ".join(known))
    raise ConfigError(
        f"{prefix}{key}: Key '{key}' not in '{schema}': no part of the run reads it ({where}); "
        f"{hint}fix or drop the override (README 'Configuration reference' lists every key)"
    )

"""The run config's rules, and from the Hydra YAML to megatron objects, before any process
group exists.

The one home of the rules on the run config's values: ``validate_run_config`` checks each of
them (a key's range, the keys that must agree, the layout against the world size, torchrun's
``WORLD_SIZE``) and raises ``ConfigError`` naming the key and the fix. The keys themselves
(type, default, doc) are ``engram_train/config/run.py``'s; the model section's rules are the
model config's (``engram_train/config``), run by ``build_transformer_config``, which turns the
``model`` + ``system`` sections into one ``EngramMLATransformerConfig``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from engram_train.config import check_known_keys, resolve
from engram_train.config.run import MEMORY_CHECKS
from engram_train.errors import ConfigError, EngramError  # noqa: F401  (ConfigError: re-exported)
from engram_train.models.families import family_of_section
from engram_train.runtime.distributed import ParallelSizes
from engram_train.training.run_keys import check_data_keys, check_schedule

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
RECOMPUTE = (None, "selective", "full")


def backbone_model(cfg) -> dict[str, Any]:
    """The model section as its megatron config will see it: megatron's field defaults, the
    family's (its ``backbone_fields``: DeepSeek-V3's defaults; V4.1's names as megatron's), the
    preset's values, the Engram and mHC fields resolved (`engram_train.config.resolve`). For
    the checks that run before the config is built."""
    from omegaconf import OmegaConf

    model = OmegaConf.to_container(cfg.model, resolve=True)
    return resolve(family_of_section(cfg.model).backbone_fields(model))


def parallel_sizes(cfg) -> ParallelSizes:
    s, m = cfg.system, resolve(cfg.model)
    alltoall = m["use_engram"] and m["engram_embedding_parallel_method"] == "alltoall"
    return ParallelSizes(
        tensor=int(s.tensor_model_parallel_size),
        pipeline=int(s.pipeline_model_parallel_size),
        virtual_pipeline=s.virtual_pipeline_model_parallel_size,
        expert=int(s.expert_model_parallel_size),
        context=int(s.context_parallel_size),
        engram_embedding=int(m["engram_embedding_parallel_size"]) if alltoall else 1,
    )


def sequence_parallel(cfg) -> bool:
    value = cfg.system.sequence_parallel
    if value in ("auto", None):
        return int(cfg.system.tensor_model_parallel_size) > 1
    return bool(value)


def data_parallel_size(cfg, world_size: int) -> int:
    p = parallel_sizes(cfg)
    return world_size // (p.tensor * p.pipeline * p.context)


def validate_run_config(cfg, world_size: int, check_data: bool = True):
    """Every rule on the run config's values, checked before torch.distributed starts; returns
    the model's ``EngramMLATransformerConfig``. The run's rules (one check per concern below:
    batch and schedule, data, layout, numerics, memory, reliability) live here, in this module
    only; the model's (megatron's and Engram's) run by building its config. The keys themselves
    (type, default, doc) are `engram_train.config.run`'s; rules that need the disk or a
    checkpoint (writable folders, overwrite, resume agreement) are ``training/plan.py``'s.
    ``check_data=False`` skips the checks that read ``data.path`` and ``data.tokenizer`` (a
    layout checked on a machine that does not hold the data)."""
    check_known_keys(cfg)  # `+train.foo=...` passes Hydra's composition
    p = parallel_sizes(cfg)
    p.validate(world_size)
    dp = data_parallel_size(cfg, world_size)
    _check_batch(cfg, dp, world_size)
    check_schedule(cfg.train)
    check_data_keys(cfg.data, family_of_section(cfg.model))
    _check_model_family_layout(cfg, p)
    _check_pipeline(cfg, p, dp)
    _check_precision(cfg)
    if cfg.system.recompute_granularity not in RECOMPUTE:
        raise ConfigError(
            f"system.recompute_granularity={cfg.system.recompute_granularity!r} must be null, selective or full"
        )
    _check_tensor_and_expert_parallel(cfg, p)
    # The model's own rules (megatron's and Engram's) run once, where the config is built.
    model_config = build_transformer_config(cfg)
    if check_data:
        _check_data(cfg)
        _check_host_memory(cfg, model_config, world_size)
    _check_reliability(cfg)
    _check_divergence_guard(cfg.train)
    return model_config


def _check_batch(cfg, dp: int, world_size: int) -> None:
    """Batch sizes, steps, sequence length and the logging/evaluation intervals."""
    t = cfg.train
    if t.micro_batch_size < 1 or t.global_batch_size < 1:
        raise ConfigError("train.micro_batch_size and train.global_batch_size must be >= 1")
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} must be divisible by "
            f"train.micro_batch_size={t.micro_batch_size} x data-parallel size {dp} "
            f"(= world {world_size} / (tensor x pipeline x context)); change either"
        )
    if t.train_iters < 1:
        raise ConfigError(f"train.train_iters={t.train_iters} must be >= 1")
    if t.seq_length < 1:
        raise ConfigError(f"train.seq_length={t.seq_length} must be >= 1 (tokens per sample)")
    cp = int(cfg.system.context_parallel_size or 1)
    if cp > 1 and t.seq_length % (2 * cp):
        raise ConfigError(
            f"train.seq_length={t.seq_length} must be a multiple of 2 x system.context_parallel_size "
            f"= {2 * cp} (each rank holds two chunks of the sequence, for load balance)"
        )
    for key in ("log_interval", "eval_interval"):
        if t[key] is not None and t[key] < 1:
            raise ConfigError(f"train.{key}={t[key]} must be >= 1 (or null to disable)")


def _check_pipeline(cfg, p: ParallelSizes, dp: int) -> None:
    """Layers over pipeline (and virtual pipeline) stages, micro-batches over the stages."""
    t, num_layers = cfg.train, backbone_model(cfg)["num_layers"]
    if num_layers % p.pipeline:
        raise ConfigError(
            f"model.num_layers={num_layers} must be divisible by "
            f"system.pipeline_model_parallel_size={p.pipeline}"
        )
    if p.virtual_pipeline is None:
        return
    if p.pipeline < 2:
        raise ConfigError("system.virtual_pipeline_model_parallel_size needs pipeline_model_parallel_size > 1")
    if num_layers % (p.pipeline * p.virtual_pipeline):
        raise ConfigError(
            f"model.num_layers={num_layers} must be divisible by pipeline x virtual pipeline "
            f"size = {p.pipeline * p.virtual_pipeline}"
        )
    if (t.global_batch_size // (t.micro_batch_size * dp)) % p.pipeline:
        raise ConfigError(
            "with a virtual pipeline the number of micro-batches per step "
            f"({t.global_batch_size // (t.micro_batch_size * dp)}) must be a multiple of "
            f"pipeline_model_parallel_size={p.pipeline}: raise train.global_batch_size"
        )


def _check_model_family_layout(cfg, p: ParallelSizes) -> None:
    """The model family's own rules on the layout (its ``check_run``: DeepSeek-V4.1's layouts,
    DeepSeek-V3's Transformer Engine MLA under tensor parallelism)."""
    family = family_of_section(cfg.model)
    if family.check_run is not None:
        family.check_run(cfg, p, sequence_parallel(cfg))


def _check_tensor_and_expert_parallel(cfg, p: ParallelSizes) -> None:
    """Sequence parallelism where TP needs it (MoE, Transformer Engine's MLA); experts over EP."""
    backbone = backbone_model(cfg)
    if backbone["num_moe_experts"] and p.tensor > 1 and not sequence_parallel(cfg):
        raise ConfigError(
            "MoE with tensor_model_parallel_size > 1 needs sequence parallelism: set "
            "system.sequence_parallel: true (or auto)"
        )
    if backbone["num_moe_experts"] and backbone["num_moe_experts"] % p.expert:
        raise ConfigError(
            f"model.num_moe_experts={backbone['num_moe_experts']} must be divisible by "
            f"system.expert_model_parallel_size={p.expert}"
        )
    experts, topk = backbone["num_moe_experts"], backbone.get("moe_router_topk")
    if experts and topk is not None and not 1 <= topk <= experts:
        raise ConfigError(
            f"model.moe_router_topk={topk} must be between 1 and model.num_moe_experts={experts} "
            "(each token is routed to topk distinct experts)"
        )
    per_rank = cfg.train.seq_length // p.context
    if p.tensor > 1 and sequence_parallel(cfg) and per_rank % p.tensor:
        raise ConfigError(
            f"train.seq_length={cfg.train.seq_length} must be a multiple of "
            f"system.tensor_model_parallel_size={p.tensor}"
            + (f" x system.context_parallel_size={p.context}" if p.context > 1 else "")
            + ": sequence parallelism splits each rank's sequence over the tensor-parallel ranks"
        )


def engram_table_params_per_rank(cfg) -> int:
    """Table parameters of the rank holding the most (its pipeline stage's Engram layers, one
    shard of each): every head's table has about ``engram_vocab_size[order]`` rows (the next
    prime above it) of ``n_embed_per_ngram / n_head_per_ngram``."""
    m, p = resolve(cfg.model), parallel_sizes(cfg)
    per_layer = sum(int(v) for v in m["engram_vocab_size"]) * int(m["n_embed_per_ngram"])
    layers_per_stage = backbone_model(cfg)["num_layers"] // p.pipeline
    stages = [int(i) // layers_per_stage for i in m["engram_layer_ids"]]
    layers = max(stages.count(s) for s in set(stages))
    if m["engram_embedding_parallel_method"] == "allreduce":
        shards = p.tensor
    else:
        shards = int(m["engram_embedding_parallel_size"])
    return -(-layers * per_layer // shards)


def _optimizer_state_options(model_config) -> dict:
    return dict(
        optimizer=model_config.engram_optimizer,
        state_dtype_bytes=2 if model_config.engram_optimizer_state_dtype == "bf16" else 4,
        row_width=model_config.n_embed_per_ngram // model_config.n_head_per_ngram,
    )


def engram_table_bytes_per_param(model_config) -> float:
    """Bytes per Engram table parameter where the table lives (with host placement, host
    memory): value, float32 master (bf16 tables with ``engram_master_weights``) and the
    optimizer moments (``engram/host_table.table_bytes_per_param``)."""
    from engram_train.engram.host_table import table_bytes_per_param

    from engram_train.engram.fp8_table import scale_blocks

    dtype = model_config.engram_table_dtype
    options = _optimizer_state_options(model_config)
    if dtype == "fp8_e4m3":  # 1 byte and the E8M0 scales; frozen: no optimizer state
        width = options["row_width"]  # trained: a bf16 row second moment (training/rowwise_adam)
        return table_bytes_per_param(1 + scale_blocks(width) / width, master=False,
                                     frozen=bool(model_config.engram_freeze_tables),
                                     row_moment_bytes=2, **options)
    bf16 = dtype == "bf16"
    return table_bytes_per_param(2 if bf16 else 4,
                                 master=bf16 and model_config.engram_master_weights, **options)


def _check_host_memory(cfg, model_config, world_size: int) -> None:
    """Host-resident tables (or offloaded table optimizer states) must fit in the host RAM
    available to the ranks of one node; refused at start, naming the fields, otherwise."""
    from engram_train.engram.host_table import available_host_bytes, host_table_bytes

    if not model_config.use_engram:
        return
    host = model_config.engram_table_placement == "host"
    offload = model_config.engram_offload_embedding_optimizer_states
    if not (host or offload):
        return
    available = available_host_bytes()
    if available is None:
        return
    params = engram_table_params_per_rank(cfg)
    per_param = engram_table_bytes_per_param(model_config)
    if host:  # the table, its moments and (bf16 tables with masters) a float32 master
        per_rank = int(params * per_param)
    else:  # offload: a float32 master (also for fp32 tables) and the moments
        per_rank = host_table_bytes(params, 4, mixed_precision=False,
                                    **_optimizer_state_options(model_config))
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    need = per_rank * ranks
    if need > available:
        what = ("model.engram_table_placement=host (tables + Adam state)" if host else
                "model.engram_offload_embedding_optimizer_states=true (masters + Adam state)")
        gib = 1 << 30
        raise ConfigError(
            f"{what} needs {need / gib:.1f} GiB of host memory on this node ({ranks} ranks x "
            f"{per_rank / gib:.2f} GiB for {params:,} table parameters each, "
            f"{per_param:.2f} bytes per parameter) but "
            f"{available / gib:.1f} GiB are available: raise "
            "model.engram_embedding_parallel_size (more shards), use fewer ranks per node, "
            "lower model.engram_vocab_size, or set model.engram_table_placement=device"
        )


def _check_precision(cfg) -> None:
    """bf16 runs on CPU and GPU (megatron's Float16Module, float32 main parameters); fp16 is
    refused with Engram where the model config is built (engram_train.config)."""
    precision = cfg.system.precision
    if precision not in PRECISIONS:
        raise ConfigError(f"system.precision={precision!r} must be one of {sorted(PRECISIONS)}")


def _check_reliability(cfg) -> None:
    """The checkpoint/fault keys and the memory check (README, docs/reliability.md)."""
    t, c = cfg.train, cfg.checkpoint
    budget = t.nonfinite_skip_budget
    if budget < 0:
        raise ConfigError(f"train.nonfinite_skip_budget={budget!r} must be an int >= 0 (0: stop at the first)")
    limit = t.exit_duration_in_mins
    if limit is not None and limit <= 0:
        raise ConfigError(f"train.exit_duration_in_mins={limit!r} must be a number of minutes > 0, or null")
    if c.override_opt_param_scheduler and c.use_checkpoint_opt_param_scheduler:
        raise ConfigError(
            "checkpoint.override_opt_param_scheduler and checkpoint.use_checkpoint_opt_param_scheduler "
            "are both true: choose this run's LR schedule (override) or the checkpoint's (use_checkpoint)"
        )
    if c.save_interval is not None and c.save_interval < 1:
        raise ConfigError(f"checkpoint.save_interval={c.save_interval} must be >= 1 (or null: only at the end)")
    if cfg.system.memory_check not in MEMORY_CHECKS:
        raise ConfigError(f"system.memory_check={cfg.system.memory_check!r} must be one of {', '.join(MEMORY_CHECKS)}")


def _check_divergence_guard(t) -> None:
    """``train.divergence_*`` (docs/reliability.md, divergence guard), also with the guard off:
    a value no run could use is a mistake before it is switched on."""
    factor, window, steps = t.divergence_spike_factor, t.divergence_window, t.divergence_collapse_steps
    if not factor > 1:
        raise ConfigError(f"train.divergence_spike_factor={factor!r} must be a number > 1 (Megatron-LM uses 10)")
    if window < 1:
        raise ConfigError(f"train.divergence_window={window!r} must be an int >= 1 (iterations)")
    if steps < 1:
        raise ConfigError(f"train.divergence_collapse_steps={steps!r} must be an int >= 1")


def _check_data(cfg) -> None:
    from omegaconf import OmegaConf

    from engram_train.data.datasets import parse_blend
    from engram_train.engram.compressed_tokenizer import resolve_tokenizer_file

    d = cfg.data
    resolve_tokenizer_file(str(d.tokenizer), field="data.tokenizer")
    path = OmegaConf.to_container(d.path) if OmegaConf.is_config(d.path) else d.path
    prefixes, _ = parse_blend(path)
    for prefix in prefixes:
        for ext in (".bin", ".idx"):
            if not Path(prefix + ext).exists():
                raise ConfigError(
                    f"data.path: {prefix}{ext} does not exist; build it with engram-preprocess "
                    "or point data.path at an indexed dataset prefix"
                )


def padded_vocab_size(vocab_size: int, tensor_parallel: int, divisible_by: int = 128) -> int:
    """Megatron-LM's padding: a multiple of ``divisible_by * tensor_parallel``."""
    multiple = divisible_by * tensor_parallel
    return ((vocab_size + multiple - 1) // multiple) * multiple


def build_transformer_config(cfg):
    """``EngramMLATransformerConfig`` for the model and system sections of the YAML."""
    from omegaconf import OmegaConf

    model = OmegaConf.to_container(cfg.model, resolve=True)
    family = family_of_section(cfg.model)
    if family.check_model_keys is not None:  # else its config refuses the others
        family.check_model_keys(model)
    p = parallel_sizes(cfg)
    s = cfg.system
    dtype = PRECISIONS[s.precision]
    fields = {}
    fields.update(p.megatron_kwargs())
    fields.update(
        sequence_parallel=sequence_parallel(cfg),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=s.precision == "bf16",
        fp16=s.precision == "fp16",
        recompute_granularity=s.recompute_granularity,
    )
    modules = s.recompute_modules
    if modules is not None:  # megatron's selective modules, plus "mhc" (the mHC mappings)
        fields.update(recompute_modules=list(modules))
    if s.recompute_granularity == "full":
        fields.update(recompute_method=s.recompute_method, recompute_num_layers=int(s.recompute_num_layers))
    try:
        return family.transformer_config(model, fields)
    except EngramError:
        raise  # the Engram and mHC rules raise ConfigError themselves
    except (ValueError, AssertionError, TypeError) as e:  # megatron's own checks
        raise ConfigError(f"model/system: {e}") from None

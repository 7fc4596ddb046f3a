"""The GPU check: what the CPU test suite cannot run, in one script (at most 9 minutes on one GPU).

    python benchmarks/gpu_check.py --out gpu_check.json                      # 1 GPU
    torchrun --nproc-per-node 2 benchmarks/gpu_check.py --out gpu_check.json # + NCCL, eps 2
    python benchmarks/gpu_check.py --dry-run                                 # the plan only

Sections (each runs independently; a failure is recorded and the next section runs):

- ``environment``: torch / CUDA / NCCL / Transformer Engine / megatron-core versions, device.
- ``te_spec``: the tiny Engram model (Engram on layers 1 and 3) built with the Transformer
  Engine spec and with the local spec, the same weights copied into both (TE fuses the MLA
  latent norms and the dense layer's pre-MLP norm into its linears: names are mapped), one
  forward and backward, fp32 and bf16: loss and every parameter's gradient must agree.
- ``nccl_embedding``: (2+ ranks) the Engram lookups over NCCL: alltoall with eps = world and
  allreduce with TP = world against a full table on every rank (outputs and reassembled table
  gradients), plus the median time of a lookup forward + backward of each method.
- ``bf16_training``: the trainer's pieces (megatron DDP + optimizer + table optimizer, Float16Module)
  on the tiny model, 20 steps on fixed batches in fp32, bf16 and bf16 with bf16 tables: every
  parameter's dtype, the residual stream's dtype, float32 main parameters and masters, losses
  within 3% of fp32.
- ``prefetch``: everything overlapped (hashing a step ahead on a CPU thread, pinned batches
  copied with ``non_blocking=True``, ``engram_prefetch``: every Engram lookup of a chunk issued
  at its start, rows exchanged by async NCCL all-to-all and waited where the layer runs) must
  give the losses of the serial path (inline hashing, pageable batches, no lookup prefetch), to
  1e-6 with deterministic algorithms: nothing reads rows, ids or batches before they are ready.
  Also timed (steps after the first): median step, lookup time on the critical path per step,
  and the hidden fraction (1 - the overlapped path's lookup time on the critical path, starting
  plus waiting, / the serial path's).
  ``benchmarks/bench_engram_overhead.py`` (no Engram vs Engram with and without prefetch on
  the trainer) runs unchanged on a GPU machine as well.
- ``offload``: the Engram optimizer-state offload in the trainer's model, for ``sparse_adam``
  and ``adam``, bf16 tables: float32 masters pinned in host memory, Adam moments on the host,
  tables on the GPU, GPU memory lower by at least the states moved out, and the same losses and
  tables (to one bf16 ulp) as without offload.
- ``context_parallel``: (2+ ranks, TE) the tiny Engram model in bf16 with context parallelism
  = world (TE's CP attention, Engram's conv halo over NCCL) against CP 1 (DP = world) from
  the same weights on the same global batches: losses of 3 steps within bf16 noise (2%).
- ``mhc``: the mHC backbone (``deepseek_v3_tiny_mhc``) in bf16: the mapping parameters
  float32, the mapping recompute on by default; the mapping and its write-back forward and
  backward under ``torch.cuda.set_sync_debug_mode("error")`` (no host synchronisation), with
  and without recompute; saved-for-backward bytes per token of one sublayer's mapping; 3
  training steps with recompute on, off and without mHC: losses (on = off within bf16
  noise) and peak device memory of each.
- ``v41_long``: DeepSeek-V4.1 at length: the sparse attention core against the dense oracle
  on the device (float32, forward and every gradient, 1e-5), context parallelism = world
  against one process on packed rows (2+ ranks: loss and every gradient), and one
  V4.1-Flash-shaped full layer (ratio 1, its indexer) forward + backward at 32768 in bf16:
  peak device memory and time.
- ``throughput``: tokens/s of the ``deepseek_v3_small`` backbone in bf16 with and without
  Engram (same backbone, batch and data), and peak GPU memory next to engram-plan's prediction
  for the same configuration (``memory_plan``: predicted / measured, recorded, not checked).

Writes JSON (``--out``, rank 0, after every section; every rank prints its own line); exits 1
if a section failed (``--strict``: also if one was skipped, e.g. Transformer Engine missing),
3 if ``--time-limit`` (540 s) passed first (the report then names the section that was
running), 2 on a machine without CUDA ("skipped: no CUDA device": nothing was checked; the
report says so). ``--allow-cpu`` runs the sections that can run without CUDA on the CPU (gloo), with
``--quick`` sizes: the test suite does that to keep this script working.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parents[1]
for extra in (REPO, REPO / "tests" / "dist", REPO / "tests"):
    if str(extra) not in sys.path:
        sys.path.append(str(extra))

SEQ_TINY = 128


class CheckFailed(AssertionError):
    """A check that did not hold; the message says what and by how much."""


def check(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


@dataclass
class Context:
    device: torch.device
    world: int
    rank: int
    quick: bool
    results: dict = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


@dataclass
class Section:
    name: str
    what: str
    needs_cuda: bool  # True: not even with --allow-cpu
    needs_te: bool = False
    min_world: int = 1
    budget_s: int = 60
    run: Callable[[Context], dict] | None = None


# -- shared pieces -----------------------------------------------------------------------------

def te_available() -> bool:
    from engram_train.runtime.megatron_fixes import transformer_engine_available

    return transformer_engine_available()


def init_layout(**sizes) -> None:
    from megatron.core import parallel_state

    from engram_train.runtime import ParallelSizes, initialize_distributed

    parallel_state.destroy_model_parallel()
    initialize_distributed(ParallelSizes(**sizes), seed=1234)


def trainer_config(ctx: Context, overrides: list[str]):
    """The trainer's megatron config for ``overrides`` on this world (data files not read)."""
    from engram_train.training.param_count import compose_config
    from engram_train.training.run_config import (
        build_transformer_config,
        parallel_sizes,
        validate_run_config,
    )

    cfg = compose_config(overrides)
    validate_run_config(cfg, ctx.world, check_data=False)
    config = build_transformer_config(cfg)
    p = parallel_sizes(cfg)
    init_layout(tensor=p.tensor, pipeline=p.pipeline, expert=p.expert, context=p.context,
                engram_embedding=p.engram_embedding)
    return cfg, config


def demo_vocab(cfg) -> int:
    from engram_train.data import load_tokenizer
    from engram_train.training.run_config import padded_vocab_size

    return padded_vocab_size(load_tokenizer(cfg.data.tokenizer).vocab_size,
                             int(cfg.system.tensor_model_parallel_size))


def synthetic_batches(count: int, micro: int, seq: int, vocab: int, seed: int) -> list[dict]:
    """Fixed micro-batches of random token ids (below the tokenizer's vocabulary)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, vocab, (micro, seq + 1), generator=g)
        out.append(dict(tokens=tokens[:, :-1].contiguous(), labels=tokens[:, 1:].contiguous(),
                        loss_mask=torch.ones(micro, seq),
                        position_ids=torch.arange(seq).expand(micro, seq).contiguous()))
    return out


def with_hash_ids(config, batches: list[dict]) -> list[dict]:
    """The data path's ``[L, B, S, K]`` hash id block added to every micro-batch."""
    if not config.use_engram:
        return batches
    from engram_train.engram.ngram_hash import NgramHashMapping

    mapping = NgramHashMapping(config)
    return [dict(b, engram_hash_ids=torch.as_tensor(mapping.hash_stacked(b["tokens"])))
            for b in batches]


def build_trainer_parts(cfg, config, lr: float = 3e-3):
    """Model chunks, chained optimizer and config hooks exactly as ``engram_train.train``."""
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig

    from engram_train.models.builder import build_model
    from engram_train.training.optimizer import build_optimizer

    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    model = build_model(config, demo_vocab(cfg), int(cfg.train.seq_length), ddp)
    opt_config = OptimizerConfig(optimizer="adam", lr=lr, min_lr=lr, weight_decay=0.0,
                                 clip_grad=1.0, bf16=config.bf16, params_dtype=config.params_dtype,
                                 use_distributed_optimizer=True)
    optimizer = build_optimizer(opt_config, model, config)
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model[0].no_sync
    return model, optimizer


def synchronize(ctx: Context) -> None:
    if ctx.cuda:
        torch.cuda.synchronize()


# -- sections ----------------------------------------------------------------------------------

def environment(ctx: Context) -> dict:
    import megatron.core

    out = dict(torch=torch.__version__, megatron_core=megatron.core.__version__,
               device=str(ctx.device), world=ctx.world, transformer_engine=None)
    if te_available():
        import transformer_engine

        out["transformer_engine"] = transformer_engine.__version__
    if ctx.cuda:
        out.update(cuda=torch.version.cuda, gpu=torch.cuda.get_device_name(),
                   nccl=".".join(map(str, nccl)) if isinstance(nccl := torch.cuda.nccl.version(),
                                                                tuple) else str(nccl),
                   bf16_supported=torch.cuda.is_bf16_supported(),
                   gpu_memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))
    return out


# TE fuses these local-spec norms into the following linear (megatron-core 0.16.1 names).
TE_TO_LOCAL = (
    (".self_attention.linear_q_up_proj.layer_norm_weight", ".self_attention.q_layernorm.weight"),
    (".self_attention.linear_kv_up_proj.layer_norm_weight", ".self_attention.kv_layernorm.weight"),
    (".mlp.linear_fc1.layer_norm_weight", ".pre_mlp_layernorm.weight"),
    (".self_attention.linear_qkv.layer_norm_weight", ".input_layernorm.weight"),
)


def local_name(te_name: str) -> str:
    for te_suffix, local_suffix in TE_TO_LOCAL:
        if te_name.endswith(te_suffix):
            return te_name[: -len(te_suffix)] + local_suffix
    return te_name


def te_spec(ctx: Context) -> dict:
    from engram_train.models.deepseek_v3.v3_specs import use_transformer_engine

    check(use_transformer_engine(), "Transformer Engine is installed but not selected on CUDA")
    return compare_specs(ctx, second_te=True)


def compare_specs(ctx: Context, second_te: bool = True) -> dict:
    """Local spec vs TE spec (``second_te=False``: local vs local, which must agree exactly:
    the CPU tests run this to keep the comparison itself honest)."""
    from megatron.core.utils import unwrap_model

    from engram_train.models.builder import build_gpt_model, wrap_mixed_precision
    from engram_train.training.step import model_inputs

    out = {}
    # fp32 may run TF32 GEMMs in TE; bf16 attention kernels differ (TE fused vs torch SDPA).
    # Wiring errors (a wrong weight, a norm or the Engram branch missing) give O(1) errors.
    for precision, loss_tol, grad_tol, param_tol in (("fp32", 1e-3, 5e-3, 5e-2),
                                                     ("bf16", 2e-2, 5e-2, 2e-1)):
        cfg, config = trainer_config(ctx, ["model=deepseek_v3_tiny", f"system.precision={precision}",
                                           f"train.seq_length={SEQ_TINY}"])
        vocab = demo_vocab(cfg)
        torch.manual_seed(7)
        local = build_gpt_model(config, vocab, SEQ_TINY, use_te=False).to(ctx.device)
        torch.manual_seed(7)
        te = build_gpt_model(config, vocab, SEQ_TINY, use_te=second_te).to(ctx.device)
        local_params = dict(local.named_parameters())
        te_params = dict(te.named_parameters())
        mapped = {local_name(n): n for n in te_params}
        check(sorted(mapped) == sorted(local_params),
              f"TE/local parameter names differ: only TE {sorted(set(mapped) - set(local_params))[:8]}"
              f", only local {sorted(set(local_params) - set(mapped))[:8]}")
        with torch.no_grad():
            for name, te_name in mapped.items():
                check(te_params[te_name].shape == local_params[name].shape,
                      f"{te_name}: shape {tuple(te_params[te_name].shape)} vs local "
                      f"{tuple(local_params[name].shape)}")
                te_params[te_name].copy_(local_params[name])
        local_chunk, te_chunk = (wrap_mixed_precision(config, [m])[0] for m in (local, te))
        batch = with_hash_ids(config, synthetic_batches(1, 2, SEQ_TINY, 4000, seed=3))[0]
        losses = {}
        for name, chunk in (("local", local_chunk), ("te", te_chunk)):
            per_token = chunk(**model_inputs(batch, ctx.device))
            loss = per_token.float().mean()
            loss.backward()
            losses[name] = loss.item()
        rel = abs(losses["te"] - losses["local"]) / abs(losses["local"])
        diffs, norms = {}, {}
        for name, te_name in mapped.items():
            g_local, g_te = local_params[name].grad, te_params[te_name].grad
            check(g_te is not None and g_local is not None, f"{name}: no gradient")
            diffs[name] = (g_te.float() - g_local.float()).norm().item()
            norms[name] = g_local.float().norm().item()
        global_rel = (sum(d * d for d in diffs.values()) / max(sum(n * n for n in norms.values()), 1e-30)) ** 0.5
        floor = 1e-3 * max(norms.values())  # parameters with (almost) no gradient: absolute
        per_param = {n: diffs[n] / max(norms[n], floor) for n in diffs}
        worst_name = max(per_param, key=per_param.get)
        te_modules = sorted({type(m).__name__ for m in unwrap_model(te).modules()
                             if type(m).__module__.startswith("megatron.core.extensions")})
        out[precision] = dict(
            loss_local=losses["local"], loss_te=losses["te"], loss_rel_diff=rel,
            grad_global_rel_err=global_rel, worst_grad_param=worst_name,
            worst_grad_rel_err=per_param[worst_name],
            engram_worst_grad_rel_err=max(v for n, v in per_param.items() if ".engram." in n),
            params=len(mapped), te_modules=te_modules)
        check(bool(te_modules) == second_te, f"Transformer Engine modules in the model: {te_modules}")
        check(rel <= loss_tol, f"{precision}: TE loss {losses['te']} vs local {losses['local']}")
        check(global_rel <= grad_tol, f"{precision}: gradients differ by {global_rel:.3g} (rel)")
        check(per_param[worst_name] <= param_tol,
              f"{precision}: gradient of {worst_name} differs by {per_param[worst_name]:.3g} (rel)")
    return out


def nccl_embedding(ctx: Context) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from engram_train.config import EngramConfig
    from engram_train.engram.engram_module import Engram
    from engram_train.parallel import groups
    from engram_train.parallel.lookup import engram_embedding_parallel

    hidden, seq, micro, layer = 64, 256 if not ctx.quick else 32, 4 if not ctx.quick else 2, 3
    vocab = [200_003, 200_003] if not ctx.quick else [5_003, 5_003]
    out = dict(backend=dist.get_backend())
    for method in ("alltoall", "allreduce"):
        if method == "alltoall":
            init_layout(engram_embedding=ctx.world)
        else:
            init_layout(tensor=ctx.world)
        config = EngramConfig(
            use_engram=True, engram_tokenizer_name_or_path="unused", engram_vocab_size=vocab,
            max_ngram_size=3, n_embed_per_ngram=64, n_head_per_ngram=4, engram_layer_ids=[1, layer],
            engram_embedding_parallel_method=method,
            engram_embedding_parallel_size=ctx.world if method == "alltoall" else 1)
        torch.manual_seed(0)
        sharded = Engram(config, hidden, layer, zero_init_conv=False, device=ctx.device,
                         embedding_parallel=engram_embedding_parallel(config))
        torch.manual_seed(0)
        full = Engram(config, hidden, layer, zero_init_conv=False, device=ctx.device)
        emb = sharded.multi_head_embedding
        g = torch.Generator().manual_seed(11)
        batches = []
        for _ in range(ctx.world):
            ids = torch.stack([torch.randint(0, n, (seq, micro), generator=g) for n in emb.head_sizes], -1)
            batches.append((ids.to(ctx.device), torch.randn(seq, micro, hidden, generator=g).to(ctx.device)))
        weight = torch.randn(seq, micro, hidden, generator=g).to(ctx.device)
        # alltoall: rank r looks up micro-batch r; allreduce (TP): every rank looks up batch 0
        mine = [ctx.rank] if method == "alltoall" else [0]
        reference = [full(batches[m][1], hash_ids=batches[m][0]) for m in range(len(batches))]
        sum((y * weight).sum() for y in (reference if method == "alltoall" else reference[:1])).backward()
        y = sharded(batches[mine[0]][1], hash_ids=batches[mine[0]][0])
        (y * weight).sum().backward()
        shard_group = (groups.get_engram_embedding_parallel_group() if method == "alltoall"
                       else parallel_state.get_tensor_model_parallel_group())
        grad = torch.zeros(emb.num_rows, emb.embedding_dim, dtype=torch.float64, device=ctx.device)
        grad[emb.row_start:emb.row_end] = emb.weight.grad.double()
        dist.all_reduce(grad, group=shard_group)
        ref_grad = full.multi_head_embedding.weight.grad.double()
        entry = dict(
            output_max_diff=(y - reference[mine[0]]).abs().max().item(),
            grad_max_diff=(grad - ref_grad).abs().max().item(),
            rows=[emb.row_start, emb.row_end],
        )
        times = []
        for _ in range(3 if ctx.quick else 12):
            synchronize(ctx)
            start = time.perf_counter()
            y = sharded(batches[mine[0]][1], hash_ids=batches[mine[0]][0])
            (y * weight).sum().backward()
            synchronize(ctx)
            times.append(time.perf_counter() - start)
        entry["fwd_bwd_ms_median"] = 1000 * statistics.median(times[1:])
        out[method] = entry
        check(entry["output_max_diff"] <= 1e-5, f"{method}: outputs differ by {entry['output_max_diff']}")
        check(entry["grad_max_diff"] <= 1e-5, f"{method}: table grads differ by {entry['grad_max_diff']}")
    return out


def bf16_training(ctx: Context) -> dict:
    from megatron.core.utils import unwrap_model

    from bf16_model import StreamRecorder, parameter_dtypes
    from engram_train.training.engram_optimizer import EngramTableOptimizer
    from engram_train.training.step import train_step

    steps = 4 if ctx.quick else 20
    runs = {}
    for name, precision, table in (("fp32", "fp32", "fp32"), ("bf16", "bf16", "fp32"),
                                   ("bf16_tables", "bf16", "bf16")):
        cfg, config = trainer_config(ctx, [
            "model=deepseek_v3_tiny", f"system.precision={precision}", f"model.engram_table_dtype={table}",
            f"model.engram_embedding_parallel_size={ctx.world}", f"train.seq_length={SEQ_TINY}"])
        torch.manual_seed(5)
        model, optimizer = build_trainer_parts(cfg, config)
        batches = with_hash_ids(config, synthetic_batches(2, 2, SEQ_TINY, 4000, seed=20 + ctx.rank))
        recorder = StreamRecorder(model)
        losses = [train_step(model, optimizer, batches, SEQ_TINY, 2).lm_loss]
        stream = recorder.result()
        losses += [train_step(model, optimizer, batches, SEQ_TINY, 2).lm_loss for _ in range(steps - 1)]
        tables = [o for o in optimizer.chained_optimizers if isinstance(o, EngramTableOptimizer)][0]
        dtypes = parameter_dtypes(model)
        table_names = {f"chunk{i}.{n}" for i, c in enumerate(unwrap_model(model))
                       for n, p in c.named_parameters() if getattr(p, "is_engram_table", False)}
        want_table = "torch.float32" if table == "fp32" else "torch.bfloat16"
        want_dense = "torch.float32" if precision == "fp32" else "torch.bfloat16"
        wrong = {n: d for n, d in dtypes.items()
                 if d != (want_table if n in table_names else want_dense)}
        check(not wrong, f"{name}: parameters of unexpected dtype {dict(list(wrong.items())[:5])}")
        check(stream["layer_out"] == [want_dense] and stream["engram_out"] == [want_dense],
              f"{name}: residual stream {stream}")
        mains = {str(p.dtype) for o in optimizer.chained_optimizers[:-1]
                 for g in o.optimizer.param_groups for p in g["params"]}
        check(mains == {"torch.float32"}, f"{name}: megatron main params {mains}")
        check({str(p.dtype) for p in tables.main_params} <= {"torch.float32"},
              f"{name}: table masters not float32")
        check(all(l == l and abs(l) < 1e4 for l in losses), f"{name}: non-finite losses {losses}")
        runs[name] = dict(losses=losses, stream=stream, tables=sorted(table_names))
    for name in ("bf16", "bf16_tables"):
        got, want = runs[name]["losses"][-1], runs["fp32"]["losses"][-1]
        runs[name]["final_rel_diff_vs_fp32"] = abs(got - want) / want
        check(abs(got - want) / want < 0.03, f"{name}: final loss {got} vs fp32 {want}")
    check(runs["fp32"]["losses"][-1] < runs["fp32"]["losses"][0], "fp32 did not learn")
    return runs


def prefetch(ctx: Context) -> dict:
    from engram_train.data import HashPrefetchIterator
    from engram_train.engram.ngram_hash import NgramHashMapping
    from engram_train.parallel.lookup import LOOKUP_TIMES
    from engram_train.training.step import train_step

    steps, micro_batches = (3, 2) if ctx.quick else (8, 4)
    out = {}
    # serial: inline hashing, pageable batches, each lookup issued where its layer runs;
    # overlapped: hashing a step ahead on a thread, pinned batches (truly async copies), every
    # lookup of a chunk issued at the chunk's start (engram_prefetch: async NCCL all-to-all)
    for mode, overlapped in (("serial", False), ("overlapped", True)):
        cfg, config = trainer_config(ctx, [
            "model=deepseek_v3_tiny", "system.precision=bf16" if ctx.cuda else "system.precision=fp32",
            f"model.engram_prefetch={overlapped}",
            f"model.engram_embedding_parallel_size={ctx.world}", f"train.seq_length={SEQ_TINY}"])
        torch.manual_seed(5)
        model, optimizer = build_trainer_parts(cfg, config)
        raw = synthetic_batches(steps * micro_batches, 2, SEQ_TINY, 4000, seed=40 + ctx.rank)
        if overlapped and ctx.cuda:
            raw = [{k: v.pin_memory() for k, v in b.items()} for b in raw]
        hash_fn = NgramHashMapping(config).hash_stacked
        losses, times = [], []
        deterministic = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True, warn_only=True)  # CUDA index_add etc.
        try:
            with HashPrefetchIterator(raw, hash_fn, prefetch=overlapped,
                                      depth=micro_batches) as it:
                for step in range(steps):
                    if step == 1:  # the first step (allocations, warm-up) is not timed
                        LOOKUP_TIMES.reset()
                    synchronize(ctx)
                    start = time.perf_counter()
                    mbs = [next(it) for _ in range(micro_batches)]
                    losses.append(train_step(model, optimizer, mbs, SEQ_TINY, 2).lm_loss)
                    synchronize(ctx)
                    times.append(time.perf_counter() - start)
            synchronize(ctx)
        finally:
            torch.use_deterministic_algorithms(deterministic)
        out[mode] = losses
        timed = max(len(times) - 1, 1)
        # the overhead comparison of benchmarks/bench_engram_overhead.py, on this device: step
        # time, lookup time on the critical path (issue + wait) and what the step waited for
        out[f"{mode}_timing"] = dict(
            median_step_ms=1000 * statistics.median(times[1:] or times),
            lookup_issue_ms_per_step=1000 * LOOKUP_TIMES.issue_s / timed,
            lookup_wait_ms_per_step=1000 * LOOKUP_TIMES.wait_s / timed)
    serial_t, overlapped_t = out["serial_timing"], out["overlapped_timing"]
    blocking = serial_t["lookup_issue_ms_per_step"] + serial_t["lookup_wait_ms_per_step"]
    if blocking > 0:  # starting a lookup (dedup, id routing) stays on the critical path
        out["hidden_fraction"] = 1 - (overlapped_t["lookup_issue_ms_per_step"]
                                      + overlapped_t["lookup_wait_ms_per_step"]) / blocking
    pairs = list(zip(out["serial"], out["overlapped"]))
    out["bitwise"] = all(a == b for a, b in pairs)
    # A race (rows, a copy or a hash read before they are complete) gives wrong numbers, not 1e-7.
    check(all(a is None or abs(a - b) <= 1e-6 * abs(a) for a, b in pairs),
          f"prefetch changed the losses: {out['serial']} vs {out['overlapped']}")
    return out


def offload(ctx: Context) -> dict:
    """Optimizer-state offload at model level, for both table optimizers: the same steps with
    the tables' masters and Adam moments in (pinned) host memory as without offload."""
    from engram_train.training.engram_optimizer import EngramTableOptimizer
    from engram_train.training.step import train_step

    steps = 3 if ctx.quick else 8
    precision, table_dtype = ("bf16", "bf16") if ctx.cuda else ("fp32", "fp32")
    out = dict(precision=precision, engram_table_dtype=table_dtype)
    for table_optimizer in ("sparse_adam",) if ctx.quick else ("sparse_adam", "adam"):
        runs = {}
        for offload_states in (False, True):
            cfg, config = trainer_config(ctx, [
                "model=deepseek_v3_tiny", f"system.precision={precision}",
                f"model.engram_table_dtype={table_dtype}", f"model.engram_optimizer={table_optimizer}",
                f"model.engram_offload_embedding_optimizer_states={offload_states}",
                f"model.engram_embedding_parallel_size={ctx.world}", f"train.seq_length={SEQ_TINY}"])
            gc.collect()  # the previous run's model and optimizer (reference cycles)
            if ctx.cuda:
                torch.cuda.empty_cache()
                base = torch.cuda.memory_allocated()
            torch.manual_seed(5)
            model, optimizer = build_trainer_parts(cfg, config)
            batches = with_hash_ids(config, synthetic_batches(2, 2, SEQ_TINY, 4000, seed=80 + ctx.rank))
            losses = [train_step(model, optimizer, batches, SEQ_TINY, 2).lm_loss for _ in range(steps)]
            synchronize(ctx)
            opt = [o for o in optimizer.chained_optimizers if isinstance(o, EngramTableOptimizer)][0]
            check(opt.offload == offload_states, "offload flag not honoured")
            run = dict(losses=losses, tables=[p.detach().float().cpu().clone() for p in opt.model_params])
            if ctx.cuda:
                run["gpu_mib"] = (torch.cuda.memory_allocated() - base) / 2**20
            if offload_states:
                states = [t for main in opt.main_params for t in opt.optimizer.state[main].values()
                          if isinstance(t, torch.Tensor) and t.numel() > 1]
                check(all(m.device.type == "cpu" and m.dtype == torch.float32 for m in opt.main_params),
                      "masters are not float32 host tensors")
                check(all(m is not p for m, p in zip(opt.main_params, opt.model_params)),
                      "a master is the table itself")
                check(bool(states) and all(t.device.type == "cpu" for t in states),
                      "Adam moments not in host memory")
                check(all(p.device.type == ctx.device.type for p in opt.model_params),
                      "tables left the device")
                if ctx.cuda:
                    check(all(m.is_pinned() for m in opt.main_params), "host masters not pinned")
                run["state_mib"] = sum(t.numel() * t.element_size() for t in states) / 2**20
            runs[offload_states] = run
            del model, optimizer, opt
        off, on = runs[False], runs[True]
        entry = dict(losses_off=off["losses"], losses_on=on["losses"],
                     table_max_diff=max((a - b).abs().max().item()
                                        for a, b in zip(off["tables"], on["tables"])),
                     host_state_mib=on["state_mib"])
        for a, b in zip(off["losses"], on["losses"]):
            check(a is None or abs(a - b) <= 1e-5 * abs(a), f"{table_optimizer}: losses {a} vs {b}")
        # bf16 tables: one ulp (the host Adam may round differently from the CUDA kernels)
        tol = 2 ** -7 * max(t.abs().max().item() for t in off["tables"]) if table_dtype == "bf16" else 1e-6
        check(entry["table_max_diff"] <= tol, f"{table_optimizer}: tables differ by {entry['table_max_diff']}")
        if ctx.cuda:
            entry["gpu_mib_off"], entry["gpu_mib_on"] = off["gpu_mib"], on["gpu_mib"]
            saved = off["gpu_mib"] - on["gpu_mib"]
            check(saved >= 0.9 * on["state_mib"],
                  f"{table_optimizer}: offload saved {saved:.1f} MiB of GPU memory, host holds "
                  f"{on['state_mib']:.1f} MiB of states")
        out[table_optimizer] = entry
    return out


def context_parallel(ctx: Context) -> dict:
    from megatron.core import parallel_state
    from megatron.core.utils import unwrap_model

    from engram_train.training.step import train_step

    micro, steps = 2, 3
    out, weights = {}, None
    for cp in (1, ctx.world):
        cfg, config = trainer_config(ctx, [
            "model=deepseek_v3_tiny", "system.precision=bf16", f"train.seq_length={SEQ_TINY}",
            f"system.context_parallel_size={cp}", f"train.micro_batch_size={micro}",
            f"train.global_batch_size={micro * ctx.world}"])
        model, optimizer = build_trainer_parts(cfg, config)
        chunk = unwrap_model(model)[0]
        if weights is None:  # CP 1 keeps its initial weights for the CP run
            weights = {n: p.detach().clone() for n, p in chunk.named_parameters()}
        else:
            with torch.no_grad():
                for n, p in chunk.named_parameters():
                    p.copy_(weights[n])
            for opt in optimizer.chained_optimizers:  # megatron's fp32 masters follow
                if hasattr(opt, "reload_model_params"):
                    opt.reload_model_params()
        dp = parallel_state.get_data_parallel_world_size()
        rank = parallel_state.get_data_parallel_rank()
        losses = []
        for step in range(steps):
            batches = with_hash_ids(config, synthetic_batches(ctx.world, micro, SEQ_TINY, 4000,
                                                              seed=70 + step))
            losses.append(train_step(model, optimizer, batches[rank::dp], SEQ_TINY,
                                     micro).lm_loss)
        out[f"cp{cp}"] = dict(losses=losses, attention=type(
            chunk.decoder.layers[0].self_attention.core_attention).__name__)
        del model, optimizer
    got, want = out[f"cp{ctx.world}"]["losses"], out["cp1"]["losses"]
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    out["max_rel_diff"] = worst
    check(worst < 0.02, f"CP {ctx.world} losses {got} vs CP 1 {want}")
    check(out[f"cp{ctx.world}"]["attention"].startswith("TE"),
          f"CP ran {out[f'cp{ctx.world}']['attention']}, not TE's attention")
    return out


def mhc_mapping_sync_free(ctx: Context, hidden: int = 256, tokens: int = 256) -> dict:
    """One mapping + write-back (and the head) forward and backward, recompute on and off,
    under ``set_sync_debug_mode("error")`` on CUDA: any host synchronisation raises. Also the
    bytes the mapping keeps for backward per token (``benchmarks/bench_mhc_memory.py``)."""
    from bench_mhc_memory import saved_bytes_per_token

    from engram_train.models.hyper_connection import HyperConnection, HyperHead

    n, dtype = 4, torch.bfloat16
    hc = HyperConnection(hidden, n, device=ctx.device)
    head = HyperHead(hidden, n, device=ctx.device)
    linear = torch.nn.Linear(hidden, hidden, device=ctx.device, dtype=dtype)
    x = torch.randn(tokens, 1, n, hidden, device=ctx.device, dtype=dtype, requires_grad=True)
    synchronize(ctx)
    if ctx.cuda:
        torch.cuda.set_sync_debug_mode("error")
    try:
        for recompute in (True, False):
            out = hc.sublayer(x, linear, recompute)
            (head(out).float().square().mean() + out.float().mean()).backward()
    finally:
        if ctx.cuda:
            torch.cuda.set_sync_debug_mode("default")
    synchronize(ctx)
    saved = {str(r): saved_bytes_per_token(n, hidden, dtype, r, ctx.device)
             for r in (True, False)}
    bound = (n + 1) * hidden * 2
    check(saved["True"] <= bound, f"recomputed mapping keeps {saved['True']} B/token > {bound}")
    return dict(sync_debug="error" if ctx.cuda else "not on CPU", hidden=hidden,
                saved_bytes_per_token=saved, bound_bytes_per_token=bound)


def mhc(ctx: Context) -> dict:
    from megatron.core.utils import unwrap_model

    from engram_train.training.step import train_step

    out = dict(mapping=mhc_mapping_sync_free(ctx))
    seq = SEQ_TINY if ctx.quick else 1024
    for name, extra in (("recompute", []), ("no_recompute", ["system.recompute_modules=[]"]),
                        ("no_mhc", ["model.enable_hyper_connections=false"])):
        cfg, config = trainer_config(ctx, [
            "model=deepseek_v3_tiny_mhc", "system.precision=bf16", f"train.seq_length={seq}",
            f"model.engram_embedding_parallel_size={ctx.world}", *extra])
        torch.manual_seed(5)
        model, optimizer = build_trainer_parts(cfg, config, lr=3e-4)
        mappings = {str(p.dtype) for c in unwrap_model(model) for n, p in c.named_parameters()
                    if "_hc." in n or "hc_head." in n}
        batches = with_hash_ids(config, synthetic_batches(2, 2, seq, 4000, seed=70 + ctx.rank))
        if ctx.cuda:
            torch.cuda.reset_peak_memory_stats()
        losses = [train_step(model, optimizer, batches, seq, 2).lm_loss for _ in range(3)]
        synchronize(ctx)
        out[name] = dict(losses=losses, mapping_dtypes=sorted(mappings),
                         recompute_modules=list(config.recompute_modules or []))
        if ctx.cuda:
            out[name]["peak_gpu_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
        check(all(l == l for l in losses), f"{name}: non-finite losses {losses}")
        del model, optimizer
        if ctx.cuda:
            torch.cuda.empty_cache()
    check(out["recompute"]["mapping_dtypes"] == ["torch.float32"],
          f"mapping parameters under bf16: {out['recompute']['mapping_dtypes']}")
    check("mhc" in out["recompute"]["recompute_modules"]
          and "mhc" not in out["no_recompute"]["recompute_modules"],
          "the mapping recompute is not on by default with mHC")
    on, off = out["recompute"]["losses"], out["no_recompute"]["losses"]
    out["recompute_loss_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(on, off))
    check(out["recompute_loss_rel_diff"] < 1e-2, f"recompute on {on} vs off {off}")
    return out


def throughput(ctx: Context) -> dict:
    from engram_train.data import HashPrefetchIterator
    from engram_train.engram.ngram_hash import NgramHashMapping
    from engram_train.training.step import train_step

    preset = "deepseek_v3_tiny" if ctx.quick else "deepseek_v3_small"
    seq, micro, warmup, timed = (SEQ_TINY, 2, 1, 3) if ctx.quick else (1024, 4, 3, 10)
    precision = "bf16" if ctx.cuda else "fp32"
    out = dict(preset=preset, seq_length=seq, micro_batch_size=micro, precision=precision)
    for engram in (False, True):
        cfg, config = trainer_config(ctx, [
            f"model={preset}", f"system.precision={precision}", f"model.use_engram={engram}",
            f"model.engram_embedding_parallel_size={ctx.world}", f"train.seq_length={seq}"])
        torch.manual_seed(5)
        model, optimizer = build_trainer_parts(cfg, config)
        raw = synthetic_batches(warmup + timed, micro, seq, 4000, seed=60 + ctx.rank)
        hash_fn = NgramHashMapping(config).hash_stacked if engram else None
        source = HashPrefetchIterator(raw, hash_fn) if engram else iter(raw)
        if ctx.cuda:
            torch.cuda.reset_peak_memory_stats()
        times, losses = [], []
        for step in range(warmup + timed):
            batch = next(source)
            synchronize(ctx)
            start = time.perf_counter()
            losses.append(train_step(model, optimizer, [batch], seq, micro).lm_loss)
            synchronize(ctx)
            if step >= warmup:
                times.append(time.perf_counter() - start)
        if engram:
            source.close()
        key = "engram" if engram else "no_engram"
        tokens = micro * seq * ctx.world
        out[key] = dict(step_ms_median=1000 * statistics.median(times),
                        tokens_per_s=tokens / statistics.median(times), losses=losses)
        if ctx.cuda:
            out[key]["peak_gpu_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            out[key]["memory_plan"] = memory_plan_vs_allocated(ctx, cfg, micro)
        check(all(l == l for l in losses), f"{key}: non-finite losses")
        del model, optimizer
        if ctx.cuda:
            torch.cuda.empty_cache()
    out["engram_over_no_engram_tokens_per_s"] = (out["engram"]["tokens_per_s"]
                                                 / out["no_engram"]["tokens_per_s"])
    return out


def memory_plan_vs_allocated(ctx: Context, cfg, micro: int) -> dict:
    """engram-plan's device bytes of this rank (without what the allocator does not count:
    CUDA context, NCCL buffers, fragmentation) against ``torch.cuda.max_memory_allocated``.
    Recorded, not checked: docs/memory.md states the GPU side as assumptions."""
    from engram_train.memory_plan.plan_cli import make_plan
    from engram_train.memory_plan.fixed import NOT_ALLOCATED
    from omegaconf import OmegaConf

    try:
        one_step = OmegaConf.merge(cfg, {"train": {"micro_batch_size": micro,
                                                   "global_batch_size": micro * ctx.world}})
        plan = make_plan(one_step, ctx.world, ctx.world, device="cuda")
        predicted = max(r.peak("device", exclude=NOT_ALLOCATED) for r in plan.ranks)
    except Exception as e:  # the plan is informative here; the section's checks stand
        return dict(error=f"{type(e).__name__}: {e}")
    measured = torch.cuda.max_memory_allocated()
    return dict(predicted_gib=round(predicted / 2**30, 3), measured_gib=round(measured / 2**30, 3),
                predicted_over_measured=round(predicted / measured, 3))


def v41_long(ctx: Context) -> dict:
    """DeepSeek-V4.1 at length: the sparse attention core against the dense oracle on the
    device (float32 forward and every gradient, bf16 forward), context parallelism over the
    process group (CP = world) against one process on packed rows, and the peak device memory
    of one V4.1-Flash-shaped attention layer (full layer, ratio 1, its indexer) forward and
    backward at sequence 32768 in bf16 (``--quick``: 1024 on narrower shapes)."""
    from test_v41_sparse_attention import dense_attention, outputs_and_grads, random_case

    from engram_train.models.deepseek_v41.v41_sparse_attention import sparse_attention

    out = {}
    s = 512 if ctx.quick else 4096
    case = [t.to(ctx.device).detach().requires_grad_(t.requires_grad) if t is not None else t
            for t in random_case(s, 1, 4, 64, s // 4, 64, True)]
    dense = outputs_and_grads(dense_attention, case, 128, 64 ** -0.5)
    sparse = outputs_and_grads(sparse_attention, case, 128, 64 ** -0.5)
    errors = [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(sparse, dense)]
    out["core_float32_max_rel_error"] = max(errors)
    check(max(errors) <= 1e-5, f"sparse vs dense on {ctx.device}: {errors}")
    out["cp"] = v41_context_parallel_check(ctx) if ctx.world > 1 else "skipped: one rank"
    out["flash_layer"] = v41_flash_layer_peak(ctx)
    return out


def v41_context_parallel_check(ctx: Context) -> dict:
    from v41_context_parallel import loss_and_gradients

    init_layout()
    one = loss_and_gradients(1, 1, ctx.device)
    init_layout(context=ctx.world)
    ours = loss_and_gradients(1, ctx.world, ctx.device)
    worst = max(((ours["grads"][k] - g).abs().max() / g.abs().max()).item()
                for k, g in one["grads"].items())
    check(abs(ours["loss"] - one["loss"]) <= 1e-5, f"CP loss {ours['loss']} vs {one['loss']}")
    check(worst <= 1e-4, f"CP gradients differ by {worst:.2e} relative")
    return dict(loss=ours["loss"], reference=one["loss"], worst_gradient=worst)


def v41_flash_layer_peak(ctx: Context) -> dict:
    from megatron.core.transformer import TransformerConfig

    from engram_train.models.deepseek_v41.v41_args import DeepseekV41BackboneArgs
    from engram_train.models.deepseek_v41.v41_attention import DeepseekV41Attention

    if ctx.quick:
        args = DeepseekV41BackboneArgs(hidden_size=256, num_attention_heads=4, head_dim=64,
                                       qk_rope_head_dim=32, q_lora_rank=64, o_lora_rank=64,
                                       o_groups=2, index_n_heads=4, index_head_dim=64,
                                       index_topk=64, sliding_window=64)
        seq = 1024
    else:
        args, seq = DeepseekV41BackboneArgs(), 32768  # the released V4.1-Flash shapes
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    config = TransformerConfig(num_layers=1, hidden_size=args.hidden_size, num_attention_heads=
                               args.num_attention_heads, params_dtype=dtype,
                               perform_initialization=False)
    layer_id = args.kv_source_layer_ids[-1]  # a full ratio-1 layer with its indexer
    init_layout()
    layer = DeepseekV41Attention(args, layer_id, config, device=ctx.device, dtype=dtype)
    x = torch.randn(seq, 1, args.hidden_size, device=ctx.device, dtype=dtype, requires_grad=True)
    if ctx.cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    started = time.perf_counter()
    out, _ = layer(x)
    out.float().square().mean().backward()
    synchronize(ctx)
    result = dict(seq=seq, ratio=args.compress_ratios[layer_id], seconds=time.perf_counter() - started)
    if ctx.cuda:
        result["peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    return result


SECTIONS = [
    Section("environment", "versions and device", needs_cuda=False, budget_s=5, run=environment),
    Section("te_spec", "Transformer Engine spec with Engram vs the local spec: forward and "
            "backward, fp32 and bf16", needs_cuda=True, needs_te=True, budget_s=60, run=te_spec),
    Section("nccl_embedding", "Engram lookups over the embedding-parallel group (alltoall "
            "eps = world) and TP (allreduce) vs a full table; lookup times", needs_cuda=False,
            min_world=2, budget_s=60, run=nccl_embedding),
    Section("bf16_training", "bf16 training with Float16Module, float32 main params, bf16 and "
            "fp32 tables: dtypes, residual stream, losses vs fp32", needs_cuda=False,
            budget_s=90, run=bf16_training),
    Section("prefetch", "lookup prefetch (async all-to-all) + hash thread + pinned non_blocking "
            "copies vs the serial path: equal losses", needs_cuda=False, budget_s=60, run=prefetch),
    Section("offload", "Engram optimizer-state offload (sparse_adam and adam): pinned host "
            "states, GPU memory, equality with no offload", needs_cuda=False, budget_s=90,
            run=offload),
    Section("context_parallel", "TE's CP attention + Engram's conv halo (CP = world) vs CP 1, "
            "bf16, same weights and batches: losses", needs_cuda=True, needs_te=True,
            min_world=2, budget_s=30, run=context_parallel),
    Section("mhc", "mHC in bf16: float32 mappings, no host syncs in the mapping "
            "(set_sync_debug_mode), saved bytes, recompute on/off/no mHC: losses, peak memory",
            needs_cuda=False, budget_s=25, run=mhc),
    Section("throughput", "tokens/s with vs without Engram (deepseek_v3_small, bf16)",
            needs_cuda=False, budget_s=60, run=throughput),
    Section("v41_long", "DeepSeek-V4.1 at length: sparse attention vs the dense oracle, CP = "
            "world vs one process on packed rows, one V4.1-Flash layer's peak at 32K",
            needs_cuda=False, budget_s=60, run=v41_long),
]


def plan(world: int, cuda: bool, allow_cpu: bool, only: set[str] | None) -> list[dict]:
    te = te_available() if cuda else False
    rows = []
    for s in SECTIONS:
        reason = None
        if only is not None and s.name not in only:
            reason = "not selected (--only)"
        elif not cuda and (s.needs_cuda or not allow_cpu) and s.name != "environment":
            reason = "needs CUDA" if s.needs_cuda else "needs CUDA (or --allow-cpu)"
        elif s.needs_te and not te:
            reason = "needs Transformer Engine (pip install -e '.[te]')"
        elif world < s.min_world:
            reason = f"needs {s.min_world}+ ranks (torchrun --nproc-per-node {s.min_world})"
        rows.append(dict(section=s.name, checks=s.what, budget_s=s.budget_s, runs=reason is None,
                         skip_reason=reason))
    return rows


def _time_out(report: dict, rank: int, out: str | None, started: float) -> None:
    """Past --time-limit (a hung collective, a slow machine): keep what was measured."""
    report.update(ok=False, timed_out_in=report.get("running"),
                  seconds=round(time.perf_counter() - started, 1))
    if rank == 0 and out:
        Path(out).write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps(dict(rank=rank, ok=False, timed_out_in=report.get("running"))), flush=True)
    os._exit(3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="engram_train GPU check")
    parser.add_argument("--out", default=None, help="JSON results (rank 0 writes it)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    parser.add_argument("--only", default=None, help="comma-separated sections")
    parser.add_argument("--allow-cpu", action="store_true",
                        help="run the sections that work without CUDA on the CPU (gloo)")
    parser.add_argument("--quick", action="store_true", help="small sizes (CPU runs)")
    parser.add_argument("--strict", action="store_true", help="a skipped section fails too")
    parser.add_argument("--time-limit", type=float, default=540.0,
                        help="seconds; past it the partial report is written and the run exits 3")
    args = parser.parse_args(argv)
    only = set(args.only.split(",")) if args.only else None
    unknown = (only or set()) - {s.name for s in SECTIONS}
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {[s.name for s in SECTIONS]}")
    world, cuda = int(os.environ.get("WORLD_SIZE", "1")), torch.cuda.is_available()
    rows = plan(world, cuda, args.allow_cpu, only)
    if args.dry_run:
        print(json.dumps(dict(world=world, cuda=cuda,
                              budget_s=sum(r["budget_s"] for r in rows if r["runs"]),
                              gpu_budget_s=sum(s.budget_s for s in SECTIONS), sections=rows),
                         indent=1))
        return 0

    if not cuda and not args.allow_cpu:  # every GPU section would be skipped: not a pass
        report = dict(world=world, cuda=False, ok=False, skipped="no CUDA device",
                      sections={r["section"]: dict(status="skipped", reason=r["skip_reason"])
                                for r in rows})
        if int(os.environ.get("RANK", "0")) == 0 and args.out:
            Path(args.out).write_text(json.dumps(report, indent=1, default=str))
        print("gpu_check: skipped: no CUDA device; nothing was checked. Run it on a GPU machine "
              "(--allow-cpu runs the sections that work on the CPU; --dry-run prints the plan)",
              file=sys.stderr, flush=True)
        return 2

    import torch.distributed as dist

    from engram_train.runtime import ParallelSizes, destroy_distributed, initialize_distributed

    started = time.perf_counter()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (prefetch)
    initialize_distributed(ParallelSizes(), seed=1234)
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    ctx = Context(device=device, world=world, rank=rank, quick=args.quick)
    report = dict(world=world, cuda=cuda, sections={})
    watchdog = threading.Timer(args.time_limit, _time_out, (report, rank, args.out, started))
    watchdog.daemon = True
    watchdog.start()
    for row, section in zip(rows, SECTIONS):
        report["running"] = section.name
        if not row["runs"]:
            report["sections"][section.name] = dict(status="skipped", reason=row["skip_reason"])
            continue
        t0 = time.perf_counter()
        try:
            result = dict(status="ok", **section.run(ctx))
        except Exception as e:  # record and go on: one GPU session should show every problem
            result = dict(status="failed", error=f"{type(e).__name__}: {e}",
                          traceback=traceback.format_exc()[-3000:])
        result["seconds"] = round(time.perf_counter() - t0, 1)
        report["sections"][section.name] = result
        print(json.dumps(dict(rank=rank, section=section.name, status=result["status"],
                              seconds=result["seconds"], error=result.get("error"))), flush=True)
        if rank == 0 and args.out:
            Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    watchdog.cancel()
    report.pop("running", None)
    statuses = [s["status"] for s in report["sections"].values()]
    report["ok"] = "failed" not in statuses and (not args.strict or "skipped" not in statuses)
    report["seconds"] = round(time.perf_counter() - started, 1)
    if rank == 0 and args.out:
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps(dict(rank=rank, ok=report["ok"], seconds=report["seconds"],
                          sections={k: v["status"] for k, v in report["sections"].items()})),
          flush=True)
    destroy_distributed()
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

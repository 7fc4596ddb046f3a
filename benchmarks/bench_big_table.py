"""A multi-billion-parameter Engram table trained in one process, at 4 bytes per parameter.

The demo model (``deepseek_v3_tiny``: Engram on layers 1 and 3, 8 heads of 16 values per row)
with host-resident tables in the 4-byte configuration (``engram_table_dtype=bf16``,
``engram_optimizer=rowwise_adam``, ``engram_master_weights=false``,
``engram_optimizer_state_dtype=bf16``, the host update overlapped with the next step), its
tables grown until they hold ``--params`` parameters (default 3e9), next to the same model at
the demo's table size (x1). Both train in one process, in interleaved rounds of
``--steps-per-round`` steps (drift on a shared machine hits both alike), each step naming the
next step's batch so the overlapped update changes its rows first.

Reported (JSON, and a summary on stdout):
- ``bytes_per_table_param``: resident memory the big model added (RSS after building it and
  materialising its optimizer state, as after a long run, minus RSS before), over its table
  parameters (the rest of the model counts against it too); and the accounting's value;
- ``peak_rss_gib``, ``init_s`` (build + state), median step time of each model and their
  ratio, the host update's total time per step and its critical-path part, swap used;
- with ``--checkpoint-peaks DIR``, after training: the peak RSS of saving the big model's
  checkpoint (model + optimizer) into DIR and of loading it back in place, as a resume does,
  each against the steady-state RSS just before (``checkpoint_peaks``: GiB, and bytes per
  table parameter beyond steady state). The peak is the kernel's ``VmHWM``, reset before each
  phase (``/proc/self/clear_refs``); the private memory of this process's children after
  each phase is reported beside it (a helper forked after the tables exist would hold copies
  of the pages written later). DIR is removed afterwards.

    python benchmarks/bench_big_table.py [--params 3e9] [--rounds 2] [--steps-per-round 5]
        [--checkpoint-peaks DIR]
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import resource
import shutil
import statistics
import time
from pathlib import Path

import torch
from bench_common import write_result

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "outputs" / "benchmarks" / "bench_big_table.json"
FOUR_BYTE = ["model.engram_table_placement=host", "model.engram_table_dtype=bf16",
             "model.engram_optimizer=rowwise_adam", "model.engram_master_weights=false",
             "model.engram_optimizer_state_dtype=bf16", "model.engram_overlap_host_update=true"]
X1_VOCAB = 20011  # the demo preset's engram_vocab_size per order
SEQ, MICRO, NUM_MICRO = 128, 2, 4


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def children_private_bytes() -> int:
    """Memory this process's children hold privately (USS): a helper forked from it (the
    checkpoint writer's queue manager on CPU hosts) that shares the tables' pages gets a copy
    of each page the trainer writes afterwards, outside the trainer's own RSS."""
    import psutil

    total = 0
    for child in psutil.Process().children(recursive=True):
        try:
            total += child.memory_full_info().uss
        except psutil.NoSuchProcess:
            pass
    return total


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": VmHWM back to the current RSS
        f.write("5")


def checkpoint_peaks(model, optimizer, num_params: int, directory: Path) -> dict:
    """Peak RSS of saving ``model`` and ``optimizer`` into ``directory`` and of loading it
    back in place (a resume), each beyond the steady-state RSS before it."""
    from engram_train.checkpoint import load_checkpoint_dir, save_checkpoint

    shutil.rmtree(directory, ignore_errors=True)
    out = {}
    try:
        for phase in ("save", "resume"):
            gc.collect()
            steady = rss_bytes()
            reset_peak_rss()
            start = time.perf_counter()
            if phase == "save":
                path = save_checkpoint(directory, 1, model, optimizer, check_space=False)
            else:
                load_checkpoint_dir(path, model, optimizer)
            peak = peak_rss_bytes()
            out[phase] = dict(steady_rss_gib=steady / 2**30, peak_rss_gib=peak / 2**30,
                              beyond_steady_gib=(peak - steady) / 2**30,
                              beyond_steady_bytes_per_param=(peak - steady) / num_params,
                              after_rss_gib=rss_bytes() / 2**30,
                              children_private_gib=children_private_bytes() / 2**30,
                              seconds=time.perf_counter() - start)
            print(f"{phase}: steady {steady / 2**30:.2f} GiB, peak {peak / 2**30:.2f} GiB, "
                  f"+{(peak - steady) / num_params:.3f} B/param, children's private memory "
                  f"{out[phase]['children_private_gib']:.2f} GiB, {out[phase]['seconds']:.0f} s",
                  flush=True)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return out


def swap_used_bytes() -> int:
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0]) * 1024
    return info["SwapTotal"] - info["SwapFree"]


def compose(vocab: int):
    from hydra import compose as hydra_compose, initialize_config_dir

    from engram_train.config import register

    register()  # the run config's schema (conf/train.yaml's defaults)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return hydra_compose(config_name="train", overrides=[
            "model=deepseek_v3_tiny", f"model.engram_vocab_size=[{vocab},{vocab}]", *FOUR_BYTE])


def build(vocab: int, lm_vocab: int):
    """(model chunks, optimizer, hash mapping, table params, bytes per param by accounting)."""
    from megatron.core.optimizer import OptimizerConfig

    from engram_train.engram.ngram_hash import NgramHashMapping
    from engram_train.models.builder import build_model
    from engram_train.models.table_params import engram_table_params
    from engram_train.training.engram_optimizer import EngramTableOptimizer
    from engram_train.training.optimizer import build_optimizer
    from engram_train.training.run_config import (
        build_transformer_config,
        engram_table_bytes_per_param,
    )

    config = build_transformer_config(compose(vocab))
    model = build_model(config, lm_vocab, SEQ)
    optimizer = build_optimizer(OptimizerConfig(optimizer="adam", lr=3e-3, clip_grad=1.0),
                                model, config)
    tables = optimizer.chained_optimizers[-1]
    assert isinstance(tables, EngramTableOptimizer) and tables.overlap
    for param in tables.main_params:  # the state as after a long run: every page touched
        for value in tables.optimizer.init_state(param).values():
            value.zero_()
    num_params = sum(p.numel() for p in engram_table_params(model))
    return model, optimizer, NgramHashMapping(config), num_params, engram_table_bytes_per_param(config)


def batches(mapping, lm_vocab: int, generator):
    out = []
    for _ in range(NUM_MICRO):
        tokens = torch.randint(0, lm_vocab, (MICRO, SEQ + 1), generator=generator)
        out.append(dict(tokens=tokens[:, :-1].contiguous(), labels=tokens[:, 1:].contiguous(),
                        loss_mask=torch.ones(MICRO, SEQ),
                        position_ids=torch.arange(SEQ).expand(MICRO, SEQ).contiguous()))
    return [dict(b, engram_hash_ids=mapping.hash_stacked(b["tokens"])) for b in out]


def run_round(setup, steps: int, generator, lm_vocab: int) -> list[dict]:
    from engram_train.engram.host_table import HOST_TABLE_TIMES
    from engram_train.training.step import train_step

    model, optimizer, mapping = setup
    times = []
    current = batches(mapping, lm_vocab, generator)
    for _ in range(steps):
        following = batches(mapping, lm_vocab, generator)
        HOST_TABLE_TIMES.reset()
        start = time.perf_counter()
        result = train_step(model, optimizer, current, SEQ, MICRO, next_microbatches=following)
        elapsed = time.perf_counter() - start
        times.append(dict(step_s=elapsed, loss=result.lm_loss,
                          critical_s=HOST_TABLE_TIMES.wait_s))
        current = following
    start = time.perf_counter()
    optimizer.chained_optimizers[-1].finish_update()  # the round's last update, counted
    times[-1]["step_s"] += time.perf_counter() - start
    times[-1]["critical_s"] += time.perf_counter() - start
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=3e9, help="table parameters of the big model")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps-per-round", type=int, default=5)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--checkpoint-peaks", type=Path, default=None, metavar="DIR",
                        help="also measure peak RSS at save and resume (DIR removed after)")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from engram_train.data import load_tokenizer
    from engram_train.engram.host_table import HOST_TABLE_TIMES
    from engram_train.logs import quiet_known_warnings
    from engram_train.runtime import ParallelSizes, initialize_distributed
    from engram_train.training.run_config import padded_vocab_size

    quiet_known_warnings()
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("RANK", "0")
    initialize_distributed(ParallelSizes(), seed=1)
    if args.checkpoint_peaks:
        from engram_train.runtime.cpu_compat import start_writer_queue_early

        start_writer_queue_early()  # as the trainer does: before the tables exist
    lm_vocab = padded_vocab_size(load_tokenizer(compose(X1_VOCAB).data.tokenizer).vocab_size, 1)

    small = build(X1_VOCAB, lm_vocab)
    per_x1 = small[3] / X1_VOCAB  # table parameters per unit of engram_vocab_size
    # the table primes lie a little above engram_vocab_size: aim 1% high, at least --params
    big_vocab = math.ceil(1.01 * args.params / per_x1)
    before = rss_bytes()
    start = time.perf_counter()
    big = build(big_vocab, lm_vocab)
    init_s = time.perf_counter() - start
    added = rss_bytes() - before
    print(f"big tables: {big[3]:,} parameters (engram_vocab_size {big_vocab:,}), built in "
          f"{init_s:.0f} s, +{added / 2**30:.2f} GiB RSS = {added / big[3]:.3f} B/param "
          f"(accounting {big[4]:.3f})", flush=True)

    generator = torch.Generator().manual_seed(0)
    steps = {"x1": [], "big": []}
    update = {"x1": [], "big": []}
    for _ in range(args.rounds):
        for name, (model, optimizer, mapping, *_rest) in (("x1", small), ("big", big)):
            HOST_TABLE_TIMES.reset()
            steps[name] += run_round((model, optimizer, mapping), args.steps_per_round,
                                     generator, lm_vocab)
            update[name].append(HOST_TABLE_TIMES.update_s / args.steps_per_round)
    median = {k: statistics.median(s["step_s"] for s in v[1:]) for k, v in steps.items()}
    critical = {k: statistics.median(s["critical_s"] for s in v[1:]) for k, v in steps.items()}
    result = dict(
        table_params=big[3], table_params_x1=small[3], engram_vocab_size=big_vocab,
        bytes_per_table_param=added / big[3], bytes_per_table_param_accounting=big[4],
        peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        init_s=init_s, step_s_median=median, step_ratio_big_over_x1=median["big"] / median["x1"],
        update_total_s_per_step=update, update_critical_s_median=critical,
        steps_trained={k: len(v) for k, v in steps.items()},
        losses={k: [s["loss"] for s in v] for k, v in steps.items()},
        swap_used_gib=swap_used_bytes() / 2**30, rounds=args.rounds,
        steps_per_round=args.steps_per_round,
    )
    if args.checkpoint_peaks is not None:
        model, optimizer = big[0], big[1]
        result["checkpoint_peaks"] = checkpoint_peaks(model, optimizer, big[3],
                                                      args.checkpoint_peaks)
    print(f"step median x1 {median['x1'] * 1000:.0f} ms, big {median['big'] * 1000:.0f} ms "
          f"(ratio {result['step_ratio_big_over_x1']:.3f}); host update per step: total "
          f"{statistics.median(update['big']) * 1000:.1f} ms, critical path "
          f"{critical['big'] * 1000:.1f} ms; peak RSS {result['peak_rss_gib']:.2f} GiB; swap "
          f"{result['swap_used_gib']:.2f} GiB", flush=True)
    write_result(args.out, result)


if __name__ == "__main__":
    main()

"""engram-plan against measured peak RSS on configurations the plan was not calibrated on.

    python benchmarks/measure_memory_plan.py OUT.json [--cases NAME,NAME] [--set NAME|all] [--replan]

Runs the trainer (3 steps, the trainer's defaults otherwise: hash prefetch on, the data
loader as configured) through ``tests/dist/memory_calibration.py`` for every case, reads each
rank's peak RSS (``getrusage``), asks ``engram-plan --json`` for the same overrides with the
measured process baseline, and writes predicted / measured per rank, the ratio and the plan's
``fits`` verdict for ``--host-memory`` = the measured peak (a "yes" there must be a
``tight``/``NO``, never a yes below the peak). docs/memory.md quotes its table.

``HELD_OUT`` are the configurations of the error table (never used to set a constant);
``CALIBRATION`` are the new configurations the items were measured on (ablations: the same
run with one option changed, so that the difference is that item's bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from memory_calibration_cases import torchrun_calibration  # noqa: E402

RUN = ("train.train_iters=3", "train.eval_interval=null", "train.log_interval=1",
       "train.lr_warmup_iters=0")
MHC_H512 = ("model=deepseek_v3_tiny_mhc", "system.precision=bf16", "model.hidden_size=512",
            "model.num_attention_heads=8", "train.seq_length=2048", "train.micro_batch_size=1",
            "train.global_batch_size=1")

# name: (processes, overrides)
HELD_OUT = {
    "host_rowwise_s512": (1, ("model.engram_table_placement=host", "model.engram_optimizer=rowwise_adam",
                              "train.seq_length=512")),
    "mhc_bf16_h512_s2048": (1, MHC_H512),
    "mhc_host_s1024": (1, ("model=deepseek_v3_tiny_mhc", "model.engram_table_placement=host",
                           "train.seq_length=1024")),
    "tp2_sp_eps2_s1024": (2, ("system.tensor_model_parallel_size=2", "system.sequence_parallel=true",
                              "model.engram_embedding_parallel_size=2", "train.seq_length=1024",
                              "train.global_batch_size=4")),
    "adam_bf16_tables_s768": (1, ("model.engram_optimizer=adam", "model.engram_table_dtype=bf16",
                                  "model.engram_vocab_size=[200003,200003]", "train.seq_length=768")),
    "pp2_host_bf16_s512": (2, ("system.pipeline_model_parallel_size=2", "system.precision=bf16",
                               "model.engram_table_placement=host", "train.seq_length=512",
                               "train.global_batch_size=8")),
}

# DeepSeek-V4.1 at length with the sparse attention (none was run before its plan terms were
# written): the tiny preset at 4096 and 16384 tokens, widened, in bf16, and over CP 2.
V41_TINY = ("model=deepseek_v41_tiny", "train.micro_batch_size=1", "train.global_batch_size=1",
            "system.memory_check=warn")
V41_LONG = {
    "v41_s4096": (1, (*V41_TINY, "train.seq_length=4096")),
    "v41_h128_bf16_s4096": (1, (*V41_TINY, "model.hidden_size=128", "system.precision=bf16",
                                "train.seq_length=4096")),
    "v41_s16384": (1, (*V41_TINY, "train.seq_length=16384")),
    "v41_cp2_docs_s16384": (2, (*V41_TINY, "system.context_parallel_size=2",
                                "+model.document_eos_id=0", "train.seq_length=16384")),
    # measured after v41_plan.CPU_HEAP_HOLE_FRACTION was set (from v41_s16384)
    "v41_h96_s8192": (1, (*V41_TINY, "model.hidden_size=96", "train.seq_length=8192")),
    "v41_tp2_sp_s8192": (2, (*V41_TINY, "system.tensor_model_parallel_size=2",
                             "system.sequence_parallel=true", "train.seq_length=8192")),
}

# Held out from the CPU items of memory_plan/fixed.py (bf16 MoE kernel caches; a flat heap top
# then, cpu_heap.py now): none of these was run before those items were set.
HELD_OUT_2 = {
    "h384_s768": (1, ("model.hidden_size=384", "model.num_attention_heads=6", "train.seq_length=768")),
    "pp2_fp32_s1024": (2, ("system.pipeline_model_parallel_size=2", "train.seq_length=1024",
                           "train.global_batch_size=8")),
    "tp2_sp_bf16_s512": (2, ("system.tensor_model_parallel_size=2", "system.sequence_parallel=true",
                             "system.precision=bf16", "train.seq_length=512",
                             "train.global_batch_size=4", "train.train_iters=10")),
    "dense_bf16_s1024": (1, ("model.num_moe_experts=null", "model.moe_ffn_hidden_size=null",
                             "model.moe_shared_expert_intermediate_size=null",
                             "system.precision=bf16", "train.seq_length=1024")),
    "ep2_bf16_host_s512": (2, ("system.expert_model_parallel_size=2", "system.precision=bf16",
                               "model.engram_table_placement=host", "train.seq_length=512",
                               "train.global_batch_size=8", "train.train_iters=10")),
    "pp2_bf16_h128_s768": (2, ("system.pipeline_model_parallel_size=2", "system.precision=bf16",
                               "model.hidden_size=128", "train.seq_length=768",
                               "train.global_batch_size=8", "train.train_iters=6")),
    "h192_bf16_s1024_mb1": (1, ("model.hidden_size=192", "model.num_attention_heads=6",
                                "system.precision=bf16", "train.seq_length=1024",
                                "train.micro_batch_size=1", "train.global_batch_size=4",
                                "train.train_iters=5")),
    "mhc_pp2_bf16_s512": (2, ("model=deepseek_v3_tiny_mhc", "system.pipeline_model_parallel_size=2",
                              "system.precision=bf16", "train.seq_length=512",
                              "train.global_batch_size=8", "train.train_iters=4")),
    "tp2_h256_s512": (2, ("system.tensor_model_parallel_size=2", "model.hidden_size=256",
                          "model.num_attention_heads=8", "train.seq_length=512",
                          "train.global_batch_size=4")),
}

# Held out from the kernel caches' fill curve (fixed.CPU_KERNEL_CACHE_FILL_EXPERT_BATCHES), which
# was fitted to the fills of the calibration runs and of the two sets above: none of these ran
# before it was set.
HELD_OUT_3 = {
    "pp2_bf16_s256_mb1": (2, ("system.pipeline_model_parallel_size=2", "system.precision=bf16",
                              "train.seq_length=256", "train.micro_batch_size=1",
                              "train.global_batch_size=8")),
    "bf16_h96_s640_5steps": (1, ("model.hidden_size=96", "model.num_attention_heads=4",
                                 "system.precision=bf16", "train.seq_length=640",
                                 "train.train_iters=5")),
    "ep2_bf16_s384_4steps": (2, ("system.expert_model_parallel_size=2", "system.precision=bf16",
                                 "train.seq_length=384", "train.global_batch_size=8",
                                 "train.train_iters=4")),
    "mhc_bf16_host_s768": (1, ("model=deepseek_v3_tiny_mhc", "system.precision=bf16",
                               "model.engram_table_placement=host", "train.seq_length=768")),
    "tp2_sp_host_s768": (2, ("system.tensor_model_parallel_size=2", "system.sequence_parallel=true",
                             "model.engram_table_placement=host", "train.seq_length=768",
                             "train.global_batch_size=4")),
    "rowwise_bf16_tables_s1024": (1, ("model.engram_optimizer=rowwise_adam", "model.engram_table_dtype=bf16",
                                      "train.seq_length=1024")),
    "bf16_mb4_s256_8steps": (1, ("system.precision=bf16", "train.seq_length=256",
                                 "train.micro_batch_size=4", "train.global_batch_size=8",
                                 "train.train_iters=8")),
}

# Held out from the heap-hole fraction (memory_plan/cpu_heap.py), which was fitted to the sets
# above: none of these ran before it was set.
HELD_OUT_4 = {
    "h256_h8_s512_mb1": (1, ("model.hidden_size=256", "model.num_attention_heads=8",
                             "train.seq_length=512", "train.micro_batch_size=1",
                             "train.global_batch_size=4")),
    "h128_h8_s1024_mb1": (1, ("model.hidden_size=128", "model.num_attention_heads=8",
                              "train.seq_length=1024", "train.micro_batch_size=1",
                              "train.global_batch_size=4")),
    "tp2_h192_s768": (2, ("system.tensor_model_parallel_size=2", "model.hidden_size=192",
                          "model.num_attention_heads=6", "train.seq_length=768",
                          "train.global_batch_size=4")),
    "ep2_bf16_h128_s512_6steps": (2, ("system.expert_model_parallel_size=2", "system.precision=bf16",
                                      "model.hidden_size=128", "train.seq_length=512",
                                      "train.global_batch_size=8", "train.train_iters=6")),
    "mhc_fp32_s768": (1, ("model=deepseek_v3_tiny_mhc", "train.seq_length=768")),
    "dense_fp32_h256_s768": (1, ("model.num_moe_experts=null", "model.moe_ffn_hidden_size=null",
                                 "model.moe_shared_expert_intermediate_size=null",
                                 "model.hidden_size=256", "train.seq_length=768")),
    "pp2_fp32_h128_host_s640": (2, ("system.pipeline_model_parallel_size=2", "model.hidden_size=128",
                                    "model.engram_table_placement=host", "train.seq_length=640",
                                    "train.global_batch_size=8")),
    "bf16_h160_s896_mb1_4steps": (1, ("model.hidden_size=160", "model.num_attention_heads=5",
                                      "system.precision=bf16", "train.seq_length=896",
                                      "train.micro_batch_size=1", "train.global_batch_size=4",
                                      "train.train_iters=4")),
}

# The kernel caches' fill (fixed.CPU_BF16_MOE_KERNEL_CACHE_BYTES and _FILL_EXPERT_BATCHES were
# fitted to these fills with those of the calibration runs and the first two held-out sets):
# bf16 MoE runs of 1, 3 and 16 steps at 256-2048 tokens per micro-batch and hidden 64-128, and
# fp32 twins that show what the plan misses without the caches.
_BF16 = ("system.precision=bf16", "train.global_batch_size=8")
_H96 = ("model.hidden_size=96", "model.num_attention_heads=4", "train.seq_length=640")
KERNEL_CACHE_FILL = {
    "b_h64_T256_16": (1, (*_BF16, "train.seq_length=128", "train.train_iters=16")),
    "b_h64_T512_16": (1, (*_BF16, "train.seq_length=256", "train.train_iters=16")),
    "b_h64_T1024_16": (1, (*_BF16, "train.seq_length=512", "train.train_iters=16")),
    "b_h64_T2048_16": (1, (*_BF16, "train.seq_length=1024", "train.train_iters=16")),
    "b_h64_T1024_1": (1, (*_BF16, "train.seq_length=512", "train.train_iters=1")),
    "b_h64_T1024_3": (1, (*_BF16, "train.seq_length=512", "train.train_iters=3")),
    "b_h96_s640_1": (1, (*_H96, "system.precision=bf16", "train.train_iters=1")),
    "b_h96_s640_16": (1, (*_H96, "system.precision=bf16", "train.train_iters=16")),
    "b_h128_T1024_16": (1, (*_BF16, "model.hidden_size=128", "model.num_attention_heads=4",
                            "train.seq_length=512", "train.train_iters=16")),
    "f_h96_s640_5": (1, (*_H96, "train.train_iters=5")),
    "f_h96_s512_5": (1, ("model.hidden_size=96", "model.num_attention_heads=4", "train.seq_length=512",
                         "train.train_iters=5")),
    "f_h64_s640_5": (1, ("train.seq_length=640", "train.train_iters=5")),
}

CALIBRATION = {
    # attention scores: the default model at 512 and 1024 (the difference is s^2 terms)
    "dense_s512": (1, ("model.use_engram=false", "train.seq_length=512")),
    "dense_s1024": (1, ("model.use_engram=false", "train.seq_length=1024")),
    # host tables: device vs host, overlapped update on/off
    "device_s512": (1, ("train.seq_length=512",)),
    "host_s512": (1, ("model.engram_table_placement=host", "train.seq_length=512")),
    "host_s512_no_overlap": (1, ("model.engram_table_placement=host", "train.seq_length=512",
                                 "model.engram_overlap_host_update=false")),
    "host_s512_no_prefetch": (1, ("model.engram_table_placement=host", "train.seq_length=512",
                                  "data.hash_prefetch=false")),
    # mHC at hidden 512: on vs off
    "h512_s2048_no_mhc": (1, (*MHC_H512, "model.enable_hyper_connections=false")),
    "h512_s1024_mhc": (1, (*MHC_H512[:-3], "train.seq_length=1024", "train.micro_batch_size=1",
                           "train.global_batch_size=1")),
}


def plan(overrides: list[str], nproc: int, baseline: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "engram_train.memory_plan", *overrides, "--json",
                           "--nproc-per-node", str(nproc), "--cpu-baseline", str(baseline)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(proc.stdout)


def verdict(overrides: list[str], nproc: int, baseline: int, host_memory: int) -> str:
    """The plan's ``fits`` with exactly the measured peak per node as the host memory."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "engram_train.memory_plan", *overrides,
                           "--nproc-per-node", str(nproc), "--cpu-baseline", str(baseline),
                           "--host-memory", str(host_memory)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    return next((line for line in proc.stdout.splitlines() if line.startswith("fits:")), proc.stderr[-300:])


def measure(name: str, nproc: int, overrides: tuple[str, ...], root: Path, baseline: int) -> dict:
    ovr = [*RUN, *overrides]
    start = time.time()
    ranks = torchrun_calibration(nproc, root / name, ovr)
    p = plan(ovr, nproc, baseline)
    out = {"nproc": nproc, "overrides": list(overrides), "seconds": round(time.time() - start), "ranks": []}
    for r in ranks:
        stage = p["breakdown"][f"stage{r['pipeline_rank']}"]
        predicted = stage["device_bytes"] + stage["host_bytes"]
        out["ranks"].append({"stage": r["pipeline_rank"], "predicted_mib": round(predicted / 2**20),
                             "measured_mib": round(r["peak_rss"] / 2**20),
                             "ratio": round(predicted / r["peak_rss"], 3)})
    peak_node = sum(r["peak_rss"] for r in ranks) if nproc > 1 else ranks[0]["peak_rss"]
    out["fits_at_measured_peak"] = verdict(ovr, nproc, baseline, peak_node)
    out["items_stage0"] = {k: round(v["bytes"] / 2**20, 1) for k, v in p["breakdown"]["stage0"]["items"].items()}
    return out


def scores(b: int, heads: int, s: int, dtype: str, layers: int) -> dict:
    """torch SDPA's CPU math path (MLA: q/k head dim 24, v 16) on ``layers`` chained calls:
    unique saved bytes per layer and the peak RSS over the saved ones, in float32
    ``[b, heads, s, s]`` units (activations.SCORE_TRANSIENTS)."""
    import resource

    import torch
    import torch.nn.functional as F

    def rss() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    dt = getattr(torch, dtype)
    x = torch.randn(b, heads, s, 24, dtype=dt, requires_grad=True)
    y = torch.randn(b, heads, s, 16, dtype=dt, requires_grad=True)
    start = rss()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for _ in range(layers):
            y = F.scaled_dot_product_attention(x * 1.0, x * 1.0, y, is_causal=True)
    y.sum().backward()
    unit = b * heads * s * s * 4
    saved = sum(seen.values())
    return {"saved_per_layer": round(saved / layers / unit, 2),
            "transients": round((rss() - start - saved) / unit, 2)}


def replan(out_path: Path) -> None:
    """Predict again (the current plan) for every measured case of ``out_path``."""
    results = json.loads(out_path.read_text())
    for name, case in results.items():
        if not isinstance(case, dict) or "ranks" not in case:
            continue
        ovr = [*RUN, *case["overrides"]]
        p = plan(ovr, case["nproc"], results["baseline"])
        for r in case["ranks"]:
            stage = p["breakdown"][f"stage{r['stage']}"]
            predicted = stage["device_bytes"] + stage["host_bytes"]
            r["predicted_mib"] = round(predicted / 2**20)
            r["ratio"] = round(r["predicted_mib"] / r["measured_mib"], 3)
        peak_node = sum(r["measured_mib"] for r in case["ranks"]) * 2**20
        case["fits_at_measured_peak"] = verdict(ovr, case["nproc"], results["baseline"], peak_node)
        case["items_stage0"] = {k: round(v["bytes"] / 2**20, 1) for k, v in p["breakdown"]["stage0"]["items"].items()}
        print(name, json.dumps({k: v for k, v in case.items() if k != "items_stage0"}), flush=True)
    out_path.write_text(json.dumps(results, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--replan", action="store_true", help="predict again, measure nothing")
    parser.add_argument("--scores", action="store_true", help="measure SDPA's CPU score transients")
    parser.add_argument("--set", default="held_out",
                        choices=("held_out", "held_out_2", "held_out_3", "held_out_4", "v41_long", "kernel_cache_fill",
                                 "calibration", "all"))
    parser.add_argument("--cases", default="", help="comma-separated subset")
    parser.add_argument("--baseline", type=int, default=None, help="bytes (default: measure)")
    args = parser.parse_args()
    if args.replan:
        return replan(Path(args.out))
    if args.scores:
        rows = {f"{dt} s{s} L{n}": scores(1, 8, s, dt, n) for dt in ("float32", "bfloat16")
                for s in (1024, 2048) for n in (1, 4)}
        print(json.dumps(rows, indent=1))
        return Path(args.out).write_text(json.dumps(rows, indent=1))
    sets = {"held_out": HELD_OUT, "held_out_2": HELD_OUT_2, "held_out_3": HELD_OUT_3,
            "held_out_4": HELD_OUT_4, "v41_long": V41_LONG, "kernel_cache_fill": KERNEL_CACHE_FILL, "calibration": CALIBRATION}
    cases = {k: v for name, group in sets.items() if args.set in (name, "all") for k, v in group.items()}
    if args.cases:
        cases = {k: v for k, v in cases.items() if k in args.cases.split(",")}
    root = Path(args.out).with_suffix("")
    out_path = Path(args.out)
    results = json.loads(out_path.read_text()) if out_path.exists() else {}
    baseline = args.baseline or results.get("baseline")
    if not baseline:
        runs = torchrun_calibration(2, root / "baseline", [*RUN, "train.global_batch_size=4"], baseline=True)
        baseline = max(r["peak_rss"] for r in runs)
    results["baseline"] = baseline
    for name, (nproc, overrides) in cases.items():
        try:
            results[name] = measure(name, nproc, overrides, root, baseline)
        except (AssertionError, RuntimeError) as e:
            results[name] = {"error": str(e)[-2000:]}
        print(name, json.dumps({k: v for k, v in results[name].items() if k != "items_stage0"}), flush=True)
        out_path.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

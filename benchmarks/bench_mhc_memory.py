"""What the mHC backbone keeps for backward: per sublayer, and in the trainer.

1. Saved-for-backward bytes per token of one sublayer's mapping and write-back (the sublayer
   itself excluded), counted with ``torch.autograd.graph.saved_tensors_hooks`` (each storage
   once, parameters left out), for n = 4 streams at ``--hidden`` sizes, fp32 and bf16, the
   mapping recompute on and off, against the bound ``(n + 1) x hidden x 2`` bytes (X and the
   sublayer's output in bf16).
2. The trainer (1 process, ``--precision``, no Engram, hidden 512, seq 2048, one sequence per
   step: the model of ``docs/mhc.md``'s acceptance run): peak RSS and median step time with mHC
   off, mHC with the mapping recompute (the default) and mHC without it
   (``system.recompute_modules=[]``), the variants interleaved in every round; step-time
   ratios are the median of the per-round ratios.

    python benchmarks/bench_mhc_memory.py [--hidden 512 1024] [--rounds 1] [--iters 6]
        [--warmup 2] [--skip-trainer] [--out PATH.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from bench_common import write_result

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
DEFAULT_OUT = REPO / "outputs" / "benchmarks" / "bench_mhc_memory.json"
STREAMS = 4
TRAINER_MODEL = ["model.use_engram=false", "model.hidden_size=512",
                 "model.num_attention_heads=8", "model.ffn_hidden_size=1024",
                 "model.moe_ffn_hidden_size=256", "model.moe_shared_expert_intermediate_size=256",
                 "train.seq_length=2048", "train.global_batch_size=1", "train.micro_batch_size=1"]
TRAINER_VARIANTS = {  # name -> overrides on top of TRAINER_MODEL
    "mhc_off": [],
    "mhc_recompute": ["model.enable_hyper_connections=true"],
    "mhc_no_recompute": ["model.enable_hyper_connections=true", "system.recompute_modules=[]"],
}


def saved_bytes_per_token(n: int, hidden: int, dtype: torch.dtype, recompute: bool,
                          device=None, tokens: int = 64) -> float:
    """Bytes one mapping + write-back keeps for backward, per token (F: a linear, whose own
    saved input is not counted)."""
    from engram_train.models.hyper_connection import HyperConnection

    hc = HyperConnection(hidden, n, device=device)
    linear = torch.nn.Linear(hidden, hidden, device=device, dtype=dtype)
    x = torch.randn(tokens, 1, n, hidden, device=device, dtype=dtype, requires_grad=True)
    params = {p.data_ptr() for p in hc.parameters()}
    storages: dict[int, int] = {}
    counting = [True]

    def pack(t):
        if counting[0] and t.data_ptr() not in params:
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    def sublayer(u):
        counting[0] = False
        y = linear(u)
        counting[0] = True
        return y

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        hc.sublayer(x, sublayer, recompute)
    return sum(storages.values()) / tokens


def saved_table(hiddens: list[int]) -> list[dict]:
    rows = []
    for hidden in hiddens:
        bound = (STREAMS + 1) * hidden * 2
        for dtype in (torch.float32, torch.bfloat16):
            for recompute in (False, True):
                got = saved_bytes_per_token(STREAMS, hidden, dtype, recompute)
                rows.append(dict(hidden=hidden, dtype=str(dtype).removeprefix("torch."),
                                 recompute=recompute, bytes_per_token=got,
                                 kib_per_token=round(got / 1024, 2),
                                 over_bf16_residual=round(got / (hidden * 2), 2),
                                 bound_bytes=bound))
    return rows


def trainer_runs(precision: str, rounds: int, iters: int, warmup: int) -> dict:
    from bench_mhc import run_trainer

    times = {name: [] for name in TRAINER_VARIANTS}
    peaks = {name: [] for name in TRAINER_VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for name, extra in TRAINER_VARIANTS.items():
                got = run_trainer([*TRAINER_MODEL, f"system.precision={precision}", *extra],
                                  iters, 1, Path(tmp), eval_interval=10**6)
                steps = [t for i, t in sorted(got["steps"].items()) if i > warmup]
                times[name].append(statistics.median(steps))
                peaks[name].append(got["peak_rss_gib"])
                print(f"round {r} {name}: step {times[name][-1] * 1000:.0f} ms, "
                      f"peak RSS {got['peak_rss_gib']:.2f} GiB", flush=True)
    out = {name: dict(step_ms_median=1000 * statistics.median(times[name]),
                      round_step_ms=[round(1000 * t, 1) for t in times[name]],
                      peak_rss_gib=max(peaks[name])) for name in TRAINER_VARIANTS}
    base = out["mhc_off"]
    for name in ("mhc_recompute", "mhc_no_recompute"):
        out[name]["rss_over_off_gib"] = round(out[name]["peak_rss_gib"] - base["peak_rss_gib"], 3)
        # the ratio within each round (its runs are minutes apart), then the median over rounds:
        # load on the machine that slows a round slows all of its variants alike
        out[name]["step_ratio_over_off"] = round(statistics.median(
            t / b for t, b in zip(times[name], times["mhc_off"])), 3)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, nargs="+", default=[512, 1024])
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2, help="iterations left out of the median")
    p.add_argument("--skip-trainer", action="store_true")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    result = dict(streams=STREAMS, saved=saved_table(args.hidden))
    print("| hidden | dtype | recompute | saved KiB/token | x bf16 residual | bound (B) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in result["saved"]:
        print(f"| {r['hidden']} | {r['dtype']} | {'on' if r['recompute'] else 'off'} | "
              f"{r['kib_per_token']} | {r['over_bf16_residual']} | {r['bound_bytes']} |")
    if not args.skip_trainer:
        result["trainer"] = dict(model=TRAINER_MODEL, precision=args.precision,
                                 rounds=args.rounds, iters=args.iters, warmup=args.warmup,
                                 **trainer_runs(args.precision, args.rounds, args.iters,
                                                args.warmup))
        print("\n| variant | step (ms) | peak RSS (GiB) |\n| --- | --- | --- |")
        for name in TRAINER_VARIANTS:
            t = result["trainer"][name]
            print(f"| {name} | {t['step_ms_median']:.0f} | {t['peak_rss_gib']:.2f} |")
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()

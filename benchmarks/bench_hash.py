"""Hash speed: project NgramHashMapping vs a plain numpy transcription of the reference `hash()`.

Same inputs, same run (candidates interleaved so they share the machine's load), outputs
asserted equal; tokens/s counts input tokens hashed for all Engram layers. Writes the medians
and their ratios as JSON (spec section 6, "Hash speed"). The project returns hashes stored
head-major (a permuted [B, T, K] view); the `c_order` row adds the copy to C order.

    python benchmarks/bench_hash.py [--out outputs/benchmarks/bench_hash.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from engram_train.config import EngramConfig
from engram_train.engram.ngram_hash import NgramHashMapping
from engram_train.engram.compressed_tokenizer import CompressedTokenizer

REPO = Path(__file__).resolve().parents[1]
GOLDEN_TOKENIZER = REPO / "tests" / "data" / "golden" / "tok_bpe4k"


def reference_hash(input_ids, lookup, pad_id, layer_ids, multipliers, head_vocab_sizes, n_max):
    """The reference `NgramHashMapping.hash`, transcribed the straightforward way it is written."""
    x = np.asarray(input_ids, dtype=np.int64)
    x = lookup[x]  # compress once
    _, seq_len = x.shape
    out = {}
    for layer_id in layer_ids:
        m = multipliers[layer_id]

        def shift_k(k):
            if k == 0:
                return x
            return np.pad(x, ((0, 0), (k, 0)), mode="constant", constant_values=pad_id)[:, :seq_len]

        base_shifts = [shift_k(k) for k in range(n_max)]
        all_hashes = []
        for n in range(2, n_max + 1):
            tokens = base_shifts[:n]
            mix = tokens[0] * m[0]
            for k in range(1, n):
                mix = np.bitwise_xor(mix, tokens[k] * m[k])
            for mod in head_vocab_sizes[layer_id][n - 2]:
                all_hashes.append((mix % int(mod)).astype(np.int64, copy=False))
        out[layer_id] = np.stack(all_hashes, axis=2)
    return out


def interleaved_times(fns, repeats):
    """Alternate the candidates so that both see the same machine load; seconds per call."""
    for fn in fns:
        fn()  # warm-up
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return times


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "outputs" / "benchmarks" / "bench_hash.json"))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--tokenizer", default=str(GOLDEN_TOKENIZER))
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="hashing threads of the headline project run (default: all cores)")
    parser.add_argument("--min-speedup", type=float, default=0.0,
                        help="exit non-zero if the headline speedup is below this")
    args = parser.parse_args(argv)

    config = EngramConfig(
        use_engram=True,
        engram_tokenizer_name_or_path=args.tokenizer,
        engram_vocab_size=[1131200, 1131200],
        max_ngram_size=3,
        n_head_per_ngram=8,
        engram_layer_ids=[1, 15],
    )
    with tempfile.TemporaryDirectory() as cache:
        tokenizer = CompressedTokenizer(config.engram_tokenizer_name_or_path, cache_dir=cache)
    single = NgramHashMapping(config, tokenizer, num_threads=1)
    threaded = NgramHashMapping(config, tokenizer, num_threads=args.threads)
    rng = np.random.default_rng(0)
    ids_np = rng.integers(0, tokenizer.num_raw_ids, size=(args.batch, args.seq), dtype=np.int64)
    ids_t = torch.from_numpy(ids_np)  # the batch arrives as a torch tensor from the loader

    candidates = {
        "reference": lambda: reference_hash(
            ids_np, tokenizer.lookup, single.pad_id, single.layer_ids, single.multipliers,
            single.head_vocab_sizes, config.max_ngram_size),
        "project_1_thread": lambda: single.hash(ids_t),
        f"project_{args.threads}_threads": lambda: threaded.hash(ids_t),
        # What a consumer that insists on C order would pay on top (the lookup does not).
        "project_1_thread_c_order": lambda: {
            layer: np.ascontiguousarray(value) for layer, value in single.hash(ids_np).items()
        },
    }
    expected = candidates["reference"]()
    for name, fn in candidates.items():
        got = fn()
        for layer_id in single.layer_ids:
            np.testing.assert_array_equal(np.asarray(got[layer_id]), expected[layer_id],
                                          err_msg=f"{name} differs from the reference")

    times = dict(zip(candidates, interleaved_times(list(candidates.values()), args.repeats)))
    medians = {name: statistics.median(t) for name, t in times.items()}
    tokens = args.batch * args.seq
    ref_s = medians["reference"]
    headline = f"project_{args.threads}_threads"
    result = {
        "shape": [args.batch, args.seq],
        "engram_layer_ids": single.layer_ids,
        "max_ngram_size": config.max_ngram_size,
        "n_head_per_ngram": config.n_head_per_ngram,
        "engram_vocab_size": config.engram_vocab_size,
        "compressed_vocab_size": tokenizer.vocab_size,
        "repeats": args.repeats,
        "outputs_equal": True,
        "median_s": medians,
        "tokens_per_s": {name: tokens / s for name, s in medians.items()},
        "speedup_vs_reference": {name: ref_s / s for name, s in medians.items()},
        "headline": headline,
        "speedup": ref_s / medians[headline],
        "times_s": times,
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg(),
        "numpy": np.__version__,
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
    }
    for name, s in medians.items():
        print(f"{name:>20}: {tokens / s:>12,.0f} tokens/s  (median {s * 1e3:6.2f} ms, "
              f"{ref_s / s:5.2f}x reference)")
    print(f"outputs equal; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    if result["speedup"] < args.min_speedup:
        raise SystemExit(f"speedup {result['speedup']:.2f}x is below --min-speedup "
                         f"{args.min_speedup}")
    return result


if __name__ == "__main__":
    main()

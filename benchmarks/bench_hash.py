"""Hash speed: project NgramHashMapping vs a plain numpy transcription of the reference `hash()`.

Same inputs, same run, outputs asserted equal; tokens/s counts input tokens hashed for all
Engram layers. Writes the medians and their ratio as JSON (spec section 6, "Hash speed").

    python benchmarks/bench_hash.py [--out benchmarks/results/bench_hash.json]
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
from engram_train.engram.hashing import NgramHashMapping
from engram_train.engram.tokenizer import CompressedTokenizer

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


def median_seconds(fn, repeats):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "bench_hash.json"))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--tokenizer", default=str(GOLDEN_TOKENIZER))
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (numpy and the reference use one)")
    parser.add_argument("--min-speedup", type=float, default=0.0,
                        help="exit non-zero if project/reference is below this")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

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
    mapping = NgramHashMapping(config, tokenizer)
    rng = np.random.default_rng(0)
    ids_np = rng.integers(0, tokenizer.num_raw_ids, size=(args.batch, args.seq), dtype=np.int64)
    ids_t = torch.from_numpy(ids_np)

    def run_reference():
        return reference_hash(ids_np, tokenizer.lookup, mapping.pad_id, mapping.layer_ids,
                              mapping.multipliers, mapping.head_vocab_sizes, config.max_ngram_size)

    def run_project():
        return mapping.hash(ids_t)

    expected, got = run_reference(), run_project()
    for layer_id in mapping.layer_ids:
        np.testing.assert_array_equal(got[layer_id].numpy(), expected[layer_id])

    ref_s, ref_all = median_seconds(run_reference, args.repeats)
    proj_s, proj_all = median_seconds(run_project, args.repeats)
    tokens = args.batch * args.seq
    result = {
        "shape": [args.batch, args.seq],
        "engram_layer_ids": mapping.layer_ids,
        "max_ngram_size": config.max_ngram_size,
        "n_head_per_ngram": config.n_head_per_ngram,
        "engram_vocab_size": config.engram_vocab_size,
        "compressed_vocab_size": tokenizer.vocab_size,
        "repeats": args.repeats,
        "reference_median_s": ref_s,
        "project_median_s": proj_s,
        "reference_tokens_per_s": tokens / ref_s,
        "project_tokens_per_s": tokens / proj_s,
        "speedup": ref_s / proj_s,
        "reference_times_s": ref_all,
        "project_times_s": proj_all,
        "outputs_equal": True,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "numpy": np.__version__,
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
    }
    print(f"reference: {tokens / ref_s:,.0f} tokens/s (median {ref_s * 1e3:.2f} ms)")
    print(f"project:   {tokens / proj_s:,.0f} tokens/s (median {proj_s * 1e3:.2f} ms, "
          f"{torch.get_num_threads()} torch threads)")
    print(f"speedup:   {ref_s / proj_s:.2f}x (outputs equal)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    if ref_s / proj_s < args.min_speedup:
        raise SystemExit(f"speedup {ref_s / proj_s:.2f}x is below --min-speedup {args.min_speedup}")
    return result


if __name__ == "__main__":
    main()

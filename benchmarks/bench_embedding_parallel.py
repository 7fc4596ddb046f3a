"""Engram lookup: alltoall (eps = W, TP 1) vs allreduce (TP = W), W ranks, gloo on CPU.

Spec section 6, same global work per step: W micro-batches of [B, T] hash ids for every Engram
layer, tables sharded W ways in both methods (the same row blocks, so one table object serves
both). allreduce runs the W micro-batches one after another through the TP group (each rank
looks every id up against its shard, then all-reduces [B*T, K*D]); alltoall gives each rank its
own micro-batch (ids to owners, rows back; row gradients back to owners in backward). A step is
the lookup forward + backward of every layer (a fixed upstream gradient, the table gradient
accumulated as in training). The two methods alternate step by step so they share the
machine's load; a step's time is the slowest rank's; medians are reported.

Bytes per rank and step are reported three ways: the analytic formula (docs/embedding-parallel.md),
the payload this rank handed to collectives (counted in the lookup code; for all-reduce that is
the tensor, not what the algorithm sends), and the bytes measured on the loopback interface
(/proc/net/dev, every rank's traffic divided by W; other traffic on the machine adds to it).

    python benchmarks/bench_embedding_parallel.py [--steps 10] [--out PATH.json]

Launches its W processes itself (torch.multiprocessing).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bench_common import free_port, write_result

from engram_train.engram.tables import MultiHeadEmbedding
from engram_train.engram.ngram_hash import engram_head_vocab_sizes
from engram_train.parallel import lookup as lookup_module
from engram_train.parallel.lookup import AllReduceLookup, AllToAllLookup

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "outputs" / "benchmarks" / "bench_embedding_parallel.json"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=4, help="ranks W (eps = TP = W)")
    p.add_argument("--layers", type=int, default=2, help="Engram layers")
    p.add_argument("--max-ngram-size", type=int, default=3, help="N (orders 2..N)")
    p.add_argument("--heads", type=int, default=8, help="H hash heads per n-gram order")
    p.add_argument("--dim", type=int, default=64, help="D row width per head")
    p.add_argument("--vocab", type=int, default=50_000, help="table size per n-gram order head")
    p.add_argument("--batch", type=int, default=2, help="B sequences per micro-batch")
    p.add_argument("--seq", type=int, default=2048, help="T tokens per sequence")
    p.add_argument("--steps", type=int, default=10, help="timed steps per method")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per method")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p.parse_args(argv)


def loopback_tx_bytes() -> int | None:
    try:
        for line in Path("/proc/net/dev").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[8])
    except OSError:
        pass
    return None


def analytic_bytes(args) -> dict:
    """Per rank and step (docs/embedding-parallel.md): S = B*T*K*D*4 per layer and micro-batch."""
    w, k = args.world, (args.max_ngram_size - 1) * args.heads
    tokens = args.batch * args.seq
    s = tokens * k * args.dim * 4
    ring = 2 * (w - 1) / w * s
    return dict(
        S_bytes=s,
        allreduce=args.layers * w * ring,
        alltoall_rows=args.layers * 2 * (w - 1) / w * s,
        alltoall_ids=args.layers * (w - 1) / w * tokens * k * 8,
        alltoall_counts=args.layers * (w - 1) * 8,
        alltoall=args.layers * ((w - 1) / w * (2 * s + tokens * k * 8) + (w - 1) * 8),
    )


class PayloadCounter:
    """Stands in for ``torch.distributed`` inside the lookup module: forwards every call and
    counts the payload bytes this rank hands to the lookups' collectives, per method."""

    def __init__(self, real) -> None:
        self.real = real
        self.method = None
        self.counts = {}

    def __getattr__(self, name):
        return getattr(self.real, name)

    def _count(self, kind: str, nbytes: int) -> None:
        bucket = self.counts.setdefault(self.method, {"alltoall_sent": 0,
                                                      "allreduce_payload": 0, "calls": {}})
        bucket[kind] += int(nbytes)
        bucket["calls"][kind] = bucket["calls"].get(kind, 0) + 1

    def all_to_all_single(self, output, input, output_split_sizes=None,
                          input_split_sizes=None, group=None, async_op=False):
        size, me = group.size(), group.rank()
        splits = input_split_sizes or [input.shape[0] // size] * size
        row_bytes = input.element_size() * (input.numel() // max(1, input.shape[0]))
        self._count("alltoall_sent", (sum(splits) - splits[me]) * row_bytes)
        return self.real.all_to_all_single(output, input, output_split_sizes,
                                           input_split_sizes, group=group, async_op=async_op)

    def all_reduce(self, tensor, *args, **kwargs):
        self._count("allreduce_payload", tensor.numel() * tensor.element_size())
        return self.real.all_reduce(tensor, *args, **kwargs)

    def reset(self) -> None:
        self.counts.clear()


def worker(rank: int, args, port: int, out_queue) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    world = args.world
    group = dist.new_group(list(range(world)))
    counter = PayloadCounter(dist)
    lookup_module.dist = counter
    methods = {"alltoall": AllToAllLookup(group), "allreduce": AllReduceLookup(group)}
    layer_ids = list(range(args.layers))
    sizes = engram_head_vocab_sizes([args.vocab] * (args.max_ngram_size - 1),
                                    args.max_ngram_size, args.heads, layer_ids)
    tables = []
    for layer in layer_ids:
        heads = [p for order in sizes[layer] for p in order]
        # Both methods shard rows the same way (contiguous blocks by rank of W): one table.
        tables.append(MultiHeadEmbedding(heads, args.dim, layer_id=layer,
                                         parallel=methods["alltoall"]))
    assert all((t.row_start, t.row_end) == methods["allreduce"].row_range(t.num_rows)
               for t in tables)

    # W micro-batches of ids per layer (uniform over each head, as hashing gives), the same on
    # every rank; and a fixed upstream gradient per micro-batch.
    g = torch.Generator().manual_seed(0)
    k = len(tables[0].head_sizes)
    micro = []
    for _ in range(world):
        ids = [torch.stack([torch.randint(0, n, (args.batch, args.seq), generator=g)
                            for n in t.head_sizes], dim=-1) for t in tables]
        micro.append((ids, torch.randn(args.batch, args.seq, k * args.dim, generator=g)))

    def step(method: str) -> None:
        counter.method = method
        batches = [micro[rank]] if method == "alltoall" else micro
        for t in tables:
            t.parallel = methods[method]
            t.weight.grad = None
        for ids, upstream in batches:
            for t, layer_ids_ in zip(tables, ids):
                t(layer_ids_).backward(upstream)

    if args.steps < 1:
        raise ValueError("--steps must be >= 1")
    samples = {m: [] for m in methods}
    wire = {m: [] for m in methods}
    order = ["alltoall", "allreduce"]
    for i in range(args.warmup + args.steps):
        timed = i >= args.warmup
        if i == args.warmup:
            counter.reset()
        for method in order if i % 2 == 0 else order[::-1]:
            dist.barrier()
            before = loopback_tx_bytes() if rank == 0 else None
            start = time.perf_counter()
            step(method)
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.barrier()
            after = loopback_tx_bytes() if rank == 0 else None
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if timed:
                samples[method].append(elapsed.item())
                if before is not None and after is not None:
                    wire[method].append((after - before) / world)
    payload = {m: dict(alltoall_sent=c["alltoall_sent"] / args.steps,
                       allreduce_payload=c["allreduce_payload"] / args.steps,
                       calls={k: n // args.steps for k, n in c["calls"].items()})
               for m, c in counter.counts.items()}
    gathered = [None] * world
    dist.all_gather_object(gathered, payload)
    if rank == 0:
        out_queue.put(dict(samples=samples, wire=wire, payload=gathered))
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    started = time.perf_counter()
    mp.start_processes(worker, args=(args, free_port(), queue), nprocs=args.world,
                       join=True, start_method="spawn")
    raw = queue.get()
    wall = time.perf_counter() - started

    formula = analytic_bytes(args)
    median = {m: statistics.median(v) for m, v in raw["samples"].items()}
    wire = {m: statistics.median(v) if v else None for m, v in raw["wire"].items()}
    sent = {
        "alltoall": statistics.mean(p["alltoall"]["alltoall_sent"] for p in raw["payload"]),
        "allreduce": statistics.mean(p["allreduce"]["allreduce_payload"] for p in raw["payload"]),
    }
    expected = {"alltoall": formula["alltoall"], "allreduce": formula["allreduce"]}
    ratio = median["allreduce"] / median["alltoall"]
    k = (args.max_ngram_size - 1) * args.heads
    result = dict(
        benchmark="engram embedding parallel: alltoall (eps=W, TP1) vs allreduce (TP=W)",
        machine=dict(platform=platform.platform(), cpus=os.cpu_count(), backend="gloo",
                     torch=torch.__version__),
        config=dict(world=args.world, layers=args.layers, max_ngram_size=args.max_ngram_size,
                    heads_per_order=args.heads, heads_per_layer=k, dim=args.dim,
                    vocab_per_order=args.vocab, micro_batch=[args.batch, args.seq],
                    tokens_per_micro_batch=args.batch * args.seq,
                    micro_batches_per_step=args.world, steps=args.steps, warmup=args.warmup),
        step_seconds_median=median,
        step_seconds=raw["samples"],
        speedup_alltoall_over_allreduce=ratio,
        bytes_per_rank_per_step=dict(
            formula=expected,
            formula_terms=formula,
            loopback_measured=wire,
            loopback_over_formula={m: (wire[m] / expected[m]) if wire[m] else None for m in wire},
            collective_payload=sent,
            alltoall_payload_over_formula=sent["alltoall"] / expected["alltoall"],
        ),
        payload_per_rank=raw["payload"],
        wall_seconds=wall,
    )
    write_result(args.out, result)

    mb = 1e6
    print(f"W={args.world} ranks (gloo, CPU), {args.layers} layers x {k} heads x D={args.dim}, "
          f"{args.world} micro-batches of [{args.batch}, {args.seq}] per step")
    for m in ("alltoall", "allreduce"):
        w = f"{wire[m] / mb:9.2f} MB" if wire[m] else "      n/a"
        print(f"  {m:9s}  median step {median[m] * 1e3:8.1f} ms   bytes/rank/step: formula "
              f"{expected[m] / mb:9.2f} MB, loopback {w}, "
              f"collective payload {sent[m] / mb:9.2f} MB")
    print(f"  speedup alltoall over allreduce: {ratio:.2f}x (median step times)")
    return result


if __name__ == "__main__":
    main()

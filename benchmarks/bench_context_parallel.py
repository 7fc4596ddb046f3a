"""What Engram costs per layer when the sequence is split: the halo vs gathering the sequence.

Two comparisons, one Engram layer (forward + backward), 4 gloo processes on the CPU, a
sequence of ``--seq`` tokens (default 4096):

- context parallelism, CP 2 and 4 (megatron's zigzag chunks): **halo** (this project: each
  rank runs the branch on its own chunks, the conv's left context comes from the ranks that
  hold the positions before, ``parallel/context.py``) vs **gather** (all-gather the hidden
  states over CP, run the branch on the whole sequence on every rank, keep this rank's
  positions; the backward reduce-scatters);
- sequence parallelism at TP 1, 2, 4: **after** (each TP rank runs the branch on its own slice
  and looks up only its tokens' rows, halo for the conv) vs **before** (the previous
  ``EngramTransformerLayer``: gather the sequence over TP, every TP rank runs the whole branch
  and looks up every token, keeps its slice).

Bytes are received per rank and layer, forward + backward (a ring's share for the
collectives; for the halo, the rows from other ranks and then their gradients' counterpart, the
gradients of the rows this rank sent). Lookup bytes are the table rows a rank
obtains (distinct rows x D x 4), wherever they come from. Times are medians over ``--reps``
of the slowest rank. The table is local (no embedding parallelism) so that only the split
itself is compared.

    python benchmarks/bench_context_parallel.py [--seq 4096] [--reps 10] [--out PATH.json]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).parent))

from bench_common import free_port, write_result  # noqa: E402

DEFAULT_OUT = REPO / "outputs" / "benchmarks" / "bench_context_parallel.json"
WORLD = 4


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--n-embed", type=int, default=256, help="n_embed_per_ngram")
    p.add_argument("--heads", type=int, default=8, help="n_head_per_ngram")
    p.add_argument("--vocab", type=int, default=50000, help="rows per n-gram order")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p.parse_args(argv)


def engram_config(args):
    from engram_train.config import EngramConfig

    return EngramConfig(
        use_engram=True, engram_tokenizer_name_or_path="unused", engram_layer_ids=[0],
        engram_vocab_size=[args.vocab, args.vocab], max_ngram_size=3,
        n_embed_per_ngram=args.n_embed, n_head_per_ngram=args.heads)


def subgroups(size: int):
    """This rank's group of ``size`` consecutive ranks (every rank creates every group)."""
    mine = None
    for start in range(0, WORLD, size):
        group = dist.new_group(list(range(start, start + size)))
        if start <= dist.get_rank() < start + size:
            mine = group
    return mine


def timed(fns: dict, args) -> dict:
    """Median seconds of each ``fn()`` over the reps, the slowest rank's; the functions
    alternate within every rep (machine drift hits them alike)."""
    samples = {name: [] for name in fns}
    for i in range(args.warmup + args.reps):
        order = list(fns) if i % 2 == 0 else list(fns)[::-1]
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            fns[name]()
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i >= args.warmup:
                samples[name].append(elapsed.item())
    return {name: statistics.median(v) for name, v in samples.items()}


def run_case(engram, args, group, cp: int, tp: int, inputs) -> dict:
    """One layout: the split (halo) way and the gather way, times and bytes of this rank."""
    from megatron.core.tensor_parallel.mappings import (
        gather_from_sequence_parallel_region,
        scatter_to_sequence_parallel_region,
    )

    from engram_train.parallel.context import SequenceHalo, held_positions

    hidden, ids, weight = inputs
    size = group.size()
    rank = group.rank()
    cp_rank, tp_rank = (rank, 0) if tp == 1 else (0, rank)
    pos = held_positions(args.seq, cp, cp_rank, tp, tp_rank)
    width = (engram.short_conv.conv.kernel_size[0] - 1) * engram.max_ngram_size
    coords = [(g, 0) for g in range(size)] if tp == 1 else [(0, g) for g in range(size)]
    halo = SequenceHalo(group, coords, cp, tp, width) if size > 1 else None
    local_h, local_ids, local_w = hidden[pos].contiguous(), ids[pos], weight[pos]
    row_bytes = engram.head_dim * 4

    def split():
        x = local_h.clone().requires_grad_()
        (engram(x, hash_ids=local_ids, halo=halo) * local_w).sum().backward()

    order = torch.argsort(torch.cat([held_positions(args.seq, cp, g, 1, 0) for g in range(cp)]))

    def gather():
        x = local_h.clone().requires_grad_()
        if size == 1:
            y = engram(x, hash_ids=ids)
        elif tp > 1:  # the previous SP path: identical full branch on every TP rank
            full = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False,
                                                        group=group)
            y = scatter_to_sequence_parallel_region(engram(full, hash_ids=ids), group=group)
        else:  # CP: gather the chunks, put them in sequence order, keep this rank's positions
            full = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True,
                                                        group=group)[order]
            y = engram(full, hash_ids=ids)[pos]
        (y * local_w).sum().backward()

    tokens_bytes = local_h.numel() * 4  # this rank's slice of the hidden states
    plan = halo.plan(pos.numel()) if halo is not None else None
    halo_rows = 0
    if plan is not None:  # received: rows from other ranks (forward), then the gradients of
        # the rows it sent (backward)
        halo_rows = (sum(plan.recv_splits) - plan.recv_splits[rank]
                     + sum(plan.send_splits) - plan.send_splits[rank])
    halo_bytes = halo_rows * args.batch * args.hidden * 4
    # gather: all-gather forward, reduce-scatter (CP) or all-gather (SP) backward: a ring moves
    # (size - 1) slices each way
    gather_bytes = 2 * (size - 1) * tokens_bytes
    seconds = timed(dict(split=split, gather=gather), args)
    rows = ids + engram.multi_head_embedding.offsets  # global table rows
    return dict(
        split_seconds=seconds["split"], gather_seconds=seconds["gather"],
        split_bytes=halo_bytes, gather_bytes=gather_bytes,
        split_lookup_bytes=torch.unique(rows[pos]).numel() * row_bytes,
        gather_lookup_bytes=torch.unique(rows).numel() * row_bytes,
        split_ids=local_ids.numel(), gather_ids=ids.numel(),
        halo_edges=plan.edges if plan is not None else 0)


def worker(rank: int, args, port: int, queue) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from engram_train.engram.engram_module import Engram
    from engram_train.runtime import install_cpu_compat

    install_cpu_compat()  # megatron's gather/scatter mappings allocate on the current device

    config = engram_config(args)
    torch.manual_seed(0)
    engram = Engram(config, args.hidden, 0, zero_init_conv=False, dtype=torch.float32)
    k = engram.num_heads
    g = torch.Generator().manual_seed(1)  # hashed ids are uniform over each head's rows
    sizes = engram.multi_head_embedding.head_sizes
    ids = torch.stack([torch.randint(0, n, (args.seq, args.batch), generator=g)
                       for n in sizes[:k]], dim=-1)
    hidden = torch.randn(args.seq, args.batch, args.hidden, generator=g)
    weight = torch.randn(args.seq, args.batch, args.hidden, generator=g)
    groups = {size: subgroups(size) for size in (1, 2, 4)}
    results = {}
    for cp in (2, 4):
        results[f"cp{cp}"] = run_case(engram, args, groups[cp], cp, 1, (hidden, ids, weight))
    for tp in (1, 2, 4):
        results[f"sp_tp{tp}"] = run_case(engram, args, groups[tp], 1, tp, (hidden, ids, weight))
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, results)
    if rank == 0:
        queue.put(gathered)
    dist.barrier()
    dist.destroy_process_group()


def summarize(per_rank: list[dict]) -> dict:
    """Times are already the slowest rank's; bytes: the largest rank's."""
    out = {}
    for case in per_rank[0]:
        rows = [r[case] for r in per_rank]
        out[case] = {key: (rows[0][key] if key.endswith("seconds") else max(r[key] for r in rows))
                     for key in rows[0]}
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"
    queue = mp.get_context("spawn").SimpleQueue()
    started = time.perf_counter()
    mp.start_processes(worker, args=(args, free_port(), queue), nprocs=WORLD, join=True,
                       start_method="spawn")
    cases = summarize(queue.get())
    result = dict(
        benchmark="Engram per layer under a split sequence: halo vs gather (CP), "
                  "slice + halo vs gather (SP)",
        machine=dict(platform=platform.platform(), cpus=os.cpu_count(), backend="gloo",
                     torch=torch.__version__, processes=WORLD),
        config=dict(seq=args.seq, batch=args.batch, hidden=args.hidden, max_ngram_size=3,
                    kernel_size=4, n_embed_per_ngram=args.n_embed, heads_per_order=args.heads,
                    rows_per_order=args.vocab, reps=args.reps, warmup=args.warmup,
                    pass_="forward + backward, one Engram layer"),
        cases=cases, wall_seconds=time.perf_counter() - started)
    write_result(args.out, result)
    mb = 1e6
    print(f"one Engram layer, seq {args.seq} x batch {args.batch}, hidden {args.hidden}, "
          f"4 gloo processes (CPU), forward + backward; per rank")
    print(f"{'case':8s} {'halo ms':>9s} {'gather ms':>10s} {'time x':>7s} {'halo MB':>9s} "
          f"{'gather MB':>10s} {'bytes x':>8s} {'rows MB':>8s} {'gather rows MB':>15s}")
    for case, c in cases.items():
        label = case if case.startswith("cp") else case.replace("sp_", "SP ")
        ratio_b = c["gather_bytes"] / c["split_bytes"] if c["split_bytes"] else float("nan")
        print(f"{label:8s} {c['split_seconds'] * 1e3:9.1f} {c['gather_seconds'] * 1e3:10.1f} "
              f"{c['gather_seconds'] / c['split_seconds']:7.2f} {c['split_bytes'] / mb:9.3f} "
              f"{c['gather_bytes'] / mb:10.3f} {ratio_b:8.1f} "
              f"{c['split_lookup_bytes'] / mb:8.3f} {c['gather_lookup_bytes'] / mb:15.3f}")
    return result


if __name__ == "__main__":
    main()

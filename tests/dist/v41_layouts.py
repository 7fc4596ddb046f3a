"""The DeepSeek-V4.1 Engram variant (``engram_variant: deepseek_v41``) on the mHC backbone
(4 streams) in the table layouts and options, 2 processes, one launch.

The tiny DeepSeek-V3 model with mHC and V4.1 Engram branches on layers 1 and 3, EOS-delimited
documents (``engram_reset_at_eos``), is saved once and each run loads it and trains 3 steps on
the same step-specific global batches (hash ids from the variant's ``hash_block``, as the data
path gives them): losses, grad norms and the reassembled tables are recorded. Runs: eps 1 (the
tables replicated on both ranks, the reference) and eps 2 with ``sparse_adam`` on the device;
eps 2 with the tables on the host for ``sparse_adam``, ``rowwise_adam`` and the 4-byte options,
each beside the same run on the device; eps 2 without next-layer prefetch; TP2 with sequence
parallelism and the tables vocab-parallel over TP (``allreduce``). Evidence that the
host path ran (host-resident tables, rows staged through the host) is recorded per run."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch
from common import SEQ, VOCAB, parse_args, repeated_batches, write_result
from embedding_parallel_training import reassemble
from engram_integration import build_engram_training, engram_config, shared_tmpdir, table_optimizer

from engram_train.runtime import ParallelSizes, initialize_distributed

from megatron.core import parallel_state

from engram_train.checkpoint import save_checkpoint
from engram_train.engram.host_table import HOST_TABLE_TIMES, is_host_resident
from engram_train.engram.variant import build_hash_mapping
from engram_train.models.builder import build_model
from engram_train.training.step import train_step

LAYER_IDS = [1, 3]
GLOBAL_BATCH = 4
STEPS = 3
EOS = 5  # a frequent id of the random batches: several documents per row
V41 = dict(engram_variant="deepseek_v41", engram_vocab_size=[257, 257], enable_hyper_connections=True,
           engram_reset_at_eos=True, engram_eos_id=EOS)
FOUR_BYTE = dict(engram_table_dtype="bf16", engram_optimizer="rowwise_adam",
                 engram_master_weights=False, engram_optimizer_state_dtype="bf16")
EPS1, EPS2 = ParallelSizes(), ParallelSizes(engram_embedding=2)
RUNS = [  # name, layout, overrides
    ("eps1", EPS1, {}),
    ("eps2", EPS2, {}),
    ("eps2_host", EPS2, dict(engram_table_placement="host")),
    ("eps2_rowwise", EPS2, dict(engram_optimizer="rowwise_adam")),
    ("eps2_rowwise_host", EPS2, dict(engram_optimizer="rowwise_adam", engram_table_placement="host")),
    ("eps2_4byte", EPS2, FOUR_BYTE),
    ("eps2_4byte_host", EPS2, dict(FOUR_BYTE, engram_table_placement="host")),
    ("eps2_no_prefetch", EPS2, dict(engram_prefetch=False)),
    ("tp2_allreduce", ParallelSizes(tensor=2), dict(sp=True, method="allreduce")),
]


MAPPING = []


def batches_of_step(config, step: int):
    """This data-parallel rank's micro-batches (1 sequence each) of a step-specific batch,
    with the hash-id block of the config's variant."""
    if not MAPPING:  # every run hashes alike (one variant, one tokenizer)
        MAPPING.append(build_hash_mapping(config))
    mapping = MAPPING[0]
    batches = repeated_batches(GLOBAL_BATCH, 1, seed=900 + step)
    for batch in batches:
        batch["tokens"][:, ::7] = EOS  # documents end inside the rows
        batch["engram_hash_ids"] = mapping.hash_block(batch["tokens"])
    share = len(batches) // parallel_state.get_data_parallel_world_size()
    rank = parallel_state.get_data_parallel_rank()
    return batches[rank * share : (rank + 1) * share]


def run(root, sizes, overrides):
    config, model, optimizer = build_engram_training(sizes, LAYER_IDS, seed=3, load=root,
                                                     **{**V41, **overrides})
    tables = list(table_optimizer(optimizer).model_params)
    HOST_TABLE_TIMES.reset()
    losses, norms = [], []
    for step in range(STEPS):
        result = train_step(model, optimizer, batches_of_step(config, step), SEQ, 1)
        losses.append(result.lm_loss)
        norms.append(result.grad_norm)
    table_optimizer(optimizer).finish_update()
    branches = sorted({type(m).__name__ for chunk in model for m in chunk.modules()
                       if hasattr(m, "wkv")})
    return dict(losses=losses, grad_norms=norms, branches=branches,
                host_resident=[is_host_resident(p) for p in tables],
                host_rows=HOST_TABLE_TIMES.rows), reassemble(model, lambda p: p.float())


def main():
    args = parse_args()
    parallel_state.destroy_model_parallel()
    initialize_distributed(ParallelSizes(), seed=1)
    root = Path(shared_tmpdir())
    save_checkpoint(root, 0, build_model(engram_config(ParallelSizes(), LAYER_IDS, **V41), VOCAB, SEQ))
    result, tables = {}, {}
    for name, sizes, overrides in RUNS:
        result[name], tables[name] = run(root, sizes, overrides)
    for a, b in [("eps1", "eps2"), ("eps2", "eps2_host"), ("eps2_rowwise", "eps2_rowwise_host"),
                 ("eps2_4byte", "eps2_4byte_host"), ("eps2", "eps2_no_prefetch"),
                 ("eps1", "tp2_allreduce")]:
        result[f"{a}~{b}"] = max(float((tables[a][k] - tables[b][k]).abs().max())
                                 for k in tables[a])
    write_result(args.out, result)


if __name__ == "__main__":
    main()

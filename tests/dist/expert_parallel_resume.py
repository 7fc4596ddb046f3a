"""Resume across expert-parallel sizes, one launch of 4 processes (data parallel 4).

megatron's optimizer chain has an expert optimizer only with EP > 1; checkpoints key the chain's
state by role (the ``chained_optimizer_by_role`` patch), so they load under any EP:

- for the distributed optimizer on and off, an Engram MoE model (4 routed experts) trains
  `SAVED_AT` steps at EP 1, 2 and 4, saves, and records the losses of `RESUMED` more steps;
  each checkpoint is loaded into a fresh model and optimizer at another EP and takes the same
  steps: the losses must be those of the uninterrupted run at the saving EP;
- a checkpoint keyed by position (saved with the patch reverted, as checkpoints were before it)
  still loads at its own EP with the same losses, and is refused at another EP with a message
  that says what to do.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from common import forget_graphs
from common import SEQ, VOCAB, parse_args, repeated_batches, write_result
from engram_integration import SMALL, engram_config

GLOBAL_BATCH = 4
SAVED_AT = 2
RESUMED = 2
# (saved at EP, loaded at EP), the same for both optimizer kinds: without the distributed
# optimizer, building the expert role from an EP 1 checkpoint takes the dense role's step count.
PAIRS = [(1, 2), (2, 1), (1, 4), (4, 1), (2, 4), (4, 2)]


def build(ep: int, distributed: bool):
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from engram_train.models.builder import build_model
    from engram_train.runtime import ParallelSizes, initialize_distributed
    from engram_train.training.optimizer import build_optimizer

    parallel_state.destroy_model_parallel()
    layout = ParallelSizes(expert=ep)
    forget_graphs()  # the previous layout's model can be freed
    initialize_distributed(layout, seed=11)
    config = engram_config(layout, [1], expert_model_parallel_size=ep, **SMALL)
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                        use_distributed_optimizer=distributed)
    model = build_model(config, VOCAB, SEQ, ddp)
    opt = OptimizerConfig(optimizer="adam", lr=3e-4, clip_grad=1.0, weight_decay=0.01,
                          use_distributed_optimizer=distributed)
    return model, build_optimizer(opt, model, config)


def steps(model, optimizer, n: int) -> list[float]:
    from megatron.core import parallel_state

    from engram_train.training.step import train_step

    batches = repeated_batches(GLOBAL_BATCH, 1, seed=3)
    dp, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    share = GLOBAL_BATCH // dp
    mine = batches[rank * share: (rank + 1) * share]
    return [train_step(model, optimizer, mine, SEQ, 1).lm_loss for _ in range(n)]


def roles(optimizer) -> list[str]:
    from engram_train.runtime.optimizer_chain import chain_roles

    return chain_roles(optimizer.chained_optimizers)


def across_ep(root: Path, kind: str) -> dict:
    from engram_train.checkpoint import load_checkpoint, save_checkpoint

    distributed = kind == "distributed"
    saved = {}
    for ep in (1, 2, 4):
        model, optimizer = build(ep, distributed)
        steps(model, optimizer, SAVED_AT)
        save_checkpoint(root / f"{kind}_ep{ep}", SAVED_AT, model, optimizer)
        saved[ep] = dict(roles=roles(optimizer), next_losses=steps(model, optimizer, RESUMED))
    resumed = {}
    for saved_ep, loaded_ep in PAIRS:
        model, optimizer = build(loaded_ep, distributed)
        iteration, _ = load_checkpoint(root / f"{kind}_ep{saved_ep}", model, optimizer)
        resumed[f"{saved_ep}->{loaded_ep}"] = dict(
            iteration=iteration, next_losses=steps(model, optimizer, RESUMED))
    return dict(saved=saved, resumed=resumed)


def by_position(root: Path) -> dict:
    """A checkpoint keyed by position: saved with the patch reverted, then loaded with it."""
    from megatron.core import dist_checkpointing

    from engram_train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
    from engram_train.runtime.patches import apply_patches, revert_patches

    model, optimizer = build(2, True)
    steps(model, optimizer, SAVED_AT)
    revert_patches(["chained_optimizer_by_role"])
    try:
        save_checkpoint(root / "positional", SAVED_AT, model, optimizer)
    finally:
        apply_patches(["chained_optimizer_by_role"])
    next_losses = steps(model, optimizer, RESUMED)
    ckpt = root / "positional" / f"iter_{SAVED_AT:07d}"
    prefixed = sorted({k.split(".", 1)[0] for k in dist_checkpointing.load_tensors_metadata(str(ckpt))
                       if k.startswith("chained_")})
    role_keyed = root / "distributed_ep2" / f"iter_{SAVED_AT:07d}"
    role_prefixed = [k for k in dist_checkpointing.load_tensors_metadata(str(role_keyed))
                     if k.startswith("chained_")]
    model, optimizer = build(2, True)
    load_checkpoint(root / "positional", model, optimizer)
    same_ep = steps(model, optimizer, RESUMED)
    model, optimizer = build(1, True)
    try:
        load_checkpoint(root / "positional", model, optimizer)
        refusal = None
    except CheckpointError as e:
        refusal = str(e)
    return dict(prefixes=prefixed, role_keyed_prefixed=role_prefixed, next_losses=next_losses,
                same_ep_losses=same_ep, other_ep_refusal=refusal)


def main():
    args = parse_args()
    root = Path(args.out) / "checkpoints"  # the same folder on every rank
    result = {kind: across_ep(root, kind) for kind in ("distributed", "plain")}
    result["positional"] = by_position(root)
    write_result(args.out, result)


if __name__ == "__main__":
    main()

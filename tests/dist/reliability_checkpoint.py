"""Checkpoint faults and Engram add/remove on 2 processes, one launch.

Layouts: A = data parallel 2 (TP1), B = tensor parallel 2 (DP1, sequence parallel); megatron's
distributed optimizer with fully reshardable checkpoints, as the trainer uses.

- add Engram: a model without Engram trains 2 steps under A and saves; under B an Engram model
  loads it with ``load_engram=False``. Truth: the same checkpoint loaded normally into a model
  without Engram under B (backbone weights and megatron optimizer state, key by key), and an
  Engram model built with the same seed and not loaded (Engram weights); Engram's optimizer
  state must be fresh (zero moments, master = weight, table optimizer at step 0).
- remove Engram: the Engram model trains a step under B and saves; under A a model without
  Engram loads it with ``load_engram=False``. Truth: the checkpoint loaded normally into an
  Engram model under A.
- non-finite step: a NaN injected into the forward of one step; `SkipNonFiniteUpdate` must
  skip it with parameters and optimizer state bit-identical, and the next step must train.
- saving refuses NaN parameters on one rank (nothing written, both ranks raise) and removes
  ``iter_*.tmp`` left by an earlier failed save.
- a checkpoint whose parameter bytes were overwritten (same size): the checksum check names the
  file; loading it without checksums is refused because the parameter loads as NaN.
- the per-iteration stop all-reduce carries the loss from the rank that has it to every rank.
"""

import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch
import torch.distributed as dist
from common import forget_graphs
from common import SEQ, VOCAB, parse_args, repeated_batches, tiny_config, write_result
from engram_integration import engram_config

from engram_train.runtime import ParallelSizes, initialize_distributed
from engram_train.runtime.distributed import set_seed

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig
from megatron.core.utils import unwrap_model

from engram_train import checkpoint as ckpt
from engram_train.config import EngramMLATransformerConfig
from engram_train.models.builder import build_model
from engram_train.training.faults import SkipNonFiniteUpdate
from engram_train.training.optimizer import build_optimizer
from engram_train.training.step import train_step

A = ParallelSizes()
B = ParallelSizes(tensor=2)
GLOBAL_BATCH = 4


_current_layout = [None]


def setup(layout: ParallelSizes, use_engram: bool, seed: int):
    """Build a model and optimizer under ``layout``. Models of one layout live side by side (the
    add/remove checks compare them), so the layout is initialized only when it changes: a new
    layout releases the previous one's process groups, which its optimizers hold."""
    if _current_layout[0] != layout:
        forget_graphs()  # the previous layout's model can be freed
        initialize_distributed(layout, seed=seed)
        _current_layout[0] = layout
    else:
        set_seed(seed)
    sp = layout.tensor > 1
    if use_engram:
        config = engram_config(layout, [3, 1], sp=sp)  # unsorted on purpose: kept sorted
    else:
        config = tiny_config(tp=layout.tensor, pp=layout.pipeline, sp=sp,
                             config_class=EngramMLATransformerConfig, use_engram=False)
        config.finalize_model_grads_func = finalize_model_grads
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    model = build_model(config, VOCAB, SEQ, ddp)
    opt_config = OptimizerConfig(optimizer="adam", lr=3e-3, clip_grad=1.0, weight_decay=0.1,
                                 use_distributed_optimizer=True)
    return model, build_optimizer(opt_config, model, config)


def batches(seed=3):
    all_batches = repeated_batches(GLOBAL_BATCH, 1, seed=seed)
    dp = parallel_state.get_data_parallel_world_size()
    share = GLOBAL_BATCH // dp
    rank = parallel_state.get_data_parallel_rank()
    return all_batches[rank * share:(rank + 1) * share]


def step(model, optimizer, seed=3):
    return train_step(model, optimizer, batches(seed), SEQ, 1)


def params(model) -> dict:
    return {name: p.detach().clone() for chunk in unwrap_model(model) for name, p in chunk.named_parameters()}


def optimizer_states(model, optimizer) -> dict:
    """{key: tensor} of megatron's optimizers' state in model space (fully reshardable), keys
    without the chain prefix, gathered on every rank; plus the table optimizer's steps."""
    parts, tables = ckpt.optimizer_parts(optimizer)
    out = {}
    for part in parts:
        sd = part.sharded_state_dict(ckpt.model_sharded_state_dict(model), is_loading=False,
                                     metadata=ckpt.OPTIMIZER_METADATA)
        for sh in nested_values(sd):
            if isinstance(sh, ShardedTensor):
                out[sh.key] = sh.data.detach().clone()
    for table in tables:
        out["table_num_steps"] = table.num_steps
        for main in table.main_params:
            state = table.optimizer.state.get(main, {})
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    out.setdefault("table_moment_abs_sum", 0.0)
                    out["table_moment_abs_sum"] += state[key].abs().sum().item()
    return out


def differences(a: dict, b: dict, keys) -> list[str]:
    return sorted(k for k in keys if not torch.equal(a[k], b[k]))


def is_engram(key: str) -> bool:
    return ".engram." in key


def shared_root() -> Path:
    holder = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    return Path(holder[0])


def add_engram(result, root: Path):
    model, optimizer = setup(A, use_engram=False, seed=1)
    for _ in range(2):
        step(model, optimizer)
    ckpt.save_checkpoint(root / "plain", 2, model, optimizer)

    ref_model, ref_opt = setup(B, use_engram=False, seed=2)
    ckpt.load_checkpoint(root / "plain", ref_model, ref_opt)
    fresh_model, _ = setup(B, use_engram=True, seed=3)
    model, optimizer = setup(B, use_engram=True, seed=3)
    iteration, _ = ckpt.load_checkpoint(root / "plain", model, optimizer, load_engram=False)

    ref_p, fresh_p, got_p = params(ref_model), params(fresh_model), params(model)
    ref_s, got_s = optimizer_states(ref_model, ref_opt), optimizer_states(model, optimizer)
    engram_keys = sorted(k for k in got_s if is_engram(k))
    result["add"] = dict(
        iteration=iteration,
        backbone_params=len(ref_p),
        backbone_param_diffs=differences(ref_p, got_p, ref_p),
        extra_params_are_engram=all(is_engram("." + k) for k in set(got_p) - set(ref_p)),
        engram_params=len(set(got_p) - set(ref_p)),
        engram_param_diffs=differences(fresh_p, got_p, set(got_p) - set(ref_p)),
        backbone_state_keys=len(ref_s),
        backbone_state_missing=sorted(set(ref_s) - set(got_s)),
        backbone_state_diffs=differences(ref_s, got_s, ref_s),
        engram_state_keys=len(engram_keys),
        engram_moments_zero=all(got_s[k].abs().sum().item() == 0 for k in engram_keys if ".exp_avg" in k),
        engram_masters_are_weights=all(
            torch.equal(got_s[k], got_p[k.split("optimizer.state.param.", 1)[1]].float())
            for k in engram_keys if "optimizer.state.param." in k),
        table_num_steps=got_s.get("table_num_steps"),
        table_moment_abs_sum=got_s.get("table_moment_abs_sum", 0.0),
    )
    losses = [step(model, optimizer).lm_loss for _ in range(2)]
    result["add"]["losses_after"] = losses
    return model, optimizer


def remove_engram(result, root: Path, model, optimizer):
    ckpt.save_checkpoint(root / "engram", 4, model, optimizer)
    ref_model, ref_opt = setup(A, use_engram=True, seed=4)
    ckpt.load_checkpoint(root / "engram", ref_model, ref_opt)
    plain_model, plain_opt = setup(A, use_engram=False, seed=5)
    iteration, _ = ckpt.load_checkpoint(root / "engram", plain_model, plain_opt, load_engram=False)
    ref_p, got_p = params(ref_model), params(plain_model)
    ref_s, got_s = optimizer_states(ref_model, ref_opt), optimizer_states(plain_model, plain_opt)
    ref_s = {k.split(".", 1)[1] if k.startswith("chained_") else k: v for k, v in ref_s.items()}
    backbone_keys = [k for k in ref_s if not is_engram(k) and not k.startswith("table_")]
    result["remove"] = dict(
        iteration=iteration,
        params=len(got_p),
        missing_params=sorted(k for k in ref_p if not is_engram("." + k) and k not in got_p),
        param_diffs=differences(ref_p, got_p, got_p),
        state_keys=len(got_s),
        state_key_mismatch=sorted(set(backbone_keys) ^ set(got_s)),
        state_diffs=differences(ref_s, got_s, got_s),
        loss_after=step(plain_model, plain_opt).lm_loss,
    )


def nonfinite_step(result):
    model, optimizer = setup(A, use_engram=True, seed=6)
    step(model, optimizer)
    before_p, before_s = params(model), optimizer_states(model, optimizer)
    guarded = SkipNonFiniteUpdate(optimizer)
    norm = unwrap_model(model)[0].decoder.final_layernorm
    hook = norm.register_forward_hook(lambda mod, inp, out: out * float("nan"))
    bad = train_step(model, guarded, batches(), SEQ, 1)
    flagged = guarded.skipped_nonfinite
    hook.remove()
    after_p, after_s = params(model), optimizer_states(model, optimizer)
    good = train_step(model, guarded, batches(), SEQ, 1)
    result["nonfinite"] = dict(
        bad_skipped=bad.skipped, bad_flagged=flagged,
        bad_grad_norm=str(bad.grad_norm), bad_loss=str(bad.lm_loss),
        param_diffs=differences(before_p, after_p, before_p),
        state_diffs=differences(before_s, after_s, [k for k in before_s if not k.startswith("table_")]),
        table_num_steps=(before_s.get("table_num_steps"), after_s.get("table_num_steps")),
        good_skipped=good.skipped, good_loss=good.lm_loss, good_grad_norm=good.grad_norm,
    )
    return model, optimizer


def refuse_nonfinite_save(result, root: Path, model, optimizer):
    save = root / "refuse"
    stale = save / "iter_0000099.tmp"
    if dist.get_rank() == 0:
        stale.mkdir(parents=True)
        (stale / "junk").write_bytes(b"x" * 1000)
    dist.barrier()
    param = next(p for name, p in unwrap_model(model)[0].named_parameters() if "final_layernorm" in name)
    kept = param.detach().clone()
    if dist.get_rank() == 1:
        param.data[0] = float("nan")
    try:
        ckpt.save_checkpoint(save, 7, model, optimizer)
        refused = None
    except ckpt.NonFiniteStateError as e:
        refused = str(e)
    listing_after_refusal = sorted(p.name for p in save.iterdir())
    param.data.copy_(kept)
    ckpt.save_checkpoint(save, 7, model, optimizer)
    result["refuse"] = dict(
        message=refused,
        listing_after_refusal=listing_after_refusal,
        listing_after_save=sorted(p.name for p in save.iterdir()),
        problems=ckpt.check_checkpoint(save / "iter_0000007"),
    )


def damaged_parameter(result, root: Path):
    """Overwrite bytes in the middle of the largest model weight's record with 0xFF (NaN)."""
    from torch.distributed.checkpoint import FileSystemReader

    src = root / "plain" / "iter_0000002"
    damaged = root / "damaged" / "iter_0000002"
    if dist.get_rank() == 0:
        shutil.copytree(src, damaged)
        (damaged.parent / ckpt.TRACKER).write_text("2")
        meta = FileSystemReader(str(damaged)).read_metadata()
        entries = [(info.length, index.fqn, info) for index, info in meta.storage_data.items()
                   if not index.fqn.startswith("optimizer") and "weight" in index.fqn]
        length, fqn, info = max(entries, key=lambda e: e[0])
        with open(damaged / info.relative_path, "r+b") as f:
            f.seek(info.offset + length // 2)
            f.write(b"\xff" * 1024)
        where = [str(damaged / info.relative_path), fqn]
    else:
        where = [None, None]
    dist.broadcast_object_list(where, src=0)
    problems = ckpt.check_checkpoint(damaged)
    model, optimizer = setup(A, use_engram=False, seed=8)
    try:
        ckpt.load_checkpoint(damaged.parent, model, optimizer)
        checked = None
    except ckpt.DamagedCheckpointError as e:
        checked = str(e)
    try:
        ckpt.load_checkpoint(damaged.parent, model, optimizer, checksums=False)
        unchecked = None
    except ckpt.DamagedCheckpointError as e:
        unchecked = str(e)
    result["damaged"] = dict(file=where[0], tensor=where[1], problems=problems,
                             checked_error=checked, unchecked_error=unchecked)


def stop_check_shares_the_loss(result):
    """Only one rank holds the loss (as only the last pipeline stage does): StopCheck's
    all-reduce gives it to every rank, a NaN included, with the non-finite flag."""
    from engram_train.training.faults import StopCheck

    last = dist.get_rank() == 1
    check = StopCheck(None, None)
    finite = check(nonfinite=False, loss=2.5 if last else None)
    nan = check(nonfinite=last, loss=float("nan") if last else None)
    result["stop_loss"] = dict(finite=repr(finite.loss), nan=repr(nan.loss), nan_flag=nan.nonfinite,
                               finite_flag=finite.nonfinite)


def main():
    args = parse_args()
    result = {}
    forget_graphs()  # the previous layout's model can be freed
    initialize_distributed(A, seed=1)
    _current_layout[0] = A
    root = shared_root()
    model, optimizer = add_engram(result, root)
    remove_engram(result, root, model, optimizer)
    model, optimizer = nonfinite_step(result)
    refuse_nonfinite_save(result, root, model, optimizer)
    damaged_parameter(result, root)
    stop_check_shares_the_loss(result)
    write_result(args.out, result)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

"""A checkpoint save never changes the state that training continues with: 2 processes, one
launch, every Engram table optimizer, table dtype (fp8 trained and frozen too), placement and
megatron's distributed optimizer.

For each case two models are built from the same seed. One trains 2 steps, saves (model and
optimizer, as the trainer does), trains 2 more; the other trains 4 steps without a save. Truth:
every tensor of the optimizers' live state (megatron's and the table optimizer's, moments,
masters, row moments) and every parameter bit-identical just before and just after the save,
and the 4 losses of the two runs equal bit for bit. A new batch each step, so rows that one
step touches the next may not."""

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch
from common import forget_graphs
from common import SEQ, VOCAB, parse_args, write_result
from engram_integration import dp_share_of_step, engram_config, shared_tmpdir, table_optimizer

from engram_train.runtime import ParallelSizes, initialize_distributed

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig

from engram_train.checkpoint import save_checkpoint
from engram_train.models.builder import build_model
from engram_train.training.optimizer import build_optimizer
from engram_train.training.step import train_step

LAYER_IDS = [1, 3]
GLOBAL_BATCH = 4
STEPS, SAVE_AFTER = 4, 2
FOUR_BYTE = dict(engram_table_dtype="bf16", engram_optimizer="rowwise_adam",
                 engram_master_weights=False, engram_optimizer_state_dtype="bf16")
CASES = [  # name, layout, distributed optimizer, Engram overrides
    ("sparse_adam_fp32_device_distopt", ParallelSizes(), True, dict(engram_optimizer="sparse_adam")),
    ("adam_fp32_device", ParallelSizes(), False, dict(engram_optimizer="adam")),
    ("rowwise_adam_fp32_device_eps2_distopt", ParallelSizes(engram_embedding=2), True,
     dict(engram_optimizer="rowwise_adam")),
    ("rowwise_adam_fp32_host", ParallelSizes(), False,
     dict(engram_optimizer="rowwise_adam", engram_table_placement="host")),
    ("four_byte_host_eps2_distopt", ParallelSizes(engram_embedding=2), True,
     dict(FOUR_BYTE, engram_table_placement="host")),
    ("four_byte_device", ParallelSizes(), False, FOUR_BYTE),
    ("sparse_adam_bf16_master_host_distopt", ParallelSizes(), True,
     dict(engram_optimizer="sparse_adam", engram_table_dtype="bf16", engram_table_placement="host")),
    ("rowwise_adam_bf16_master_offload_distopt", ParallelSizes(engram_embedding=2), True,
     dict(engram_optimizer="rowwise_adam", engram_table_dtype="bf16",
          engram_optimizer_state_dtype="bf16", engram_offload_embedding_optimizer_states=True)),
    ("fp8_rowwise_adam_host_eps2_distopt", ParallelSizes(engram_embedding=2), True,
     dict(FOUR_BYTE, engram_table_dtype="fp8_e4m3", engram_table_placement="host")),
    ("fp8_frozen_device_eps2", ParallelSizes(engram_embedding=2), False,
     dict(engram_table_dtype="fp8_e4m3", engram_freeze_tables=True)),
]


def build(layout, distopt, overrides):
    parallel_state.destroy_model_parallel()
    forget_graphs()  # the previous layout's model can be freed
    initialize_distributed(layout, seed=1)
    config = engram_config(layout, LAYER_IDS, engram_embedding_parallel_size=layout.engram_embedding,
                           **overrides)
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distopt)
    model = build_model(config, VOCAB, SEQ, ddp)
    opt_config = OptimizerConfig(optimizer="adam", lr=3e-3, clip_grad=1.0, weight_decay=0.1,
                                 use_distributed_optimizer=distopt)
    return model, build_optimizer(opt_config, model, config)


def live_state(model, optimizer) -> dict[str, torch.Tensor]:
    """A copy of every tensor training continues with: parameters, and each optimizer's
    parameters (float32 masters or shards) with their state, as the optimizers hold them."""
    table_optimizer(optimizer).finish_update()
    out = {}
    for c, chunk in enumerate(model):
        for name, p in chunk.named_parameters():
            out[f"model{c}.{name}"] = p.detach().clone()
        for name, b in chunk.named_buffers():  # an fp8 table's scales
            if name.endswith("weight_scale"):
                out[f"model{c}.{name}"] = b.clone()
    for o, part in enumerate(optimizer.chained_optimizers):
        inner = part.optimizer
        for g, group in enumerate(inner.param_groups):
            for i, p in enumerate(group["params"]):
                key = f"opt{o}.group{g}.param{i}"
                out[key] = p.detach().clone()
                for name, value in inner.state.get(p, {}).items():
                    if torch.is_tensor(value):
                        out[f"{key}.{name}"] = value.detach().clone()
                    else:
                        out[f"{key}.{name}"] = torch.tensor(float(value))
    table = table_optimizer(optimizer)
    for i, main in enumerate(table.main_params):
        out[f"table.main{i}"] = main.detach().clone()
    out["table.num_steps"] = torch.tensor(table.num_steps)
    return out


def differences(before: dict, after: dict) -> list[str]:
    diffs = sorted(set(before) ^ set(after))
    for key in sorted(set(before) & set(after)):
        a, b = before[key], after[key]
        if a.dtype == b.dtype == torch.float8_e4m3fn:  # no float8 equal kernel: the bytes
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            diffs.append(key)
    return diffs


def run(layout, distopt, overrides, save: bool) -> dict:
    model, optimizer = build(layout, distopt, overrides)
    save_root = shared_tmpdir() if save else None
    losses, diffs, keys = [], None, 0
    for step in range(STEPS):
        if save_root is not None and step == SAVE_AFTER:
            before = live_state(model, optimizer)
            save_checkpoint(save_root, step, model, optimizer, check_space=False)
            after = live_state(model, optimizer)
            diffs, keys = differences(before, after), len(before)
        batches = dp_share_of_step(100 + step, LAYER_IDS, GLOBAL_BATCH)
        losses.append(train_step(model, optimizer, batches, SEQ, 1).lm_loss)
    table_optimizer(optimizer).finish_update()
    saved = sorted(p.name for p in Path(save_root).iterdir()) if save else None
    torch.distributed.barrier()  # every rank has listed the folder
    if save and torch.distributed.get_rank() == 0:
        shutil.rmtree(save_root, ignore_errors=True)
    return dict(losses=losses, diffs=diffs, keys=keys, saved=saved)


def main():
    args = parse_args()
    result = {}
    for name, layout, distopt, overrides in CASES:
        saved = run(layout, distopt, overrides, save=True)
        plain = run(layout, distopt, overrides, save=False)
        result[name] = dict(saved_losses=saved["losses"], plain_losses=plain["losses"],
                            state_diffs=saved["diffs"], state_tensors=saved["keys"],
                            saved=saved["saved"])
    write_result(args.out, result)


if __name__ == "__main__":
    main()

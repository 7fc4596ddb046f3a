"""Foundation checks on 4 processes, two layouts in one launch:

1. (TP2, PP2, SP) tiny DeepSeek-V3 (MLA + MoE): megatron schedule, DDP, distributed optimizer;
   loss falls on a repeated batch; dist_checkpointing save -> load into a freshly initialized
   model/optimizer reproduces every model and optimizer tensor exactly.
2. (TP2, EP2, SP): the same training, loss falls.
"""

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch
import torch.distributed as dist
from common import forget_graphs
from common import parse_args, repeated_batches, tiny_config, write_result, VOCAB, SEQ

from engram_train.runtime import ParallelSizes, initialize_distributed
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig

from engram_train.checkpoint import load_checkpoint, save_checkpoint
from engram_train.models.builder import build_model
from engram_train.training.optimizer import build_optimizer
from engram_train.training.step import train_step


def setup(layout: ParallelSizes, seed: int):
    parallel_state.destroy_model_parallel()
    forget_graphs()  # the previous layout's model can be freed
    initialize_distributed(layout, seed=seed)
    config = tiny_config(tp=layout.tensor, pp=layout.pipeline, ep=layout.expert, sp=True)
    config.finalize_model_grads_func = finalize_model_grads
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    model = build_model(config, VOCAB, SEQ, ddp)
    opt_cfg = OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True, clip_grad=1.0, weight_decay=0.01)
    optimizer = build_optimizer(opt_cfg, model, config)
    return config, model, optimizer


def train(model, optimizer, steps):
    batches = repeated_batches(num_microbatches=2, micro_batch_size=2)
    return [train_step(model, optimizer, batches, SEQ, 2).lm_loss for _ in range(steps)]


def flat_state(model, optimizer):
    tensors = {}
    for i, chunk in enumerate(model):
        for k, v in chunk.state_dict().items():
            if torch.is_tensor(v):
                tensors[f"model{i}.{k}"] = v.detach().clone()
    for gi, opt in enumerate(getattr(optimizer, "chained_optimizers", [optimizer])):
        for pi, (p, st) in enumerate(opt.optimizer.state.items()):
            for k, v in st.items():
                if torch.is_tensor(v):
                    tensors[f"opt{gi}.{pi}.{k}"] = v.detach().clone()
        for pi, group in enumerate(opt.optimizer.param_groups):
            for j, p in enumerate(group["params"]):
                tensors[f"main{gi}.{pi}.{j}"] = p.detach().clone()
    return tensors


def main():
    args = parse_args()
    result = {}

    # Layout 1: TP2 x PP2 with sequence parallel.
    _, model, optimizer = setup(ParallelSizes(tensor=2, pipeline=2), seed=1)
    result["tp2pp2_losses"] = train(model, optimizer, 8)
    before = flat_state(model, optimizer)
    ckpt_root = tempfile.mkdtemp() if dist.get_rank() == 0 else None
    holder = [ckpt_root]
    dist.broadcast_object_list(holder, src=0)
    save_checkpoint(holder[0], 8, model, optimizer, extra={"consumed_samples": 64})
    # A differently seeded, freshly built model and optimizer (no state yet), then load.
    _, model2, optimizer2 = setup(ParallelSizes(tensor=2, pipeline=2), seed=99)
    iteration, extra = load_checkpoint(holder[0], model2, optimizer2)
    after = flat_state(model2, optimizer2)
    mismatched = [k for k in before if k not in after or not torch.equal(before[k], after[k])]
    result["ckpt_iteration"] = iteration
    result["ckpt_extra"] = extra
    result["ckpt_num_tensors"] = len(before)
    result["ckpt_mismatched"] = mismatched + [k for k in after if k not in before]
    # Loading resumes training exactly: the next step matches the original run's next step.
    result["resume_next_loss"] = train(model2, optimizer2, 1)[0]
    result["orig_next_loss"] = train(model, optimizer, 1)[0]

    # Layout 2: TP2 x EP2 with sequence parallel.
    _, model, optimizer = setup(ParallelSizes(tensor=2, expert=2), seed=1)
    result["tp2ep2_losses"] = train(model, optimizer, 8)
    result["is_last_stage"] = parallel_state.is_pipeline_last_stage()
    write_result(args.out, result)


if __name__ == "__main__":
    main()

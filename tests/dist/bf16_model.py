"""bf16 Engram model on 4 processes (TP2 + sequence parallel x PP2, alltoall eps 2), one launch.

For fp32 and bf16 Engram tables (``engram_table_dtype``) with a bf16 backbone, and a float32
reference of the same seed:
- dtypes: every parameter of every model chunk (by name), the megatron optimizer's main
  parameters (what torch Adam steps), the table optimizer's masters, the hidden states entering
  and leaving every transformer layer (the residual stream), every Engram branch's output, and
  the model output the loss reads;
- 5 training steps on fixed batches: losses and grad norms, to compare with the float32 run;
- bf16 tables: after the steps, each table equals its float32 master rounded to bf16;
- checkpoint: the bf16 run saves model + optimizer after its steps, a freshly built model of
  another seed loads it; tables, masters and the backbone's bf16 weights must be bitwise equal
  and the next step's loss identical to the uninterrupted run.
"""

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch
import torch.distributed as dist
from common import forget_graphs
from common import SEQ, VOCAB, parse_args, repeated_batches, write_result
from engram_integration import engram_config

from engram_train.runtime import ParallelSizes, initialize_distributed

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import unwrap_model

from engram_train.checkpoint import load_checkpoint, save_checkpoint
from engram_train.engram.engram_module import Engram
from engram_train.models.builder import build_model
from engram_train.models.table_params import engram_table_params
from engram_train.training.engram_optimizer import EngramTableOptimizer
from engram_train.training.optimizer import build_optimizer
from engram_train.training.step import train_step

LAYOUT = ParallelSizes(tensor=2, pipeline=2, engram_embedding=2)
LAYER_IDS = [1, 3]  # one Engram layer on each pipeline stage
GLOBAL_BATCH = 4
STEPS = 5
RUNS = [  # name, precision, table dtype
    ("fp32", "fp32", "fp32"),
    ("bf16", "bf16", "fp32"),
    ("bf16_tables", "bf16", "bf16"),
]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def setup(precision: str, table_dtype: str, seed: int):
    parallel_state.destroy_model_parallel()
    forget_graphs()  # the previous layout's model can be freed
    initialize_distributed(LAYOUT, seed=seed)
    dtype = DTYPES[precision]
    config = engram_config(
        LAYOUT, LAYER_IDS, sp=True, engram_embedding_parallel_size=2,
        engram_table_dtype=table_dtype, bf16=precision == "bf16", params_dtype=dtype,
        pipeline_dtype=dtype,
    )
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    model = build_model(config, VOCAB, SEQ, ddp)
    opt_config = OptimizerConfig(optimizer="adam", lr=3e-3, clip_grad=1.0, weight_decay=0.0,
                                 bf16=precision == "bf16", params_dtype=dtype,
                                 use_distributed_optimizer=True)
    return model, build_optimizer(opt_config, model, config)


def batches():
    return repeated_batches(GLOBAL_BATCH, 1, seed=4)  # DP 1: every rank reads all micro-batches


def table_optimizer(optimizer) -> EngramTableOptimizer:
    return next(o for o in optimizer.chained_optimizers if isinstance(o, EngramTableOptimizer))


def parameter_dtypes(model) -> dict:
    return {f"chunk{i}.{name}": str(p.dtype)
            for i, chunk in enumerate(unwrap_model(model))
            for name, p in chunk.named_parameters()}


class StreamRecorder:
    """dtypes of the residual stream: hidden states into / out of every transformer layer,
    Engram branch outputs, and the chunk outputs."""

    def __init__(self, model):
        self.records: dict[str, set] = {"layer_in": set(), "layer_out": set(), "engram_out": set(),
                                        "model_out": set()}
        self.handles = []
        for chunk in model:
            for module in chunk.modules():
                if isinstance(module, TransformerLayer):
                    self.handles.append(module.register_forward_pre_hook(self._layer_in, with_kwargs=True))
                    self.handles.append(module.register_forward_hook(self._layer_out))
                elif isinstance(module, Engram):
                    self.handles.append(module.register_forward_hook(self._engram_out))
                elif isinstance(module, Float16Module):
                    self.handles.append(module.register_forward_hook(self._model_out))

    def _layer_in(self, module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        self.records["layer_in"].add(str(hidden.dtype))

    def _layer_out(self, module, args, output):
        self.records["layer_out"].add(str(output[0].dtype))

    def _engram_out(self, module, args, output):
        self.records["engram_out"].add(str(output.dtype))

    def _model_out(self, module, args, output):
        self.records["model_out"].add(str(output.dtype))

    def result(self) -> dict:
        for handle in self.handles:
            handle.remove()
        return {k: sorted(v) for k, v in self.records.items()}


def full_tables(model, tensors_of) -> dict:
    """{layer id: full [rows, D] float64} of a per-table tensor, gathered over the shards."""
    mine = {}
    for chunk in model:
        for module in chunk.modules():
            if type(module).__name__ != "MultiHeadEmbedding":
                continue
            full = torch.zeros(module.num_rows, module.embedding_dim, dtype=torch.float64)
            full[module.row_start:module.row_end] = tensors_of(module.weight).detach().double()
            dist.all_reduce(full, group=module.parallel.shard_group)
            mine[module.layer_id] = full
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {k: v for tables in everyone for k, v in tables.items()}


def masters_of(model, optimizer):
    opt = table_optimizer(optimizer)
    by_param = {id(p): main for p, main in zip(opt.model_params, opt.main_params)}
    return full_tables(model, lambda p: by_param[id(p)])


def max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def backbone_state(model) -> dict:
    return {f"{i}.{name}": p.detach().clone()
            for i, chunk in enumerate(unwrap_model(model))
            for name, p in chunk.named_parameters() if not getattr(p, "is_engram_table", False)}


def train(model, optimizer, steps):
    results = [train_step(model, optimizer, batches(), SEQ, 1) for _ in range(steps)]
    return [r.lm_loss for r in results], [r.grad_norm for r in results]


def main():
    args = parse_args()
    result = {}
    parallel_state.destroy_model_parallel()
    forget_graphs()  # the previous layout's model can be freed
    initialize_distributed(LAYOUT, seed=1)
    holder = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    root = Path(holder[0])

    for name, precision, table_dtype in RUNS:
        model, optimizer = setup(precision, table_dtype, seed=1)
        table_opt = table_optimizer(optimizer)
        entry = dict(
            wrapped=[type(chunk.module).__name__ for chunk in model],
            params=parameter_dtypes(model),
            table_names=sorted(f"chunk{i}.{n}" for i, chunk in enumerate(unwrap_model(model))
                               for n, p in chunk.named_parameters()
                               if getattr(p, "is_engram_table", False)),
            megatron_main_dtypes=sorted({str(p.dtype) for o in optimizer.chained_optimizers[:-1]
                                         for g in o.optimizer.param_groups for p in g["params"]}),
            table_main_dtypes=sorted({str(p.dtype) for p in table_opt.main_params}),
            table_mixed_precision=table_opt.mixed_precision,
            num_tables=len(engram_table_params(model)),
        )
        recorder = StreamRecorder(model)
        losses, norms = train(model, optimizer, 1)
        entry["stream"] = recorder.result()
        more_losses, more_norms = train(model, optimizer, STEPS - 1)
        entry["losses"], entry["grad_norms"] = losses + more_losses, norms + more_norms
        if table_dtype == "bf16":
            tables = full_tables(model, lambda p: p)
            masters = masters_of(model, optimizer)
            entry["table_is_rounded_master"] = max_diff(
                tables, {k: v.to(torch.bfloat16).double() for k, v in masters.items()})
        if name == "bf16_tables":
            save_checkpoint(root / name, STEPS, model, optimizer)
            saved = dict(tables=full_tables(model, lambda p: p), masters=masters_of(model, optimizer),
                         backbone=backbone_state(model))
            entry["next_loss"] = train(model, optimizer, 1)[0][0]
            fresh, fresh_opt = setup(precision, table_dtype, seed=99)
            iteration, _ = load_checkpoint(root / name, fresh, fresh_opt)
            now = backbone_state(fresh)
            result["resume"] = dict(
                iteration=iteration,
                table_max_diff=max_diff(full_tables(fresh, lambda p: p), saved["tables"]),
                master_max_diff=max_diff(masters_of(fresh, fresh_opt), saved["masters"]),
                backbone_bitwise=all(torch.equal(now[k], v) for k, v in saved["backbone"].items()),
                backbone_dtypes=sorted({str(v.dtype) for v in now.values()}),
                next_loss=train(fresh, fresh_opt, 1)[0][0],
            )
        result[name] = entry
    result["pipeline_rank"] = parallel_state.get_pipeline_model_parallel_rank()
    result["tensor_rank"] = parallel_state.get_tensor_model_parallel_rank()
    write_result(args.out, result)


if __name__ == "__main__":
    main()

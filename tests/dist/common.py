"""Shared pieces of the torchrun test scripts: args, a tiny DeepSeek-V3 model, batches."""

from __future__ import annotations

import argparse
import atexit
import functools
import gc
import json
import os
import weakref
from pathlib import Path

import torch
import torch.distributed as dist


def parse_args(extra=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    for name, kwargs in (extra or {}).items():
        parser.add_argument(name, **kwargs)
    return parser.parse_args()


def write_result(out: str, result: dict) -> None:
    """This rank's result; after it, the process groups are destroyed when the script exits."""
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    atexit.register(_destroy_process_groups)


def _destroy_process_groups() -> None:
    # Gloo worker threads still running at interpreter teardown can abort a finished rank
    # ("terminate called without an active exception", SIGABRT); megatron never destroys its
    # groups. Only after a rank's result is written: on a failure path a peer may still be
    # inside a collective, and the launcher stops the job anyway.
    if dist.is_initialized():
        from engram_train.runtime import destroy_distributed

        destroy_distributed()


VOCAB = 128
SEQ = 32


def repeated_batches(num_microbatches: int, micro_batch_size: int, seed: int = 0, seq: int = SEQ):
    """A fixed set of micro-batches (same on every rank): loss must fall when repeated."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(num_microbatches):
        tokens = torch.randint(0, VOCAB, (micro_batch_size, seq + 1), generator=g)
        batches.append(
            dict(
                tokens=tokens[:, :-1].contiguous(),
                labels=tokens[:, 1:].contiguous(),
                loss_mask=torch.ones(micro_batch_size, seq),
                position_ids=torch.arange(seq).expand(micro_batch_size, seq).contiguous(),
            )
        )
    return batches


def tiny_config(tp=1, pp=1, ep=1, sp=False, **overrides):
    from engram_train.models.deepseek_v3.v3_config import deepseek_v3_config
    from engram_train.models.presets import backbone_preset

    fields = backbone_preset("deepseek_v3_tiny")
    fields.update(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        sequence_parallel=sp,
        pipeline_dtype=torch.float32,
    )
    fields.update(overrides)
    return deepseek_v3_config(**fields)



# attribute types that hold no tensor: skipped before any isinstance (forget_graphs visits
# ~50k attribute values per layout and rank)
_NO_GRAPH = frozenset({type(None), bool, int, float, str, bytes, dict, set, torch.dtype, torch.device})


def _holds_graph(value) -> bool:
    if type(value) in _NO_GRAPH:
        return False
    if isinstance(value, torch.Tensor):
        return value.grad_fn is not None
    return isinstance(value, (list, tuple)) and any(_holds_graph(v) for v in value)


def _subclasses(cls: type) -> set[type]:
    found, todo = {cls}, [cls]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.add(sub)
                todo.append(sub)
    return found


@functools.lru_cache(maxsize=None)
def _has_instance_dict(cls: type) -> bool:
    return "__dict__" in dir(cls)  # dir() sorts every attribute name: once per type


def forget_graphs() -> None:
    """Let the models of earlier layouts be freed; call it before building the next layout.
    megatron's MoE token dispatchers keep the last forward's routing tensors, with their
    autograd graph, as attributes; the graph reaches the parameters' grad accumulators, whose
    hooks hold megatron's DDP, which holds the model: a cycle through C++ autograd nodes that
    Python's collector cannot see. Each old model and its process groups (3 gloo threads each,
    polling) stayed alive: a script of 8 layouts grew to ~1600 threads per rank. Between
    layouts no backward is pending, so such tensors of every live module are dropped."""
    # exact types from a set: fast over the ~10^6 objects, and never an attribute read (a dead
    # weakref.proxy among them raises on any, isinstance included)
    module_types = _subclasses(torch.nn.Module)
    for module in [o for o in gc.get_objects() if type(o) in module_types]:
        # the module's own attributes and those of its plain helper objects (the dispatcher)
        owners = [module] + [v for v in vars(module).values()
                             if not issubclass(type(v), (torch.nn.Module, type, weakref.ProxyTypes))
                             and _has_instance_dict(type(v))]
        for owner in owners:
            for name, value in list(vars(owner).items()):
                if _holds_graph(value):
                    setattr(owner, name, None)
    # Every caller initializes the next layout right after; with process groups up, that
    # releases the old groups and runs the full collection that frees the old models
    # (engram_train.runtime.distributed.release_parallel_groups): a second one here found
    # nothing more to free.
    if not dist.is_initialized():
        gc.collect()

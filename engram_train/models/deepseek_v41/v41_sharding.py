"""The DeepSeek-V4.1 model's megatron dist_checkpointing view: its plain torch modules give
their own tensors replicated and let every child that knows its sharding speak for itself
(megatron's parallel linears over TP, the Engram table over its embedding-parallel rows, the
routed experts over EP), as ``MegatronModule.sharded_state_dict`` does for megatron's modules.
Without it megatron's default would save a plain module's whole subtree as replicated tensors
of their local shapes, and a checkpoint would not load under another layout."""

from __future__ import annotations

from megatron.core import parallel_state
from torch import nn


def recursive_sharded_state_dict(module: nn.Module, prefix: str = "",
                                 sharded_offsets: tuple = (), metadata=None) -> dict:
    """`module`'s direct parameters and buffers as replicated sharded tensors (TP-split ones
    on their partition dim), each child by its
    own ``sharded_state_dict`` where it has one, else by this function."""
    from megatron.core.transformer.utils import (
        ensure_metadata_has_dp_cp_group,
        make_sharded_tensors_for_checkpoint,
    )

    metadata = ensure_metadata_has_dp_cp_group(metadata)
    own: dict = {}
    module._save_to_state_dict(own, "", keep_vars=True)
    split = {name: param.partition_dim for name, param in module.named_parameters(recurse=False)
             if getattr(param, "tensor_model_parallel", False)}  # TP-split: sinks, wo_a
    state = make_sharded_tensors_for_checkpoint(
        own, prefix, split, sharded_offsets=sharded_offsets,
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        dp_cp_group=metadata["dp_cp_group"])
    for name, child in module.named_children():
        method = getattr(child, "sharded_state_dict", None)
        if method is None:
            state.update(recursive_sharded_state_dict(child, f"{prefix}{name}.",
                                                      sharded_offsets, metadata))
        else:
            state.update(method(f"{prefix}{name}.", sharded_offsets, metadata))
    return state


class DeepseekV41Layers(nn.ModuleList):
    """The model's layer list: state dict keys ``layers.<i>.…`` with i the stage's own index,
    as a plain ``ModuleList``; checkpoint keys with the layer's global id (``layer_id``), so
    that a checkpoint saved on pipeline stages loads on one (as megatron's
    ``TransformerBlock.sharded_state_dict``, megatron-core 0.16.1 / 0.19.2)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding

        state: dict = {}
        for index, layer in enumerate(self):
            local = f"{prefix}{index}."
            part = recursive_sharded_state_dict(layer, local, sharded_offsets, metadata)
            replace_prefix_for_sharding(part, local, f"{prefix}{layer.layer_id}.")
            state.update(part)
        return state

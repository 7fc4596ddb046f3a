"""The Engram table optimizer's state: Adam moments (and float32 masters of low-precision
tables) for checkpoints, as megatron sharded tensors placed like their table's rows, so they
reshard with it (``training/engram_optimizer.py`` mixes this into ``EngramTableOptimizer``).

Checkpoints: the same keys for every table optimizer and with or without offload (per-table
moments, float32 masters under bf16 only). An overlapped host update is finished before any
state is read (``finish_update``).
"""

from __future__ import annotations

import torch
from megatron.core.dist_checkpointing.optimizer import (
    get_param_id_to_sharded_param_map,
    make_sharded_optimizer_tensor,
    optim_state_to_sharding_state,
)

from engram_train.training.row_copy import copy_rows
from engram_train.training.rowwise_adam import RowwiseAdam
from engram_train.training.sparse_adam import RowOptimizer

# Optimizer-state layouts: a checkpoint resumes only into an optimizer of the same layout.
ROWWISE_STATE = "rowwise"
ELEMENTWISE_STATE = "elementwise"


class TableOptimizerState:
    """State methods of ``EngramTableOptimizer`` (which provides ``optimizer``, ``model_params``,
    ``main_params``, ``mixed_precision``, ``num_steps``, ``finish_update`` and
    ``_refresh_masters_from_model``)."""

    def _init_state(self, optimizer, config=None) -> None:
        """Adam state for every parameter (so a checkpoint can be loaded into it)."""
        for group in optimizer.param_groups:
            for p in group["params"]:
                if isinstance(optimizer, RowOptimizer):
                    optimizer.init_state(p)
                elif len(optimizer.state[p]) == 0:
                    optimizer.state[p]["step"] = torch.zeros((), dtype=torch.float32)
                    optimizer.state[p]["exp_avg"] = torch.zeros_like(p.data)
                    optimizer.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)

    @property
    def state_layout(self) -> str:
        """``rowwise`` (rowwise_adam: a second moment per row) or ``elementwise`` (sparse_adam
        and adam: interchangeable dense moments)."""
        return ROWWISE_STATE if isinstance(self.optimizer, RowwiseAdam) else ELEMENTWISE_STATE

    def state_dict(self) -> dict:
        # Same keys with and without offload: a float32 table's master is the table itself
        # (no offload) or an exact copy of it (offload), so only bf16 masters are saved.
        self.finish_update()
        optimizer_state = self.optimizer.state_dict()
        # torch hands out the live per-parameter state dicts: callers (sharded_state_dict
        # below, megatron's checkpoint helpers) replace or pop their entries, which must never
        # reach the state that training continues with.
        optimizer_state["state"] = {i: dict(s) for i, s in optimizer_state["state"].items()}
        return {
            "optimizer": optimizer_state,
            "fp32_main_params": self.main_params if self.mixed_precision else None,
            "num_steps": self.num_steps,
        }

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False,
                           metadata: dict | None = None) -> dict:
        """Adam moments (and float32 main copies) as ShardedTensors shaped like their table's:
        global rows, same replica ids, so they reshard with it. The step count is common."""
        self.finish_update()
        if is_loading:
            self._init_state(self.optimizer)
        state = self.state_dict()
        id_to_sharded = get_param_id_to_sharded_param_map(
            model_sharded_state_dict, self.model_params
        )
        missing = [i for i in range(len(self.model_params)) if i not in id_to_sharded]
        if missing:
            raise RuntimeError(
                f"Engram tables {missing} of this rank are not in the model's sharded state dict"
            )
        row_moments = {i: s.pop("exp_avg_sq_row") for i, s in state["optimizer"]["state"].items()
                       if "exp_avg_sq_row" in s}
        optim_state_to_sharding_state(state["optimizer"], id_to_sharded, exclude_keys=("step",))
        for i, row_moment in row_moments.items():
            state["optimizer"]["state"][i]["exp_avg_sq_row"] = _row_vector_sharded(
                id_to_sharded[i], row_moment, "optimizer.state.exp_avg_sq_row")
        if self.mixed_precision:
            state["fp32_main_params"] = [
                make_sharded_optimizer_tensor(id_to_sharded[i], main, "optimizer.state.fp32_param")
                for i, main in enumerate(self.main_params)
            ]
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        self.finish_update()
        optimizer_state = state_dict["optimizer"]
        num_steps = int(state_dict.get("num_steps", 0))
        for param_state in optimizer_state["state"].values():
            param_state["step"] = torch.tensor(float(num_steps), dtype=torch.float32)
        optimizer_state["param_groups"] = self._filter_and_reorder_param_groups(
            self.optimizer.param_groups, optimizer_state["param_groups"]
        )
        self.optimizer.load_state_dict(optimizer_state)
        saved_mains = state_dict.get("fp32_main_params") if self.mixed_precision else None
        if saved_mains is not None:
            for main, saved in zip(self.main_params, saved_mains):
                copy_rows(main.data, saved)  # nothing when the load read into the live master
        else:  # float32 tables (or a checkpoint without masters): the model was loaded first
            self._refresh_masters_from_model()
        self.num_steps = num_steps


def _row_vector_sharded(model_param, row_vector: torch.Tensor, prefix: str):
    """A per-row optimizer vector [rows] as [rows, 1] placed like its table's rows (so it
    reshards with it): the table's row-block pieces (``engram/table_pieces.py``), or one
    ShardedTensor where the table is one."""
    from dataclasses import replace

    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    if isinstance(model_param, ShardedTensorFactory):
        from engram_train.engram.table_pieces import as_column

        return as_column(model_param, f"{prefix}.{model_param.key}", row_vector)
    fragments = model_param.axis_fragmentations
    sharded = replace(
        model_param, key=f"{prefix}.{model_param.key}", data=row_vector.view(-1, 1),
        dtype=row_vector.dtype, local_shape=(model_param.local_shape[0], 1),
        global_shape=(model_param.global_shape[0], 1),
        global_offset=(model_param.global_offset[0], 0),
        axis_fragmentations=None if fragments is None else (fragments[0], 1),
    )
    sharded.validate_metadata_integrity()
    return sharded

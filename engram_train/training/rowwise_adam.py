"""Row-wise Adam for Engram tables (``engram_optimizer: rowwise_adam``).

Why. Adam's two float32 moments cost 8 bytes per table parameter, twice a bf16 value and
moment. A table row is one n-gram's memory, and its elements see gradients of similar scale,
so one second moment per row (the mean of the squared row gradient, as FBGEMM's
PARTIAL_ROWWISE_ADAM keeps) loses little; the first moment stays per element. State per
parameter: ``exp_avg`` shaped like the table (float32, or bf16 with
``engram_optimizer_state_dtype: bf16``) and ``exp_avg_sq_row`` [rows]: float32, or bfloat16
for an fp8 table (``ROW_MOMENT_DTYPE``, below).

A touched row r with gradient g [D] at step t (t counts every iteration, as ``sparse_adam``):

    m_r  = beta1 m_r + (1 - beta1) g
    v_r  = beta2 v_r + (1 - beta2) mean(g^2)
    w_r  = w_r (1 - lr wd)  -  lr / (1 - beta1^t) * m_r / (sqrt(v_r) / sqrt(1 - beta2^t) + eps)

the same LR (``engram_lr_multiplier`` on the group), bias correction and decoupled weight decay
on the touched rows as ``sparse_adam``. Untouched rows do not move.

Parameters may be bfloat16 (a table without float32 master, ``engram_master_weights: false``):
the row is updated in float32 and rounded back stochastically with hashed bits
(``stochastic_rounding.py``), as is a bf16 first moment, so results do not depend on how the
rows are split over ranks or threads. An fp8_e4m3 table (``engram/fp8_table.py``) is
dequantized row by row, updated in float32 and re-quantized: each updated row gets new E8M0
scales from its new values, and its elements are rounded to the E4M3 grid stochastically with
the same hashed bits (stream ``STREAM_VALUE``) a bf16 table uses.

An fp8 table keeps its row second moment in bfloat16 (2 bytes per row instead of 4: 1/8 of a
byte per parameter at rows of 16). An update moves v by (1 - beta2) of its distance to
mean(g^2), often less than half a bf16 step (2^-9 to 2^-8 of v), which round-to-nearest would
drop every time, so the EMA would stall; it is rounded stochastically instead, with bits of its own
stream (``STREAM_ROW_MOMENT``, column 0 of the row), so its expected value follows the float32
EMA. The step itself uses the float32 v before that rounding. fp32 and bf16 tables keep the
float32 row moment.
"""

from __future__ import annotations

import torch

from engram_train.engram.fp8_table import (
    FP8_DTYPE,
    dequantize_rows,
    is_fp8_table,
    store_rows,
    table_scale,
)
from engram_train.errors import InputError
from engram_train.training.row_copy import copy_rows
from engram_train.training.sparse_adam import RowOptimizer
from engram_train.training.stochastic_rounding import (
    STREAM_MOMENT,
    STREAM_ROW_MOMENT,
    STREAM_VALUE,
    round_rows_bf16,
    rounding_bits,
)

STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def row_moment_dtype(param_dtype: torch.dtype) -> torch.dtype:
    """dtype of ``exp_avg_sq_row`` for a table of ``param_dtype``: bfloat16 for fp8 tables
    (stochastically rounded), float32 for the others."""
    return torch.bfloat16 if param_dtype == FP8_DTYPE else torch.float32


class RowwiseAdam(RowOptimizer):
    """Adam with a per-row second moment over the rows named each step; see the module
    docstring. ``seed`` keys the stochastic rounding; a parameter's ``engram_layer_id`` and
    ``engram_row_start`` (its first global row) name its elements."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, state_dtype: str = "fp32", seed: int = 0) -> None:
        if not 0.0 <= lr:
            raise InputError(f"lr={lr} must be >= 0")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise InputError(f"betas={betas} must lie in [0, 1)")
        if state_dtype not in STATE_DTYPES:
            raise InputError(f"state_dtype={state_dtype!r} must be one of {list(STATE_DTYPES)}")
        self.moment_dtype = STATE_DTYPES[state_dtype]
        self.seed = int(seed)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        for param in self.params():
            if param.dtype not in (torch.float32, torch.bfloat16, FP8_DTYPE):
                raise InputError("rowwise_adam steps float32, bfloat16 or float8_e4m3fn tables, "
                                 f"got {param.dtype}")

    def init_state(self, param: torch.Tensor) -> dict:
        state = self.state[param]
        if len(state) == 0:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros(param.shape, dtype=self.moment_dtype,
                                           device=param.device)
            state["exp_avg_sq_row"] = torch.zeros(param.shape[0],
                                                  dtype=row_moment_dtype(param.dtype),
                                                  device=param.device)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """The saved moments go into the live state tensors, in their own dtypes: torch would
        cast them to each parameter's dtype (rounding float32 moments of a bf16 table through
        bf16) and put new tensors in place of the live ones. A checkpoint load hands back the
        live tensors themselves (`TableOptimizerState.sharded_state_dict` gave them to the
        load), which are kept as they are; other tensors are copied in by blocks of rows
        (`copy_rows`), so a load never holds a second table-sized tensor."""
        moment_keys = ("exp_avg", "exp_avg_sq_row")
        saved = {pid: {k: s[k] for k in moment_keys if k in s}
                 for pid, s in state_dict["state"].items()}
        ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
        live = {param: {k: self.state[param][k] for k in moment_keys if k in self.state[param]}
                for param in self.params()}
        super().load_state_dict(dict(state_dict, state={
            pid: {k: v for k, v in s.items() if k not in moment_keys}
            for pid, s in state_dict["state"].items()}))
        for pid, param in zip(ids, self.params()):
            state, moments = self.state[param], saved.get(pid, {})
            if not moments:
                continue
            shapes = {"exp_avg": (param.shape, self.moment_dtype),
                      "exp_avg_sq_row": ((param.shape[0],), row_moment_dtype(param.dtype))}
            for key, value in moments.items():  # a checkpoint stores the row moment as [rows, 1]
                target = live[param].get(key)
                if target is None:  # no state yet: allocated here, as init_state does
                    shape, dtype = shapes[key]
                    target = torch.zeros(shape, dtype=dtype, device=param.device)
                state[key] = target
                copy_rows(target, value.reshape(target.shape))

    def _store(self, target: torch.Tensor, rows: torch.Tensor, values: torch.Tensor,
               param: torch.Tensor, step: float, stream: int) -> None:
        if is_fp8_table(param) and stream == STREAM_VALUE:
            bits = rounding_bits(self.seed, int(getattr(param, "engram_layer_id", 0)), int(step),
                                 stream, rows + int(getattr(param, "engram_row_start", 0)),
                                 values.shape[1])
            store_rows(param, rows, values, bits)
            return
        if target.dtype == torch.bfloat16:
            start = int(getattr(param, "engram_row_start", 0))
            values = round_rows_bf16(values, seed=self.seed,
                                     layer=int(getattr(param, "engram_layer_id", 0)),
                                     step=int(step), stream=stream, global_rows=rows + start)
        target.index_copy_(0, rows, values.to(target.dtype).view(-1, *target.shape[1:]))

    @torch.no_grad()
    def update_rows(self, param, rows, values, plan) -> None:
        beta1, beta2 = plan["betas"]
        lr, eps, wd, step = plan["lr"], plan["eps"], plan["weight_decay"], plan["step"]
        state = self.state[param]
        rows = rows.to(param.device)
        grad = values.to(param.device, torch.float32)
        m = state["exp_avg"].index_select(0, rows).float().lerp_(grad, 1 - beta1)
        v = state["exp_avg_sq_row"].index_select(0, rows).float().mul_(beta2)
        v.add_(grad.square().mean(dim=1), alpha=1 - beta2)
        self._store(state["exp_avg_sq_row"], rows, v.unsqueeze(1), param, step,
                    STREAM_ROW_MOMENT)
        self._store(state["exp_avg"], rows, m, param, step, STREAM_MOMENT)
        step_size = lr / (1 - beta1**step)
        denom = (v.sqrt() / (1 - beta2**step) ** 0.5).add_(eps).unsqueeze(1)
        value = param.detach().index_select(0, rows)
        if is_fp8_table(param):
            value = dequantize_rows(value, table_scale(param).index_select(0, rows), torch.float32)
        value = value.float()
        if wd:
            value.mul_(1 - lr * wd)
        value.addcdiv_(m, denom.expand_as(m), value=-step_size)
        self._store(param.data, rows, value, param, step, STREAM_VALUE)

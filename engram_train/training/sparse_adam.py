"""Lazy row-wise Adam for Engram tables (``engram_optimizer: sparse_adam``).

Only rows with a gradient this step change: their moments and value, as torch's ``SparseAdam``
does, with bias correction by the global step (every table steps every iteration) and, when
asked, decoupled weight decay applied to the touched rows only. A touched row's update is
torch ``Adam``/``AdamW``'s arithmetic, operation for operation (``SparseAdam`` differs only in
adding eps before the bias correction of the second moment), so from zero moments the first
step equals dense Adam's bit for bit. A step costs O(touched rows x D), not O(table).

State per parameter is that of ``torch.optim.Adam`` (``step``, ``exp_avg``, ``exp_avg_sq``,
dense, shaped like the parameter), so checkpoints are interchangeable with dense ``adam`` and a
run may switch between the two on resume.
"""

from __future__ import annotations

import torch

from engram_train.errors import InputError


class RowOptimizer(torch.optim.Optimizer):
    """Base of the row-sparse table optimizers: a step is ``begin_step`` (every parameter's
    step count advances, once per iteration, and the hyper-parameters are read) followed by
    ``update_rows`` on any split of the touched rows. A row's update depends only on that row,
    the step and the hyper-parameters, so the rows may be updated in any order, in parts, or on
    another thread (``training/host_update.py``) with bit-identical results.

    ``step_rows(grads)`` takes, per parameter (in ``params`` order), a pair (distinct row ids
    [u], float32 gradient rows [u, D]) and does both.
    """

    def step(self, closure=None):  # noqa: D102 - the dense entry point does not apply
        raise RuntimeError(f"{type(self).__name__} steps with step_rows(grads): (rows, values) "
                           "per parameter")

    def params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def begin_step(self) -> list[dict]:
        """Advance every parameter's step; per parameter, what ``update_rows`` needs."""
        plans = []
        for group in self.param_groups:
            for param in group["params"]:
                state = self.init_state(param)
                state["step"] += 1  # global step: bias correction counts every iteration
                plans.append(dict(step=float(state["step"]), lr=float(group["lr"]),
                                  betas=group["betas"], eps=group["eps"],
                                  weight_decay=group["weight_decay"]))
        return plans

    @torch.no_grad()
    def step_rows(self, grads: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        params = self.params()
        if len(grads) != len(params):
            raise ValueError(f"got {len(grads)} row gradients for {len(params)} parameters")
        for param, plan, (rows, values) in zip(params, self.begin_step(), grads):
            if rows.numel():
                self.update_rows(param, rows, values, plan)

    def init_state(self, param: torch.Tensor) -> dict:
        raise NotImplementedError

    def update_rows(self, param: torch.Tensor, rows: torch.Tensor, values: torch.Tensor,
                    plan: dict) -> None:
        raise NotImplementedError


class RowSparseAdam(RowOptimizer):
    """Adam over the rows named each step; see the module docstring. Parameters are float32
    (masters of low-precision tables)."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        if not 0.0 <= lr:
            raise InputError(f"lr={lr} must be >= 0")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise InputError(f"betas={betas} must lie in [0, 1)")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)

    def init_state(self, param: torch.Tensor) -> dict:
        state = self.state[param]
        if len(state) == 0:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def update_rows(self, param, rows, values, plan) -> None:
        beta1, beta2 = plan["betas"]
        lr, eps, wd, step = plan["lr"], plan["eps"], plan["weight_decay"], plan["step"]
        state = self.state[param]
        rows = rows.to(param.device)
        grad = values.to(param.device, torch.float32)
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        # torch Adam's single-tensor arithmetic, on the touched rows only
        m = exp_avg.index_select(0, rows).lerp_(grad, 1 - beta1)
        v = exp_avg_sq.index_select(0, rows).mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        exp_avg.index_copy_(0, rows, m)
        exp_avg_sq.index_copy_(0, rows, v)
        step_size = lr / (1 - beta1**step)
        denom = (v.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
        value = param.index_select(0, rows)
        if wd:
            value.mul_(1 - lr * wd)
        value.addcdiv_(m, denom, value=-step_size)
        param.index_copy_(0, rows, value)

"""Which parameters are Engram tables, and hiding them from megatron's DDP and optimizer.

The tables are reduced and stepped by the Engram table optimizer
(``training/engram_optimizer.py``), not by megatron: both the model builder (DDP) and the
optimizer builder collect megatron's parameters with the tables frozen for the moment.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import torch


def engram_table_params(modules: Iterable[torch.nn.Module]) -> list[torch.nn.Parameter]:
    """Engram table parameters (``is_engram_table``) of ``modules``, each once, in model order."""
    seen: dict[int, torch.nn.Parameter] = {}
    for module in modules:
        for param in module.parameters():
            if getattr(param, "is_engram_table", False):
                seen.setdefault(id(param), param)
    return list(seen.values())


@contextlib.contextmanager
def hidden_from_megatron(params: list[torch.nn.Parameter]) -> Iterator[None]:
    """``requires_grad=False`` while megatron's DDP / optimizer collect their parameters (both
    skip frozen ones), restored after so that autograd still fills ``param.grad``."""
    previous = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in zip(params, previous):
            p.requires_grad_(flag)

"""One optimizer step through megatron's pipeline schedules.

``forward_step`` is the function megatron's ``get_forward_backward_func()`` calls per
micro-batch; ``train_step`` runs a whole global batch and the optimizer. Every pipeline stage
reads the batch (middle stages need token ids / hash ids for their Engram layers), so each
model chunk gets its own iterator over the same micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from engram_train.parallel.context import context_parallel_batch

Batch = dict[str, Any]


def lm_loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Masked token-mean LM loss; returns megatron's (loss, num_tokens, reported) 3-tuple."""
    losses = output_tensor.float()
    mask = loss_mask.to(losses.device).float().view(-1)
    loss_sum = torch.sum(losses.view(-1) * mask)
    num_tokens = mask.sum().to(torch.int)
    reported = torch.stack([loss_sum.detach(), num_tokens.float().detach()])
    return loss_sum, num_tokens, {"lm loss": reported}


def model_inputs(batch: Batch, device: torch.device) -> dict[str, Any]:
    """Keyword arguments for GPTModel/EngramGPTModel.forward from a batch dict."""
    kwargs: dict[str, Any] = dict(
        input_ids=batch["tokens"].to(device, non_blocking=True),
        position_ids=batch["position_ids"].to(device, non_blocking=True),
        attention_mask=(
            batch["attention_mask"].to(device, non_blocking=True)
            if batch.get("attention_mask") is not None
            else None
        ),
        labels=batch["labels"].to(device, non_blocking=True),
    )
    hash_ids = batch.get("engram_hash_ids")
    if isinstance(hash_ids, torch.Tensor):  # the [L, B, S, K] block: one copy per micro-batch
        kwargs["engram_hash_ids"] = hash_ids.to(device, non_blocking=True)
    elif hash_ids is not None:  # {layer_id: [B, S, K]}: the model stacks it
        kwargs["engram_hash_ids"] = hash_ids
    return kwargs


def forward_step(data_iterator: Iterable[Batch], model: torch.nn.Module):
    # Context parallelism: every CP rank reads the whole micro-batch (hashed on the whole
    # sequence) and keeps its zigzag chunks of tokens, labels, mask and hash ids.
    batch = context_parallel_batch(next(data_iterator))
    device = next(model.parameters()).device
    output = model(**model_inputs(batch, device))
    loss_mask = batch["loss_mask"]
    return output, lambda out: lm_loss_func(loss_mask, out)


@dataclass
class StepResult:
    lm_loss: float | None  # token-mean over the global batch; None off the last stage
    num_tokens: int
    grad_norm: float | None
    skipped: bool
    num_zeros_in_grad: int | None = None


def reduce_lm_loss(losses: Sequence[dict]) -> tuple[float | None, int]:
    """Token-mean loss over micro-batches and data-parallel ranks (last stage only); context-
    parallel ranks hold different tokens of the same sequences and are summed too."""
    if not losses:
        return None, 0
    total = torch.stack([d["lm loss"] for d in losses]).sum(0)
    torch.distributed.all_reduce(
        total, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    return (total[0] / total[1].clamp(min=1)).item(), int(total[1].item())


def run_forward_backward(
    model: list[torch.nn.Module],
    microbatches: list[Batch],
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool = False,
) -> list[dict]:
    fb = get_forward_backward_func()
    iterators = [iter(microbatches) for _ in model]
    return fb(
        forward_step_func=forward_step,
        data_iterator=iterators if len(model) > 1 else iterators[0],
        model=model if len(model) > 1 else model[0],
        num_microbatches=len(microbatches),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )


def after_optimizer_step(model: list[torch.nn.Module]) -> None:
    """Every module's ``after_optimizer_step()``, once per step on every rank, in module
    order (the same on every rank of a stage): a model's per-step update outside the
    optimizer, such as DeepSeek-V4.1's expert-bias update (``models/deepseek_v41/v41_load_balance.py``)."""
    for chunk in model:
        for module in chunk.modules():
            hook = getattr(module, "after_optimizer_step", None)
            if callable(hook):
                hook()


def train_step(
    model: list[torch.nn.Module],
    optimizer,
    microbatches: list[Batch],
    seq_length: int,
    micro_batch_size: int,
    lr_scheduler=None,
    next_microbatches: list[Batch] | None = None,
) -> StepResult:
    """Forward/backward over one global batch (this rank's micro-batches) and one optimizer step.

    ``next_microbatches`` (the next step's, when already at hand): host-resident tables updated
    overlapped with the next step change the rows it reads first (``training/host_update.py``)."""
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses = run_forward_backward(model, microbatches, seq_length, micro_batch_size)
    if next_microbatches is not None:
        from engram_train.training.host_update import prioritize_next_step

        prioritize_next_step(model, optimizer, next_microbatches)
    success, grad_norm, num_zeros = optimizer.step()
    after_optimizer_step(model)
    if success and lr_scheduler is not None:
        lr_scheduler.step(increment=len(microbatches) * micro_batch_size * parallel_state.get_data_parallel_world_size())
    lm_loss, num_tokens = reduce_lm_loss(losses) if parallel_state.is_pipeline_last_stage(ignore_virtual=True) else (None, 0)
    return StepResult(lm_loss, num_tokens, grad_norm, not success, num_zeros)


@torch.no_grad()
def evaluate(model: list[torch.nn.Module], microbatches: list[Batch], seq_length: int, micro_batch_size: int):
    for chunk in model:
        chunk.eval()
    losses = run_forward_backward(model, microbatches, seq_length, micro_batch_size, forward_only=True)
    for chunk in model:
        chunk.train()
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return reduce_lm_loss(losses)[0]
    return None

"""DeepSeek-V4.1 under context parallelism (``--cp``) and with tensor parallelism over it
(``--tp``, sequence parallel), one forward and backward of the tiny preset (every CSA2 kind,
fake quantization off) on packed documents (``document_eos_id``): the loss over all tokens
and every parameter's whole gradient (summed over the CP ranks, TP shards gathered,
sequence-parallel partial gradients summed over TP), written by rank 0 for the test to hold
against the one-process run of the same script."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch
import torch.distributed as dist
from common import parse_args, write_result

from engram_train.runtime import ParallelSizes, initialize_distributed

EOS = 0
SEQ = 96  # 2 x CP x 4 chunks of whole ratio-2 runs; documents end inside the chunks
BATCH = 2


def whole_gradient(param: torch.Tensor, grad: torch.Tensor, cp_group, tp_group) -> torch.Tensor:
    grad = grad.clone()
    if cp_group is not None:
        dist.all_reduce(grad, group=cp_group)
    if tp_group is None:
        return grad
    if getattr(param, "tensor_model_parallel", False):
        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(tp_group))]
        dist.all_gather(parts, grad.contiguous(), group=tp_group)
        return torch.cat(parts, dim=param.partition_dim)
    if getattr(param, "sequence_parallel", False):
        dist.all_reduce(grad, group=tp_group)
    return grad


def loss_and_gradients(tp: int, cp: int, device=torch.device("cpu")) -> dict:
    """The loss over all tokens and every parameter's whole gradient on the current layout
    (megatron's parallel state already initialised with `tp` and `cp`)."""
    from megatron.core import parallel_state

    from engram_train.models.builder import build_gpt_model
    from engram_train.models.deepseek_v41.v41_config import deepseek_v41_config
    from engram_train.models.presets import model_preset
    from engram_train.parallel.context import context_parallel_batch

    section = dict(model_preset("deepseek_v41_tiny"), use_engram=False, fake_quantize=False,
                   document_eos_id=EOS)
    config = deepseek_v41_config(section, dict(
        params_dtype=torch.float32, perform_initialization=True,
        tensor_model_parallel_size=tp, sequence_parallel=tp > 1, context_parallel_size=cp))
    torch.manual_seed(5)
    model = build_gpt_model(config, 512, SEQ).to(device)
    with torch.no_grad():  # the same weights on every layout: drawn whole, sliced per rank
        generator = torch.Generator().manual_seed(11)
        for name, param in sorted(model.named_parameters()):
            shape = list(param.shape)
            if getattr(param, "tensor_model_parallel", False):
                shape[param.partition_dim] *= tp
            whole = torch.randn(shape, generator=generator) * 0.05
            if "norm" in name:
                whole = 1 + whole
            if getattr(param, "tensor_model_parallel", False):
                rank = parallel_state.get_tensor_model_parallel_rank()
                whole = whole.chunk(tp, dim=param.partition_dim)[rank]
            param.copy_(whole)
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(1, 512, (BATCH, SEQ + 1), generator=generator)
    tokens[0, [17, 40, 41, 70]] = EOS  # documents of every length, one of a single token
    tokens[1, [29, 63]] = EOS
    batch = dict(tokens=tokens[:, :-1].contiguous(), labels=tokens[:, 1:].contiguous(),
                 loss_mask=torch.ones(BATCH, SEQ),
                 position_ids=torch.arange(SEQ).expand(BATCH, -1).contiguous())
    batch = context_parallel_batch(batch)
    losses = model(batch["tokens"].to(device), labels=batch["labels"].to(device))
    total = losses.sum()
    total.backward()
    cp_group = parallel_state.get_context_parallel_group() if cp > 1 else None
    tp_group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
    loss = total.detach().clone()
    if cp_group is not None:
        dist.all_reduce(loss, group=cp_group)
    return {"loss": loss.item() / (BATCH * SEQ), "local_tokens": int(batch["tokens"].numel()),
            "grads": {name: whole_gradient(p, p.grad, cp_group, tp_group).cpu()
                      for name, p in model.named_parameters() if p.grad is not None}}


def main():
    args = parse_args({"--cp": dict(type=int, default=1), "--tp": dict(type=int, default=1)})
    initialize_distributed(ParallelSizes(tensor=args.tp, context=args.cp))
    result = loss_and_gradients(args.tp, args.cp)
    if dist.get_rank() == 0:
        torch.save({"loss": result["loss"], "grads": result["grads"]},
                   Path(args.out, "result.pt"))
    write_result(args.out, {"local_tokens": result["local_tokens"]})


if __name__ == "__main__":
    main()

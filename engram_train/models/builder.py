"""Build the model chunks of this rank: one per virtual pipeline stage, wrapped in megatron DDP.

``build_gpt_model`` picks the Engram model when ``config.use_engram`` is set and megatron's
own ``GPTModel`` otherwise, so ``use_engram: false`` is exactly the plain backbone.
Engram tables are left out of megatron DDP (its data-parallel averaging is the wrong reduction
for a row shard): ``EngramTableOptimizer`` reduces them (``training/engram_optimizer.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel

from engram_train.models.specs import deepseek_v3_block_spec


def build_gpt_model(
    config: Any,
    vocab_size: int,
    max_sequence_length: int,
    vp_stage: int | None = None,
) -> torch.nn.Module:
    """One model chunk for this pipeline rank (and virtual stage)."""
    pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    kwargs = dict(
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        vp_stage=vp_stage,
    )
    if getattr(config, "use_engram", False):
        from engram_train.models.engram_gpt import EngramGPTModel
        from engram_train.models.engram_specs import engram_block_spec

        return EngramGPTModel(config, engram_block_spec(config, vp_stage=vp_stage), **kwargs)
    return GPTModel(config, deepseek_v3_block_spec(config, vp_stage=vp_stage), **kwargs)


def build_model(
    config: Any,
    vocab_size: int,
    max_sequence_length: int,
    ddp_config: DistributedDataParallelConfig | None = None,
    wrap_with_ddp: bool = True,
) -> list[torch.nn.Module]:
    """All model chunks of this rank, each wrapped in megatron DDP (unless told not to)."""
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    stages = list(range(vpp)) if vpp else [None]
    chunks = [build_gpt_model(config, vocab_size, max_sequence_length, vp_stage=s) for s in stages]
    if torch.cuda.is_available():
        chunks = [c.cuda(torch.cuda.current_device()) for c in chunks]
    if not wrap_with_ddp:
        return chunks
    ddp_config = ddp_config or DistributedDataParallelConfig(grad_reduce_in_fp32=True)
    from engram_train.training.engram_optimizer import engram_table_params, hidden_from_megatron

    # DDP skips parameters that do not require grad; they get it back right after.
    with hidden_from_megatron(engram_table_params(chunks)):
        return [
            DistributedDataParallel(config, ddp_config, module=chunk, disable_bucketing=(i > 0))
            for i, chunk in enumerate(chunks)
        ]

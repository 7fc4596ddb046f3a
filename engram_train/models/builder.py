"""Build the model chunks of this rank: one per virtual pipeline stage, wrapped as Megatron-LM's
``get_model`` wraps them (``Float16Module`` under bf16, then megatron DDP).

``build_gpt_model`` asks the config's family (``model_family``, ``models/families.py``) for the
model: DeepSeek-V4.1's ``DeepseekV41GPTModel``, or for DeepSeek-V3 the Engram model when
``config.use_engram`` is set and megatron's own ``GPTModel`` otherwise, so ``use_engram: false``
is exactly the plain backbone.
Engram tables are left out of megatron DDP (its data-parallel averaging is the wrong reduction
for a row shard): ``EngramTableOptimizer`` reduces them (``training/engram_optimizer.py``).

Mixed precision (``config.bf16``): every parameter is built in ``params_dtype`` (bf16), the
Engram projections included, except the Engram tables, which keep ``engram_table_dtype``.
megatron's ``Float16Module`` then casts the chunk's floating tensors to bf16 and the last
stage's output to float32; the tables and the mHC mappings (``keep_fp32``, as transformers keeps
DeepSeek-V4's ``attn_hc``/``ffn_hc``/``hc_head`` in float32) are held out of that cast. megatron's optimizer keeps
float32 main parameters for the backbone (``OptimizerConfig(bf16=True)``) and takes the float32
mappings as its float32 parameters (no second copy; saved as float32), the table optimizer
float32 master rows for bf16 tables. fp16 with Engram is rejected: the table optimizer has no
loss-scaler path (an inf in a table gradient would not skip the step).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import TransformerConfig

from engram_train.models.families import family_of


def build_gpt_model(
    config: TransformerConfig,
    vocab_size: int,
    max_sequence_length: int,
    vp_stage: int | None = None,
    use_te: bool | None = None,
) -> torch.nn.Module:
    """One model chunk for this pipeline rank (and virtual stage). ``use_te``: Transformer
    Engine spec or the local spec (default: TE when CUDA and TE are present)."""
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
    return family_of(config).build_model(config, use_te=use_te, **kwargs)


def _cast_exempt(param: torch.nn.Parameter) -> bool:
    """Parameters that keep their dtype under bf16/fp16: the Engram tables
    (``engram_table_dtype``) and the float32 mHC mappings (``keep_fp32``)."""
    return getattr(param, "is_engram_table", False) or getattr(param, "keep_fp32", False)


@contextlib.contextmanager
def _engram_tables_held_out(chunks: list[torch.nn.Module], host_only: bool = False
                            ) -> Iterator[None]:
    """Float16Module casts every floating parameter of its module; the Engram tables and the
    mHC mappings keep their own dtype (``_cast_exempt``). They are taken out of their modules'
    parameter dicts for the cast (no copy, no round trip through bf16) and put back unchanged.
    With ``host_only``, only host-resident tables are held out (of the move to the GPU)."""
    from engram_train.engram.host_table import is_host_resident

    held = []
    for chunk in chunks:
        for module in chunk.modules():
            for name, param in list(module._parameters.items()):
                if host_only and (param is None or not is_host_resident(param)):
                    continue
                if param is not None and (
                    getattr(param, "is_engram_table", False) if host_only else _cast_exempt(param)
                ):
                    held.append((module, name, param))
                    module._parameters[name] = None
    try:
        yield
    finally:
        for module, name, param in held:
            module._parameters[name] = param


def wrap_mixed_precision(config: TransformerConfig, chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """``Float16Module`` around each chunk when ``config.bf16`` (as Megatron-LM's get_model);
    the chunks unchanged in fp32. (fp16 with Engram is refused when the config is built.)"""
    if not (config.bf16 or config.fp16):
        return chunks
    with _engram_tables_held_out(chunks):
        return [Float16Module(config, chunk) for chunk in chunks]


def build_model(
    config: TransformerConfig,
    vocab_size: int,
    max_sequence_length: int,
    ddp_config: DistributedDataParallelConfig | None = None,
    wrap_with_ddp: bool = True,
) -> list[torch.nn.Module]:
    """All model chunks of this rank: under bf16 each in a ``Float16Module``, then each in
    megatron DDP (unless ``wrap_with_ddp=False``)."""
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    stages = list(range(vpp)) if vpp else [None]
    chunks = [build_gpt_model(config, vocab_size, max_sequence_length, vp_stage=s) for s in stages]
    if torch.cuda.is_available():
        with _engram_tables_held_out(chunks, host_only=True):  # they stay in host memory
            chunks = [c.cuda(torch.cuda.current_device()) for c in chunks]
    chunks = wrap_mixed_precision(config, chunks)
    if not wrap_with_ddp:
        return chunks
    ddp_config = ddp_config or DistributedDataParallelConfig(grad_reduce_in_fp32=True)
    from engram_train.models.table_params import engram_table_params, hidden_from_megatron

    # DDP skips parameters that do not require grad; they get it back right after.
    with hidden_from_megatron(engram_table_params(chunks)):
        return [
            DistributedDataParallel(config, ddp_config, module=chunk, disable_bucketing=(i > 0))
            for i, chunk in enumerate(chunks)
        ]

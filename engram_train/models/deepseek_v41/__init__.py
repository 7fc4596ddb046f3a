"""The DeepSeek-V4.1 family: a backbone of shared-KV attention with a sliding window and
CSA2's compressed, indexer-selected keys (one K=V head, a learned sink per head, a grouped
low-rank output), MoE with sqrt-softplus routing and clamped SwiGLU experts, and single-pass mHC
residual streams (each sublayer's projection gives the next sublayer's collapse); Engram tables
on two layers (``engram.v41_engram_module``).

- ``v41_args``: the backbone's fields under V4.1's names (``DeepseekV41BackboneArgs``, the
  released defaults) and each layer's CSA2 role (window, full, reindex, reuse);
- ``v41_primitives``: RMSNorm, RoPE (two bases, YaRN on compressed layers), FP8/FP4 fake
  quantization of the released KV caches;
- ``v41_csa``: the compressor, the indexer and candidate blocks, the state handed between layers;
- ``v41_attention``, ``v41_moe``, ``v41_hyper_connection``: the sublayers and the mHC variant;
- ``v41_layer``: one layer in plain torch (streams, float32 ``pre`` and CSA2 state in and out);
- ``v41_config``: a V4.1 preset as the project's megatron config (``DeepseekV41ModelConfig``);
- ``v41_model``: the megatron-core language model the builder builds for
  ``model_family: deepseek_v41`` (``DeepseekV41GPTModel``);
- ``v41_pipeline``: a pipeline stage's layers and the tensor one stage hands the next;
- ``v41_sharding``: the model's checkpoint view (sharded tensors, global layer ids).

Tensors are sequence-first (``[s, b, h]``; streams ``[s, b, n, h]``), as megatron's. Each block
is checked against NeMo Automodel 0.7.0's ``deepseek_v41`` in float32 on the CPU
(tests/test_deepseek_v41_blocks.py), the model against its ``DeepseekV41ForCausalLM``
(tests/test_deepseek_v41_model.py; docs/deepseek-v41.md).
"""

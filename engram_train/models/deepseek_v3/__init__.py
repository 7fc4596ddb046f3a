"""The DeepSeek-V3 family: MLA attention, MoE with shared experts (first-k dense), RMSNorm,
RoPE, SwiGLU; the backbone of the paper's Engram. ``v3_config`` turns a preset into megatron's
``MLATransformerConfig``; ``v3_specs`` gives the layer specs (TE on GPUs, local ones on the CPU).
The blocks every family composes (the Engram layer and model, mHC, the CPU core attentions)
live one folder up, in ``engram_train.models``."""

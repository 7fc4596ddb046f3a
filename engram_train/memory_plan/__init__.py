"""engram-plan: will this configuration fit? Device and host bytes per rank, before the job starts.

The trainer's own config (Hydra composition and ``validate_run_config``) is planned for a
world of ``--nproc-per-node x --nnodes`` ranks: the model is built once on the meta device (no
weights), its parameters are assigned to ranks by the layout, and each pipeline stage gets a
breakdown of what its ranks hold. One concept per module:

- ``layout.py``: the rank layout (TP, PP, EP, CP, DP, Engram shards, micro-batches).
- ``model_bytes.py``: parameters per pipeline stage and rank, weights by dtype, gradient buffers.
- ``optimizer_bytes.py``: megatron's Adam state (distributed optimizer shards) and its step.
- ``engram_tables.py``: Engram tables and their optimizer state, keyed by option names.
- ``activations.py``: one micro-batch's saved activations by layer type (mHC apart), recompute,
  pipeline in-flight micro-batches, logits, prefetch buffers.
- ``fixed.py``: the fixed costs of a process (measured on CPU, stated assumptions on GPU).
- a model family's own terms (its ``plan``, ``models/model_family.PlanTerms``; DeepSeek-V4.1's
  in ``models/deepseek_v41/v41_plan.py``): its parameters, rank shares and layer activations.
- ``node_search.py``: ``--search-nodes``, the smallest node count that fits.
- ``report.py``: the plan per rank kind, whether it fits, the largest items and their fields.
- ``cli.py``: the ``engram-plan`` command (docs/memory.md).
- ``start_check.py``: the trainer's memory check at start-up (``system.memory_check``).
"""

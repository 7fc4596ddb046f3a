"""Hugging Face transformers interop (docs/huggingface.md).

- ``engram-export --format hf``: a checkpoint -> a transformers folder (`export.export_hf`);
- `EngramDeepseekV3ForCausalLM` / `EngramDeepseekV3Config` (``model_type``
  ``engram_deepseek_v3``): Engram on transformers' DeepSeek-V3, registered with the Auto
  classes by ``import engram_train.hf``;
- ``engram-import-hf``: a transformers folder of a registered model family (DeepSeek-V3's,
  DeepSeek-V4.1's; ``models/families.py``) -> a checkpoint the trainer continues from.

transformers is an optional dependency (``pip install -e ".[hf]"``): without it the export
and import still run, and the modeling classes are missing.
"""

from __future__ import annotations

import importlib.util

__all__: list[str] = []

if importlib.util.find_spec("transformers") is not None:
    from engram_train.hf.modeling import (  # registers them with the Auto classes
        EngramDeepseekV3Config,
        EngramDeepseekV3ForCausalLM,
        EngramDeepseekV3Model,
    )

    __all__ += ["EngramDeepseekV3Config", "EngramDeepseekV3ForCausalLM", "EngramDeepseekV3Model"]

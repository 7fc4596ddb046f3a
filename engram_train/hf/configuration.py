"""``EngramDeepseekV3Config``: transformers' DeepSeek-V3 config with the Engram and mHC sections.

Depends on transformers alone: ``engram-export --format hf`` copies this file into the folder
as ``configuration_engram_deepseek_v3.py`` (``auto_map``), so the folder loads where this
project is not installed.
"""

from __future__ import annotations

from transformers import DeepseekV3Config

MODEL_TYPE = "engram_deepseek_v3"


class EngramDeepseekV3Config(DeepseekV3Config):
    """``DeepseekV3Config`` plus ``engram``: the run's Engram fields (``engram_layer_ids``,
    ``max_ngram_size``, ...), the tokenizer's ``num_raw_ids`` and ``compressed_pad_id`` and each
    layer's ``table_rows``; and ``hyper_connections`` (mHC: ``num_residual_streams``,
    ``sinkhorn_iterations``, ``norm_eps``). Either may be empty."""

    model_type = MODEL_TYPE

    def __init__(self, engram: dict | None = None, hyper_connections: dict | None = None,
                 **kwargs) -> None:
        self.engram = dict(engram or {})
        self.hyper_connections = dict(hyper_connections or {})
        super().__init__(**kwargs)

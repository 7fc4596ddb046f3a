"""Inference export of a trained Engram model (format: docs/export.md).

`export_checkpoint` (console script ``engram-export``) streams a megatron dist checkpoint of any
layout into: one safetensors file per Engram layer under the DeepSeek reference's names, the
hash constants as exact int64 tensors, ``engram_config.json``, the tokenizer, and the backbone
under megatron's keys. `engram_train.inference.EngramMemory` reads it.
"""

from engram_train.export.export_cli import main
from engram_train.export.export_errors import ExportError
from engram_train.export.exporter import export_checkpoint
from engram_train.export.format import (
    FORMAT_VERSION,
    ExportedEngram,
    ExportFormatError,
    load_export_config,
)

__all__ = [
    "FORMAT_VERSION",
    "ExportError",
    "ExportFormatError",
    "ExportedEngram",
    "export_checkpoint",
    "load_export_config",
    "main",
]

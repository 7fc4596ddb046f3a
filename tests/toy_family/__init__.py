"""A third model family, defined in this folder alone (docs/architecture.md "Adding a model
family"): ``toy_dense``, a few dense layers of megatron's GPT (standard attention with one
key/value head, SwiGLU, RMSNorm, RoPE) with its own Hugging Face layout (``model_type:
toy_dense``, one safetensors file). Importing this package registers it; the shared commands
(``engram-import-hf``, the trainer, ``engram-export --format hf``) then run it through their
Python entry points (tests/dist/toy_family_run.py, tests/test_toy_family.py)."""

from engram_train.models.families import register
from engram_train.models.hf_mapping import HFMapping
from engram_train.models.model_family import ModelFamily

from .toy_hf import hf_config, import_plan, pieces, reads
from .toy_model import backbone_fields, build_model, transformer_config

NAME = "toy_dense"

FAMILY = register(ModelFamily(
    name=NAME, description="a test's dense GPT (tests/toy_family/)", build_model=build_model,
    transformer_config=transformer_config, backbone_fields=backbone_fields,
    hf=HFMapping(reads=reads, import_plan=import_plan, hf_config=hf_config, pieces=pieces)))

"""The model-family registry (``engram_train/models/families.py``): each shipped preset belongs
to the family its ``model_family`` names and that family lists it; a name no family has is
refused naming the known ones; a transformers ``config.json`` goes to the family that reads it."""

from __future__ import annotations

from pathlib import Path

import pytest

from engram_train.errors import ConfigError
from engram_train.models.families import families, family_of, get_family, hf_family
from engram_train.models.presets import CONF_DIR, model_preset


def test_every_preset_belongs_to_the_family_that_lists_it():
    presets = sorted(p.stem for p in Path(CONF_DIR, "model").glob("*.yaml"))
    listed = {name: family.name for family in families() for name in family.presets}
    assert sorted(listed) == presets
    for name in presets:
        assert model_preset(name).get("model_family", "deepseek_v3") == listed[name], name


def test_an_unknown_family_is_refused_naming_the_known_ones():
    with pytest.raises(ConfigError, match=r"model_family='llama3' .*deepseek_v3, deepseek_v41"):
        get_family("llama3")


def test_a_config_json_goes_to_the_family_that_reads_it():
    assert hf_family({"model_type": "deepseek_v3"}).name == "deepseek_v3"
    assert hf_family({}).name == "deepseek_v3"
    assert hf_family({"model_type": "deepseek_v41"}).name == "deepseek_v41"
    assert hf_family({"model_type": "deepseek_v41_text"}).name == "deepseek_v41"
    # no family reads it: DeepSeek-V3's import refuses it, naming the field
    assert hf_family({"model_type": "llama"}).name == "deepseek_v3"


def test_megatron_own_config_is_deepseek_v3():
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2)
    assert family_of(config).name == "deepseek_v3"

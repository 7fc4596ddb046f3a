"""EngramConfig validation (each error names its field) and composition with megatron configs."""

from __future__ import annotations

import pickle

import pytest
from pathlib import Path

from engram_train.config import EngramConfig

VALID = dict(use_engram=True, engram_tokenizer_name_or_path="tok/tokenizer.json")


def test_defaults():
    config = EngramConfig()
    assert not config.use_engram
    assert config.engram_vocab_size == [1131200, 1131200]
    assert (config.max_ngram_size, config.n_embed_per_ngram, config.n_head_per_ngram) == (3, 512, 8)
    assert config.engram_layer_ids == [1, 15]
    assert config.engram_embedding_parallel_method == "alltoall"
    assert (config.engram_lr_multiplier, config.engram_weight_decay) == (5.0, 0.0)
    EngramConfig(**VALID)  # defaults are valid once a tokenizer is given


def test_checks_only_run_when_enabled():
    EngramConfig(max_ngram_size=1, engram_vocab_size=[], engram_layer_ids=[-1])


@pytest.mark.parametrize(
    "overrides,field",
    [
        (dict(max_ngram_size=1, engram_vocab_size=[]), "max_ngram_size"),
        (dict(engram_vocab_size=[1000]), "engram_vocab_size"),
        (dict(engram_vocab_size=[1000, 1]), "engram_vocab_size"),
        (dict(n_head_per_ngram=0), "n_head_per_ngram"),
        (dict(n_embed_per_ngram=100, n_head_per_ngram=8), "n_embed_per_ngram"),
        (dict(engram_layer_ids=[]), "engram_layer_ids"),
        (dict(engram_layer_ids=[1, -2]), "engram_layer_ids"),
        (dict(engram_layer_ids=[1, 3, 1]), "engram_layer_ids"),
        (dict(engram_pad_id=-1), "engram_pad_id"),
        (dict(engram_seed=-1), "engram_seed"),
        (dict(engram_kernel_size=0), "engram_kernel_size"),
        (dict(engram_hc_mult=0), "engram_hc_mult"),
        (dict(engram_embedding_parallel_size=0), "engram_embedding_parallel_size"),
        (dict(engram_embedding_parallel_method="ring"), "engram_embedding_parallel_method"),
        (
            dict(engram_embedding_parallel_method="allreduce", engram_embedding_parallel_size=2),
            "engram_embedding_parallel_size",
        ),
        (dict(engram_tokenizer_name_or_path=None), "engram_tokenizer_name_or_path"),
        (dict(engram_reset_at_eos=True), "engram_eos_id"),
        (dict(engram_eos_id=-3), "engram_eos_id"),
        (dict(engram_lr_multiplier=0.0), "engram_lr_multiplier"),
        (dict(engram_weight_decay=-0.1), "engram_weight_decay"),
        (dict(engram_init_std=0.0), "engram_init_std"),
    ],
)
def test_value_errors_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        EngramConfig(**{**VALID, **overrides})


@pytest.mark.parametrize(
    "overrides,field",
    [
        (dict(use_engram="yes"), "use_engram"),
        (dict(max_ngram_size=3.0), "max_ngram_size"),
        (dict(engram_vocab_size=1000), "engram_vocab_size"),
        (dict(engram_layer_ids=[1, "2"]), "engram_layer_ids"),
        (dict(engram_lr_multiplier="5"), "engram_lr_multiplier"),
        (dict(engram_embedding_parallel_method=1), "engram_embedding_parallel_method"),
        (dict(engram_eos_id=2.0), "engram_eos_id"),
    ],
)
def test_type_errors_always_run(overrides, field):
    with pytest.raises(TypeError, match=field):
        EngramConfig(**overrides)  # use_engram stays False: types are checked anyway


def test_sequences_are_normalized_to_lists():
    config = EngramConfig(**VALID, engram_vocab_size=(10, 20), engram_layer_ids=(0, 4))
    assert config.engram_vocab_size == [10, 20] and config.engram_layer_ids == [0, 4]


def test_validate_num_layers():
    config = EngramConfig(**VALID, engram_layer_ids=[1, 15])
    config.validate_num_layers(16)
    with pytest.raises(ValueError, match=r"engram_layer_ids \[15\].*num_layers=12"):
        config.validate_num_layers(12)
    EngramConfig(engram_layer_ids=[99]).validate_num_layers(4)  # disabled: nothing to check


def test_from_dict_rejects_unknown_fields():
    config = EngramConfig.from_dict({**VALID, "engram_seed": 3})
    assert config.engram_seed == 3
    with pytest.raises(ValueError, match="engram_sed"):
        EngramConfig.from_dict({**VALID, "engram_sed": 3})
    assert "engram_vocab_size" in EngramConfig.field_names()


# -- composition with megatron ------------------------------------------------------------------

MEGATRON = dict(num_layers=4, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True)


def test_engram_transformer_config_composes():
    from megatron.core.transformer import TransformerConfig

    from engram_train.config import EngramTransformerConfig

    config = EngramTransformerConfig(**MEGATRON, **VALID, engram_layer_ids=[1, 3])
    assert isinstance(config, TransformerConfig) and isinstance(config, EngramConfig)
    assert config.ffn_hidden_size == 4 * 64  # megatron's __post_init__ ran
    assert config.engram_layer_ids == [1, 3] and config.n_head_per_ngram == 8
    assert pickle.loads(pickle.dumps(config)).engram_layer_ids == [1, 3]

    with pytest.raises(ValueError, match=r"engram_layer_ids \[4\].*num_layers=4"):
        EngramTransformerConfig(**MEGATRON, **VALID, engram_layer_ids=[1, 4])
    with pytest.raises(ValueError, match="engram_hc_mult"):
        EngramTransformerConfig(**MEGATRON, **VALID, engram_layer_ids=[1], engram_hc_mult=0)
    with pytest.raises(ValueError, match="tensor_model_parallel_size"):  # megatron's own checks
        EngramTransformerConfig(**{**MEGATRON, "num_attention_heads": 3},
                                tensor_model_parallel_size=2)
    # Engram off: megatron defaults for layer ids are not checked against num_layers.
    assert not EngramTransformerConfig(**MEGATRON).use_engram


def test_engram_mla_transformer_config_composes():
    from megatron.core.transformer import MLATransformerConfig

    from engram_train.config import EngramMLATransformerConfig

    config = EngramMLATransformerConfig(**MEGATRON, **VALID, engram_layer_ids=[0, 2],
                                        q_lora_rank=32, kv_lora_rank=16)
    assert isinstance(config, MLATransformerConfig) and config.multi_latent_attention
    with pytest.raises(ValueError, match="engram_layer_ids"):
        EngramMLATransformerConfig(**MEGATRON, **VALID, engram_layer_ids=[7])


def test_run_schema_types_defaults_and_unknown_keys():
    """The run config's sections are typed (engram_train/config/run.py): an old config lacking a
    key reads its default; a wrong type or an unknown key names the field."""
    from hydra import compose, initialize_config_dir
    from engram_train.config import register
    from hydra.errors import ConfigCompositionException

    from engram_train.config import TrainConfig, typed_run_config
    from engram_train.errors import ConfigError, EngramError

    old = typed_run_config({"train": {"lr": 1e-3}, "model": {"num_layers": 2}})
    assert old.train.lr == 1e-3 and old.train.divergence_window == TrainConfig.divergence_window
    with pytest.raises(ConfigError, match=r"train.lr: .*'abc'.*Float"):
        typed_run_config({"train": {"lr": "abc"}})
    with pytest.raises(ConfigError, match=r"train.foo: Key 'foo' not in 'TrainConfig'"):
        typed_run_config({"train": {"foo": 1}})
    assert issubclass(ConfigError, EngramError)
    conf = str(Path(__file__).resolve().parents[1] / "conf")
    register()  # the run config's schema (conf/train.yaml's defaults)
    with initialize_config_dir(config_dir=conf, version_base=None):
        with pytest.raises(ConfigCompositionException, match="train.lr=abc"):
            compose(config_name="train", overrides=["train.lr=abc"])


def test_readme_reference_lists_every_run_config_key():
    """README.md "Configuration reference" and engram_train/config/run.py name the same keys in
    each typed section."""
    import dataclasses
    import re

    from engram_train.config import SECTIONS

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    reference = readme.split("## Configuration reference", 1)[1].split("\n## ", 1)[0]
    for name, schema in SECTIONS.items():
        table = reference.split(f"### `{name}`", 1)[1].split("\n### ", 1)[0]
        keys = {k for row in table.splitlines() if row.startswith("| `")
                for k in re.findall(r"`(\w+)`", row.split("|")[1])}
        assert keys == {f.name for f in dataclasses.fields(schema)}, name

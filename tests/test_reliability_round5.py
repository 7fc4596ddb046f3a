"""Results that used to differ silently by layout, settings that were dropped, and errors that
did not name their field (docs/reliability.md 'Refused in one line').

- engram-logits of an imported DeepSeek-V4.1 at TP2, TP2 x EP2 and PP2 against one process and
  against NeMo Automodel, at odd and even lengths (45, 64, 199): under tensor parallelism the
  command pads a row to a multiple of TP and marks the extension as padding, which the model
  keeps out of every other token's computation (``padding_mask``);
- a V4.1 ``config.json`` whose ``engram_num_embeddings`` is not the hash's table rows, and the
  project mHC's fields on a V4.1 preset, refused;
- ``train.lr`` below ``train.min_lr``, an id beyond int64 in ``--ids``, a ``config.json``
  vocabulary larger than the folder's embedding, ``engram-plan`` of V4.1 at TP8 with
  ``system.sequence_parallel=true``, ``data.reset_attention_mask`` for V4.1: one line naming
  the field and the fix;
- a folder with ``model.safetensors`` and another safetensors file beside it without an index
  (the other is ignored and named), and a quantized weight whose E8M0 scales are all 0 (named).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import v41_reference as ref
from launch import torchrun
from test_deepseek_v41_hf import ENGRAM, TEXT
from test_reliability_round4_config import compose
from v41_folders import launch, move_weights, nemo_model, v41_config, write_folder

LENGTHS = {45: 2, 64: 1, 199: 1}  # row length: rows (odd and even; 199 as the issue's)
LAYOUTS = {
    "one": "",
    "tp2": "system.tensor_model_parallel_size=2",
    "tp2_ep2": "system.tensor_model_parallel_size=2,system.expert_model_parallel_size=2",
    "pp2": "system.pipeline_model_parallel_size=2",
}
LAYOUT_TOLERANCE = 1e-5  # against one process
NEMO_TOLERANCE = 1e-4  # against NeMo (tests/test_deepseek_v41_hf.py's)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """NeMo's V4.1 (test_deepseek_v41_hf's shape) written as a folder, its logits for rows of
    each length, and its import at one process."""
    root = tmp_path_factory.mktemp("round5")
    ids = {n: torch.randint(1, 4000, (rows, n), generator=torch.Generator().manual_seed(n))
           for n, rows in LENGTHS.items()}
    with ref.side():
        config = v41_config(TEXT, ENGRAM)
        model = nemo_model(config, 0)
        move_weights(model, 5)
        with torch.no_grad():
            nemo = {n: model(input_ids=x).logits.float() for n, x in ids.items()}
        write_folder(model, config, root / "source", quantized=False)
    for n, x in ids.items():
        (root / f"ids_{n}.json").write_text(json.dumps(x.tolist()))
    launch(1, "engram_train.hf.importer", "--hf", root / "source", "--out", root / "ckpt",
           "--seq-length", 256)
    return {"root": root, "ids": ids, "nemo": nemo}


@pytest.fixture(scope="module")
def layouts(source):
    root = source["root"]
    results = torchrun("v41_logits_padding.py", 4, root / "layouts", "--ckpt", str(root / "ckpt"),
                       "--ids", ",".join(f"{n}:{root / f'ids_{n}.json'}" for n in LENGTHS),
                       "--layouts", ";".join(f"{k}:{v}" for k, v in LAYOUTS.items()))
    return root / "layouts", results


def test_engram_logits_on_every_layout_equal_one_process_and_nemo(source, layouts):
    out, results = layouts
    for n, rows in LENGTHS.items():
        one = load_file(str(out / f"one_{n}.safetensors"))["logits"]
        nemo = source["nemo"][n]
        assert one.shape == nemo.shape == (rows, n, nemo.shape[-1])
        error = (one - nemo).abs().max().item()
        print(f"length {n}: one process against NeMo {error:.2e} (logits up to "
              f"{nemo.abs().max():.2f})")
        assert 0.5 < nemo.abs().max() and error <= NEMO_TOLERANCE
        for layout in LAYOUTS:
            assert results[0]["shapes"][f"{layout}_{n}"] == list(one.shape)
            logits = load_file(str(out / f"{layout}_{n}.safetensors"))["logits"]
            error = (logits - one).abs().max().item()
            print(f"length {n}: {layout} against one process {error:.2e}")
            assert error <= LAYOUT_TOLERANCE, (layout, n, error)


def _tiny_model():
    from test_deepseek_v41_model import tiny_config

    from engram_train.models.builder import build_gpt_model

    torch.manual_seed(0)
    config = tiny_config(True)
    config.perform_initialization = True
    model = build_gpt_model(config, 4096, 256).eval()
    with torch.no_grad():  # weights off their init (norms, sinks, router bias)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def test_padding_mask_keeps_padding_out_of_the_other_tokens(one_rank):
    """The model's ``padding_mask`` (right padding, True on padding): the row's tokens get the
    logits of the row alone; padding reaches neither the routed experts nor the Engram
    lookups' outputs; padding before a token is refused."""
    from engram_train.engram.variant import build_hash_mapping
    from engram_train.errors import InputError

    model = _tiny_model()
    mapping = build_hash_mapping(model.config)
    routed = []
    for layer in model.layers:  # the tokens each MoE lets into its routed experts
        layer.ffn.experts.register_forward_pre_hook(
            lambda _, args: routed.append(None if args[3] is None else int(args[3].sum())))
    for n in (45, 63):
        ids = torch.randint(1, 4000, (2, n), generator=torch.Generator().manual_seed(n))
        padded = torch.cat([ids, torch.zeros(2, 3, dtype=torch.long)], dim=1)
        mask = (torch.arange(n + 3) >= n).expand(2, -1)
        with torch.no_grad():
            alone = model(ids, engram_hash_ids=torch.as_tensor(mapping.hash_block(ids.numpy())))
            routed.clear()
            logits = model(padded, padding_mask=mask,
                           engram_hash_ids=torch.as_tensor(mapping.hash_block(padded.numpy())))
        assert routed == [2 * n] * len(model.layers)
        assert (logits[:, :n] - alone).abs().max() <= 1e-6
    with pytest.raises(InputError, match="takes right padding only"):
        model(padded, padding_mask=mask.flip(1))


# -- silent config cases ------------------------------------------------------------------------

def _v41_doc():
    """The composite config.json of the tiny V4.1 preset (its Engram rows: the hash's)."""
    from test_deepseek_v41_model import tiny_config, tiny_model_section

    from engram_train.engram.variant import build_hash_mapping
    from engram_train.models.deepseek_v41.hf.v41_config_map import v41_hf_config

    mapping = build_hash_mapping(tiny_config(True))
    rows = [mapping.num_rows[i] for i in mapping.layer_ids]
    doc = v41_hf_config(tiny_model_section(), 4096, rows, mapping.compressed_vocab_size, "float32")
    return doc, rows


def test_engram_num_embeddings_must_be_the_tables_rows():
    from engram_train.models.hf_mapping import HFConfigError
    from engram_train.models.deepseek_v41.hf.v41_config_map import v41_preset_from_hf

    doc, rows = _v41_doc()
    assert v41_preset_from_hf(doc)["use_engram"] is True  # the hash's rows: accepted
    for wrong in ([rows[0] + 1, rows[1]], rows[:1], rows[0]):
        doc["text_config"]["engram_num_embeddings"] = wrong
        with pytest.raises(HFConfigError) as err:
            v41_preset_from_hf(doc)
        message = str(err.value)
        assert message.startswith(f"config.json text_config.engram_num_embeddings={wrong!r}")
        assert f"set it to {rows}" in message and "\n" not in message


@pytest.mark.parametrize("value", ["true", "false"])
def test_project_mhc_fields_on_the_v41_preset_are_refused(value):
    from engram_train.errors import ConfigError
    from engram_train.training.run_config import validate_run_config

    cfg = compose("model=deepseek_v41_tiny", f"++model.enable_hyper_connections={value}")
    with pytest.raises(ConfigError) as err:
        validate_run_config(cfg, 1, check_data=False)
    message = str(err.value)
    assert message.startswith(f"model.enable_hyper_connections={value.title()} with "
                              "model_family=deepseek_v41") and "drop them" in message
    validate_run_config(compose("model=deepseek_v41_tiny"), 1, check_data=False)


# -- errors that name the field -----------------------------------------------------------------

def test_lr_below_min_lr_names_both():
    from engram_train.errors import ConfigError
    from engram_train.training.run_config import validate_run_config

    with pytest.raises(ConfigError, match=r"^train\.lr=0\.0001 is below train\.min_lr=0\.0003: "
                       r".*raise train\.lr or lower train\.min_lr \(e\.g\. train\.min_lr=1e-05\)$"):
        validate_run_config(compose("train.lr=1e-4"), 1, check_data=False)
    with pytest.raises(ConfigError, match=r"^train\.min_lr=-1 must be >= 0"):
        validate_run_config(compose("train.min_lr=-1"), 1, check_data=False)
    # a warm-up past the decay stays accepted (the scheduler lengthens the decay)
    validate_run_config(compose("train.train_iters=4", "train.lr_warmup_iters=20"), 1,
                        check_data=False)


def test_ids_beyond_int64_are_named(tmp_path):
    from engram_train.errors import InputError
    from engram_train.inference.logits import read_ids

    path = tmp_path / "ids.json"
    path.write_text("[[1, 2], [3, 100000000000000000000000]]")
    with pytest.raises(InputError, match=r"id 100000000000000000000000 \(row 1, position 1\) does "
                                         r"not fit int64; token ids are small non-negative"):
        read_ids(path)


def test_reset_attention_mask_points_v41_to_document_eos_id():
    from engram_train.errors import ConfigError
    from engram_train.training.run_config import validate_run_config

    with pytest.raises(ConfigError) as err:
        validate_run_config(compose("model=deepseek_v41_tiny", "data.reset_attention_mask=true"),
                            1, check_data=False)
    assert "model.document_eos_id=<the EOS id>" in str(err.value)
    assert "engram_reset_at_eos" not in str(err.value)


def test_plan_of_v41_flash_at_tp8_with_sequence_parallel(one_rank):
    from engram_train.memory_plan.plan_cli import make_plan
    from engram_train.training.param_count import compose_config

    cfg = compose_config(["model=deepseek_v41_flash", "system.precision=bf16",
                          "system.tensor_model_parallel_size=8", "system.sequence_parallel=true",
                          "system.expert_model_parallel_size=8", "train.global_batch_size=64"])
    plan = make_plan(cfg, 64, 8, 129280, "cuda", 141 << 30, 2 << 40)
    assert plan.layout.tp == 8 and plan.layout.sequence_parallel


def _copy(source, tmp_path):
    folder = tmp_path / "folder"
    shutil.copytree(source["root"] / "source", folder)
    return folder


def test_config_vocabulary_larger_than_the_embedding_names_both(source, one_rank, tmp_path):
    from engram_train.hf.importer import HFImportError, import_hf

    folder = _copy(source, tmp_path)
    doc = json.loads((folder / "config.json").read_text())
    rows = doc["text_config"]["vocab_size"]
    doc["text_config"]["vocab_size"] = rows + 1
    (folder / "config.json").write_text(json.dumps(doc))
    with pytest.raises(HFImportError) as err:
        import_hf(folder, tmp_path / "out", seq_length=64, log=lambda _: None)
    hidden = TEXT["hidden_size"]
    assert str(err.value) == (
        f"embed.weight has shape ({rows}, {hidden}): {rows} vocabulary rows, but config.json "
        f"vocab_size={rows + 1} needs ({rows + 1}, {hidden}); set vocab_size to the tensor's "
        f"{rows} rows (or give the folder's own weights)")


# -- folder conventions -------------------------------------------------------------------------

def test_other_safetensors_beside_model_safetensors_are_ignored(source, one_rank, tmp_path):
    from engram_train.hf.importer import import_hf

    folder = _copy(source, tmp_path)
    save_file({"logits": torch.zeros(2, 3)}, str(folder / "logits.safetensors"))
    save_file({"base_model.lora_A.weight": torch.zeros(2, 2)},
              str(folder / "adapter_model.safetensors"))
    lines = []
    import_hf(folder, tmp_path / "out", seq_length=64, log=lines.append)
    assert (f"warning: ignored adapter_model.safetensors, logits.safetensors in {folder}: "
            "without model.safetensors.index.json the weights are model.safetensors alone, as "
            "transformers reads the folder") in lines


def test_all_zero_e8m0_scales_are_named(tmp_path):
    """A quantized weight whose scales are all byte 0 (2^-127) decodes to about 0: named; a
    weight with any other scale byte is not."""
    from engram_train.models.deepseek_v41.hf.v41_quant_folder import V41Folder
    from engram_train.models.deepseek_v41.hf.v41_quant_layout import quantize_for_release

    tensors = {}
    for name in ("layers.0.attn.wq_a.weight", "layers.0.attn.wkv.weight"):
        tensors.update(quantize_for_release(name, torch.randn(64, 96)))
    zero = tensors["layers.0.attn.wq_a.scale"]
    tensors["layers.0.attn.wq_a.scale"] = torch.zeros_like(zero.view(torch.uint8)).view(zero.dtype)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    folder = V41Folder(tmp_path)
    assert folder.check() == 2
    assert folder.warnings == [
        "layers.0.attn.wq_a.weight: every E8M0 scale in layers.0.attn.wq_a.scale is byte 0 "
        "(2^-127), so the whole weight decodes to about 0; the folder's scales look damaged "
        "(restore them from the model's source)"]

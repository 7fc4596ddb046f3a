"""A DeepSeek-V4.1 folder in the release's quantized layout through the project at TP2 x EP2
(docs/deepseek-v41.md 'The released quantized layout').

NeMo Automodel 0.7.0's V4.1 (tests/v41_reference.py), shaped unlike the other tests' models
(hidden 80, 4 heads of 64 (RoPE on 32) in 2 output groups, 5 layers: window, full at ratio 4, reindex at
ratio 4, full at ratio 1 as the candidate source, reuse; 4 experts of width 40; Engram on
layers 1 and 4 with 2-grams of 4 heads of 48, tables of two 32-column blocks, the second
ragged), weights moved away from their init, is written under NeMo's ``to_hf`` names and
quantized by the project's encoder (NeMo has no weight quantizer). NeMo's own loading path
(``from_hf``, which dequantizes) reads that folder into a fresh NeMo model: its logits are the
reference. Then, in one module:

- ``engram-import-hf`` at TP2 x EP2 (4 processes), float32 tables; ``engram-logits`` of the
  import equals the reference within 1e-4; ``engram-export --format hf`` of the import gives
  back every quantized tensor's values exactly with the same names, dtypes and shapes,
  every other tensor within 1e-6; the ranks' peak RSS per parameter of their shard;
- ``--engram-table-dtype fp8_e4m3 --engram-table-placement host`` at TP2 x EP2: the tables
  keep the folder's FP8 codes and E8M0 scales byte for byte (the export passes them through),
  logits as above; two trainer steps from it (tables trained on the host) export in the
  released layout with the trained tables' codes and scales as stored (an all-zero block takes
  the release's scale 2^-22); ``--hf-layout bf16`` writes the fp8 tables' values exactly;
- the trainer's fp8 rows against the release's encoder of their values, and a folder's table
  rows read for an fp8 preset (in-process).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import v41_reference as ref
from engram_train.models.deepseek_v41.hf import v41_quant as q
from engram_train.models.deepseek_v41.hf.v41_quant_layout import (
    RELEASE_QUANTIZATION_CONFIG,
    dequantize_from_release,
    stored_format,
)
from v41_folders import (TP2_EP2, folder_tensors, launch, logits_difference, move_weights,
                         nemo_model, nemo_source, release_values, v41_config, write_folder)

LOGIT_TOLERANCE = 1e-4
TOLERANCE = 1e-6
BATCH, SEQ = 2, 20
TEXT = dict(  # unlike the tiny preset and tests/test_deepseek_v41_hf.py in sizes and schedule
    hidden_size=80, num_hidden_layers=5, num_attention_heads=4, head_dim=64, qk_rope_head_dim=32,
    q_lora_rank=40, o_lora_rank=24, o_groups=2, sliding_window=6, moe_intermediate_size=40,
    n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, compress_ratios=[0, 4, 4, 1, 1],
    kv_source_layer_ids=[1, 3], index_source_layer_ids=[1, 2, 3], index_n_heads=2,
    index_head_dim=32, index_topk=4, candidate_source_layer_id=3, candidate_topk_blocks=3,
    candidate_block_size=2, hc_mult=4, hc_sinkhorn_iters=20, routed_scaling_factor=2.0)
ENGRAM = dict(engram_layer_ids=(1, 4), engram_max_ngram_size=2, engram_n_heads=4,
              engram_head_dim=48, engram_vocab_size=300, engram_pad_token_id=0)


def nemo_quantized_folder(folder, ids: torch.Tensor) -> torch.Tensor:
    """NeMo's model written to `folder` in the quantized layout (inside ``side()``); the
    float32 logits for `ids` of a fresh NeMo model loaded from that folder by ``from_hf``."""
    config = v41_config(TEXT, ENGRAM)
    model = nemo_model(config, 0)
    move_weights(model, 7, zero_rows=7)  # all-zero blocks in the tables
    write_folder(model, config, folder, quantized=True)
    loaded = nemo_model(config, 1)  # NeMo's own dequantizing load of the folder
    state = loaded.state_dict_adapter.from_hf(load_file(str(folder / "model.safetensors")))
    loaded.load_state_dict(state, strict=True)
    with torch.no_grad():
        return loaded(input_ids=ids).logits.float()


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return nemo_source(tmp_path_factory.mktemp("v41_accept"), nemo_quantized_folder, 5, BATCH, SEQ)


@pytest.fixture(scope="module")
def imports(source):
    """engram-import-hf at TP2 x EP2 with float32 tables and with fp8 tables on the host."""
    root, runs = source["root"], {}
    for name, extra in (("f32", []), ("fp8", ["--engram-table-dtype", "fp8_e4m3",
                                               "--engram-table-placement", "host"])):
        out = root / f"import_{name}"
        launch(4, "engram_train.hf.importer", "--hf", source["folder"], "--out", out,
               "--seq-length", 64, *TP2_EP2, *extra)
        runs[name] = out
    return runs


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor


def test_logits_of_both_imports_equal_nemo_loading_the_folder(source, imports):
    for name, checkpoint in imports.items():
        assert logits_difference(source, checkpoint, name) <= LOGIT_TOLERANCE


def test_import_peak_memory_per_parameter(imports):
    for name, checkpoint in imports.items():
        for rank in json.loads((checkpoint / "import_memory.json").read_text()):
            per = (rank["peak_rss"] - rank["rss_before_build"]) / rank["shard_parameters"]
            print(f"{name} rank {rank['rank']}: {rank['shard_parameters']} parameters, peak RSS "
                  f"{rank['peak_rss'] / 2**20:.0f} MiB ({per:.1f} B/param over the RSS before "
                  "the build)")
            assert rank["peak_rss"] <= 12 * rank["shard_parameters"] + 2**30


def _export(checkpoint, out) -> dict[str, torch.Tensor]:
    from engram_train.export.export_cli import main

    main(["--format", "hf", "--load", str(checkpoint), "--out", str(out)])
    assert json.loads((out / "config.json").read_text())["quantization_config"] == (
        RELEASE_QUANTIZATION_CONFIG)
    return folder_tensors(out)


def test_export_of_the_tp2_ep2_import_gives_back_the_folder(source, imports, tmp_path):
    src = folder_tensors(source["folder"])
    want = release_values(src)
    for name, checkpoint in imports.items():
        exported = _export(checkpoint, tmp_path / name)
        assert sorted(exported) == sorted(src)
        for key, value in exported.items():
            assert value.dtype == src[key].dtype and value.shape == src[key].shape, key
        got = release_values(exported)
        for key, value in want.items():
            if stored_format(key) in q.QUANTIZED_FORMATS:
                assert torch.equal(got[key], value), key
            else:
                assert (got[key] - value).abs().max() <= TOLERANCE, key
        tables = [k for k in src if stored_format(q.scale_name(k)) == "e8m0"
                  and stored_format(k) == "fp8_rows"]
        assert len(tables) == 2
        if name == "fp8":  # the codes and scales themselves, zero blocks included
            for key in tables:
                for part in (key, q.scale_name(key)):
                    assert torch.equal(_bytes(exported[part]), _bytes(src[part])), part
            from engram_train.export.export_cli import main

            main(["--format", "hf", "--load", str(checkpoint), "--out", str(tmp_path / "bf16"),
                  "--hf-layout", "bf16"])
            unquantized = folder_tensors(tmp_path / "bf16")
            for key in tables:  # fp8 values dequantized, exact in bf16
                assert unquantized[key].dtype == torch.bfloat16
                assert torch.equal(unquantized[key].float(), want[key]), key


def test_trained_fp8_tables_export_as_stored(source, imports, tmp_path):
    """Two steps from the fp8 import (tables trained on the host by rowwise_adam), then the
    released export: the tables' codes and scales are the checkpoint's."""
    from engram_train.engram.fp8_table import _blocks, dequantize_rows
    from engram_train.export.checkpoint_reader import DistCheckpointReader

    launch(4, "engram_train.train", "--config-dir", imports["fp8"] / "conf", "model=hf_import",
           f"checkpoint.load={imports['fp8']}", f"data.tokenizer={ref.TOKENIZER}",
           f"checkpoint.save={tmp_path / 'ckpt'}", "checkpoint.save_interval=2",
           "train.global_batch_size=2", "train.micro_batch_size=1", "train.seq_length=32",
           "train.log_interval=1", "train.eval_interval=null", "train.lr=3e-3",
           "train.train_iters=2", "train.lr_warmup_iters=0", f"experiment.exp_dir={tmp_path}",
           "system.tensor_model_parallel_size=2", "system.expert_model_parallel_size=2")
    exported = _export(tmp_path / "ckpt", tmp_path / "released")
    reader = DistCheckpointReader(tmp_path / "ckpt" / "iter_0000002")
    src = folder_tensors(source["folder"])
    moved = 0
    for layer in ENGRAM["engram_layer_ids"]:
        key = f"layers.{layer}.engram.multi_head_embedding.weight"
        codes, scale = reader.read(key), reader.read(key + "_scale")
        name = f"layers.{layer}.engram.embed.weight"
        out_codes, out_scale = exported[name], exported[q.scale_name(name)]
        assert out_codes.dtype == torch.float8_e4m3fn and out_scale.dtype == q.SCALE_DTYPE
        assert torch.equal(_bytes(out_codes), _bytes(codes))
        kept = ~(_blocks(codes.float()) == 0).all(dim=-1)  # rows of 48: blocks of 32 and 16
        assert torch.equal(_bytes(out_scale)[kept], scale[kept])
        assert (_bytes(out_scale)[~kept] == 127 + q.FP8_ZERO_BLOCK_EXPONENT).all()
        values = dequantize_from_release(name, out_codes, out_scale)
        assert torch.equal(values, dequantize_rows(codes, scale, torch.float32))
        moved += int((_bytes(out_codes) != _bytes(src[name])).any(dim=1).sum())
    assert moved > 0  # the steps changed rows


@pytest.mark.parametrize("width", [16, 48, 256])
def test_trainer_fp8_rows_are_the_release_bytes(width):
    """The trainer's fp8 table rows (round to nearest even from float values) against the
    release's encoder of their values: the same codes and E8M0 bytes once an all-zero block
    takes the release's scale (`release_table_scales`), except in a block whose largest code
    rounded down to 224 (half of 448), which the encoder writes with half the scale and twice
    the codes: the same values."""
    from engram_train.engram.fp8_table import _blocks, dequantize_rows, quantize_rows
    from engram_train.models.deepseek_v41.hf.v41_quant_layout import release_table_scales

    g = torch.Generator().manual_seed(width)
    values = torch.randn(400, width, generator=g) * torch.logspace(-30, 30, 400)[:, None]
    values[3] = 0
    values[5, :16] = 0
    codes, scale = quantize_rows(values)
    released = release_table_scales(codes, scale)
    assert released.dtype == q.SCALE_DTYPE and released.shape == scale.shape
    decoded = dequantize_rows(codes, scale, torch.float32)
    assert torch.equal(q.decode("fp8_rows", codes, released, name="t"), decoded)
    want_codes, want_scale = q.encode("fp8_rows", decoded, name="t")
    edge = _blocks(codes.float()).abs().amax(dim=-1) == 224
    assert torch.equal(_bytes(want_scale)[~edge], _bytes(released)[~edge])
    assert torch.equal(_bytes(want_scale)[edge], _bytes(released)[edge] - 1)
    same_rows = ~edge.any(dim=1)
    assert torch.equal(_bytes(want_codes)[same_rows], _bytes(codes)[same_rows])
    assert (_bytes(released)[3] == 127 + q.FP8_ZERO_BLOCK_EXPONENT).all()


def test_table_rows_for_an_fp8_preset(tmp_path):
    """`V41Folder.read_table_rows`: a released table's codes and scales as stored (any row
    range), a floating table rounded to nearest even as the trainer quantizes; a NaN scale
    refused."""
    from engram_train.engram.fp8_table import quantize_rows
    from engram_train.models.deepseek_v41.hf.v41_quant_folder import V41Folder

    g = torch.Generator().manual_seed(3)
    values = torch.randn(70, 48, generator=g)
    codes, scale = q.encode("fp8_rows", values, name="t")
    save_file({"layers.1.engram.embed.weight": codes, "layers.1.engram.embed.scale": scale,
               "layers.2.engram.embed.weight": values}, str(tmp_path / "model.safetensors"))
    folder = V41Folder(tmp_path)
    got_codes, got_scale = folder.read_table_rows("layers.1.engram.embed.weight", 5, 40)
    assert torch.equal(_bytes(got_codes), _bytes(codes[5:45]))
    assert torch.equal(got_scale, _bytes(scale[5:45])) and got_scale.dtype == torch.uint8
    got_codes, got_scale = folder.read_table_rows("layers.2.engram.embed.weight", 60, 10)
    want_codes, want_scale = quantize_rows(values[60:])
    assert torch.equal(_bytes(got_codes), _bytes(want_codes)) and torch.equal(got_scale, want_scale)
    folder.close()
    broken = _bytes(scale).clone()
    broken[7, 1] = q.E8M0_NAN
    save_file({"layers.1.engram.embed.weight": codes,
               "layers.1.engram.embed.scale": broken.view(q.SCALE_DTYPE)},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(q.V41QuantSourceError, match="NaN code"):
        V41Folder(tmp_path).read_table_rows("layers.1.engram.embed.weight", 0, 8)

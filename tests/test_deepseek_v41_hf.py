"""DeepSeek-V4.1 Hugging Face folders in and out, unquantized (docs/deepseek-v41.md 'Import and
export').

NeMo Automodel 0.7.0's V4.1 (tests/v41_reference.py), shaped unlike the tiny preset (hidden
96, 8 heads of 32 in 4 output groups, 6 layers with every CSA2 kind: window, full at ratio 2,
reindex, full at ratio 1 as the candidate source, reuse, reindex inside the candidates; Engram
on layers 2 and 4 with 2- and 3-grams of 3 heads), weights initialised and moved away from
their init, is written as an unquantized folder by NeMo's own ``save_pretrained`` and state-dict
adapter (``to_hf``), with one ``mtp.*`` tensor added. Then, in one module:

- ``engram-import-hf`` at one process, at TP2 x EP2 (4 processes) and on two pipeline stages;
  the skipped-tensors line;
- ``engram-logits`` of each import against NeMo's logits for the same ids (within 1e-4);
- three trainer steps from the first two imports with the continued-pretraining command (``--config-dir
  <import>/conf model=<preset> checkpoint.load=<import>``, lr 3e-4, ``model.fake_quantize=false``
  as the layout comparisons take it): the same losses at one process and at TP2 x EP2 (1e-5);
- ``engram-export --format hf --hf-layout bf16`` of the TP2 x EP2 import: every tensor of the
  source back (bf16 where the layout stores bf16: equal to the source rounded to bf16; float32
  where it keeps float32: equal), the same ``config.json`` model fields; the export in float32
  (``export/hf_released.py`` with V4.1's layout): every tensor equal to the source;
- damaged folders, refused in one line naming the tensor: a tensor missing, a tensor the model
  has no place for, one of another shape.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import v41_reference as ref
from v41_folders import (TP2_EP2, launch, logits_difference, move_weights, nemo_model, nemo_source,
                         v41_config, write_folder)

LOGIT_TOLERANCE = 1e-4
LOSS_TOLERANCE = 1e-5
BATCH, SEQ = 2, 24
TEXT = dict(  # unlike the tiny preset in every size and in its schedule
    hidden_size=96, num_hidden_layers=6, num_attention_heads=8, head_dim=32, qk_rope_head_dim=16,
    q_lora_rank=48, o_lora_rank=32, o_groups=4, sliding_window=8, moe_intermediate_size=48,
    n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, compress_ratios=[0, 2, 2, 1, 1, 1],
    kv_source_layer_ids=[1, 3], index_source_layer_ids=[1, 2, 3, 5], index_n_heads=4,
    index_head_dim=32, index_topk=6, candidate_source_layer_id=3, candidate_topk_blocks=4,
    candidate_block_size=2, hc_mult=4, hc_sinkhorn_iters=20, routed_scaling_factor=1.5)
ENGRAM = dict(engram_layer_ids=(2, 4), engram_max_ngram_size=3, engram_n_heads=3,
              engram_head_dim=16, engram_vocab_size=500, engram_pad_token_id=0)


def nemo_folder(folder, ids: torch.Tensor) -> torch.Tensor:
    """NeMo's model written to `folder` (inside ``side()``); its float32 logits for `ids`."""
    config = v41_config(TEXT, ENGRAM)
    model = nemo_model(config, 0)
    move_weights(model, 5)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    draft = {"mtp.0.ffn.gate.weight": torch.zeros(4, TEXT["hidden_size"])}  # a draft tensor
    write_folder(model, config, folder, quantized=False, extra=draft)
    return logits


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """The NeMo folder, the ids and NeMo's logits for them."""
    return nemo_source(tmp_path_factory.mktemp("v41_hf"), nemo_folder, 11, BATCH, SEQ)


@pytest.fixture(scope="module")
def imports(source):
    """engram-import-hf at one process, at TP2 x EP2 and on two pipeline stages: {layout:
    (checkpoint, stdout)}."""
    root, runs = source["root"], {}
    for name, nproc, layout in (("one", 1, []), ("tp2_ep2", 4, TP2_EP2),
                                ("pp2", 2, ["--pipeline-parallel-size", "2"])):
        out = root / f"import_{name}"
        runs[name] = (out, launch(nproc, "engram_train.hf.importer", "--hf", source["folder"],
                                  "--out", out, "--seq-length", 64, *layout))
    return runs


def trainer_losses(nproc: int, checkpoint, exp, *layout: str) -> dict[int, float]:
    """docs/huggingface.md's continued-pretraining command from `checkpoint`: 3 steps."""
    launch(nproc, "engram_train.train", "--config-dir", checkpoint / "conf", "model=hf_import",
           f"checkpoint.load={checkpoint}", f"data.tokenizer={ref.TOKENIZER}",
           "train.global_batch_size=4", "train.micro_batch_size=1", "train.seq_length=32",
           "train.log_interval=1", "train.eval_interval=null", "train.lr=3e-4",
           "train.min_lr=3e-4", "train.lr_warmup_iters=0", "train.lr_decay_style=constant",
           "train.lr_decay_iters=3", "train.train_iters=3", "model.fake_quantize=false",
           f"experiment.exp_dir={exp}", *layout)
    records = [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    return {r["iteration"]: r["lm_loss"] for r in records}


def test_import_writes_the_v41_preset_and_skips_draft_and_vision(source, imports):
    from omegaconf import OmegaConf

    for checkpoint, stdout in imports.values():
        assert ("skipped 1 mtp.* tensors (the DSpark/MTP draft) and 6 vision tensors" in stdout
                ), stdout[-2000:]
        preset = OmegaConf.to_container(OmegaConf.load(checkpoint / "conf/model/hf_import.yaml"))
        assert preset["model_family"] == "deepseek_v41" and preset["use_engram"] is True
        assert {k: preset[k] for k in TEXT} == TEXT
        assert (preset["engram_variant"], preset["engram_layer_ids"], preset["max_ngram_size"],
                preset["n_head_per_ngram"], preset["n_embed_per_ngram"],
                preset["engram_vocab_size"]) == ("deepseek_v41", [2, 4], 3, 3, 48, [500, 500])
        assert (checkpoint / "iter_0000000").is_dir()


def test_logits_of_both_imports_equal_nemo(source, imports):
    """engram-logits of each import (one process) against NeMo's forward, float32."""
    for name, (checkpoint, _) in imports.items():
        assert logits_difference(source, checkpoint, name) <= LOGIT_TOLERANCE


def test_three_steps_from_the_import_at_one_process_and_tp2_ep2(source, imports):
    root = source["root"]
    one = trainer_losses(1, imports["one"][0], root / "train_one")
    tp2_ep2 = trainer_losses(4, imports["tp2_ep2"][0], root / "train_tp2_ep2",
                             "system.tensor_model_parallel_size=2",
                             "system.expert_model_parallel_size=2", "system.sequence_parallel=true")
    print("lm loss per step:", one, tp2_ep2)
    assert sorted(one) == sorted(tp2_ep2) == [1, 2, 3]
    assert max(abs(one[i] - tp2_ep2[i]) for i in one) <= LOSS_TOLERANCE


def _export(checkpoint, out, dtype: torch.dtype, max_shard_bytes: int = 5 * 2**30) -> dict:
    """The unquantized export of `checkpoint` (the run config it stores) in `dtype`."""
    from engram_train.export.checkpoint_reader import DistCheckpointReader
    from engram_train.export.config_source import find_run_config
    from engram_train.export.hf_released import export_released
    from engram_train.models.families import get_family

    reader = DistCheckpointReader(checkpoint / "iter_0000000")
    run_config, where = find_run_config(None, checkpoint, reader.common_state())
    export_released(out, reader, run_config, where, ref.TOKENIZER, get_family("deepseek_v41"),
                    max_shard_bytes=max_shard_bytes, dtype=dtype, log=lambda _: None)
    tensors = {}
    for path in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


def test_export_gives_back_every_tensor(source, imports, tmp_path):
    """engram-export --format hf --hf-layout bf16 of the TP2 x EP2 import: the source's names
    and values (bf16 where the layout stores bf16, i.e. the source rounded to bf16; float32
    where NeMo keeps float32), its config's model fields; in float32 (sharded at 1 MiB) every
    tensor equal to the source."""
    checkpoint = imports["tp2_ep2"][0]
    src = load_file(str(source["folder"] / "model.safetensors"))
    src.pop("mtp.0.ffn.gate.weight")
    from engram_train.export.export_cli import main

    main(["--format", "hf", "--hf-layout", "bf16", "--load", str(checkpoint),
          "--out", str(tmp_path / "bf16")])
    exported = {}
    for path in sorted((tmp_path / "bf16").glob("*.safetensors")):
        exported.update(load_file(str(path)))
    assert sorted(exported) == sorted(src)
    kept = {k for k, v in exported.items() if v.dtype == torch.float32}
    assert all(v.dtype == torch.bfloat16 for k, v in exported.items() if k not in kept)
    assert {k for k in kept if ".hc_" in k or k.endswith(("attn_sink", "gate.bias"))}
    for name, value in exported.items():
        assert torch.equal(value, src[name].to(value.dtype)), name
    ours = json.loads((tmp_path / "bf16" / "config.json").read_text())
    theirs = json.loads((source["folder"] / "config.json").read_text())
    assert ours["model_type"] == "deepseek_v41"
    assert {k: v for k, v in ours["text_config"].items() if k != "dtype"} == {
        k: theirs["text_config"][k] for k in ours["text_config"] if k != "dtype"}
    exported = _export(checkpoint, tmp_path / "f32", torch.float32, max_shard_bytes=2**20)
    assert len(list((tmp_path / "f32").glob("*.safetensors"))) > 1
    assert sorted(exported) == sorted(src)
    worst = max((exported[k] - src[k]).abs().max().item() for k in src)
    print(f"float32 export: max abs difference {worst:.1e} over {len(src)} tensors")
    assert worst <= 1e-6


def _damaged(source, root, edit) -> object:
    folder = root / "damaged"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copyfile(source["folder"] / name, folder / name)
    tensors = load_file(str(source["folder"] / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.pop("layers.2.attn.wq_a.weight"),
     r"has no layers\.2\.attn\.wq_a\.weight \(megatron layers\.2\.attn\.wq_a\.weight needs it\)"),
    (lambda t: t.update({"layers.2.attn.extra.weight": torch.zeros(2)}),
     r"1 tensors of .* have no place in the model .*\['layers\.2\.attn\.extra\.weight'\]"),
    (lambda t: t.update({"layers.3.ffn.experts.1.w2.weight":
                         t["layers.3.ffn.experts.1.w2.weight"][:, :40].contiguous()}),
     r"layers\.3\.ffn\.experts\.1\.w2\.weight has shape \(96, 40\), the model built from "
     r"config\.json needs \(96, 48\)"),
], ids=["missing", "unknown", "misshapen"])
def test_damaged_folders_are_refused_in_one_line(source, one_rank, tmp_path, edit, match):
    from engram_train.hf.importer import HFImportError, import_hf

    folder = _damaged(source, tmp_path, edit)
    with pytest.raises(HFImportError, match=match) as err:
        import_hf(folder, tmp_path / "out", seq_length=64, log=lambda _: None)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out" / "iter_0000000").exists()

"""Hugging Face interop against transformers' own DeepSeek-V3 (docs/huggingface.md).

One process builds megatron models (tests/dist/huggingface_parity.py): two backbones that
differ in routing groups, RoPE flavour (plain, yarn), dense/MoE layout and top-k (and, on
megatron-core 0.16, q LoRA), and the tiny preset with Engram; each is saved, exported with ``--format hf`` and its logits recorded. Here
transformers loads every export (no missing, no unexpected keys) and must give the same logits
(fp32, rel <= 1e-4); the Engram class (one residual stream, and mHC's four) must also decode
greedily, with its cache, exactly as the megatron model does by full forward passes. The other direction: a random transformers
DeepSeek-V3 (groups, yarn, ``rope_interleave: false``) is imported with engram-import-hf (on one
process, and on two pipeline stages) and loaded by the trainer's load path, whose loss must
equal transformers' on the same batch, without Engram and with Engram under
``engram_value_init: zero``. The round trip (import,
three trainer steps with Engram, export, transformers load and generate) runs on every lane.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from launch import REPO, free_port, torchrun, run_process

import transformers  # noqa: E402 - a test dependency (pyproject's test extra): never skipped

import engram_train.hf  # noqa: E402 - registers the Engram classes
from engram_train.models.deepseek_v3.v3_hf_config import (  # noqa: E402
    HFConfigError,
    hf_config,
    preset_from_hf,
)
from engram_train.models.hf_folder import HFFolder, dequantize  # noqa: E402

TOKENIZER = REPO / "examples" / "data" / "tokenizer" / "tokenizer.json"
DATA = REPO / "examples" / "data" / "demo_text_document"
VOCAB = 4096
TOL = 1e-4
MOE_CASES = ["groups_rope", "yarn_dense2_top1"]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def hf_source_config(**changes):
    fields = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, n_group=2, topk_group=2, num_experts_per_tok=4,
        first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, routed_scaling_factor=2.0, rope_interleave=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 16, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        max_position_embeddings=64, initializer_range=0.05, num_nextn_predict_layers=0)
    fields.update(changes)
    return transformers.DeepseekV3Config(**fields)


@pytest.fixture(scope="module")
def hf_source(tmp_path_factory):
    """A random transformers DeepSeek-V3 with norms and router biases off their init, and
    its loss on a fixed batch."""
    root = tmp_path_factory.mktemp("hf_source")
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(hf_source_config()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if "e_score" in name:
                b.copy_(0.05 * torch.randn_like(b))
    model.save_pretrained(root / "hf")
    shutil.copy(TOKENIZER, root / "hf" / "tokenizer.json")
    ids = torch.randint(0, VOCAB, (2, 41), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        logits = model(ids[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    torch.save({"ids": ids, "loss": float(loss), "logits": logits}, root / "batch.pt")
    return SimpleNamespace(root=root, hf=root / "hf", batch=root / "batch.pt", loss=float(loss))


def _run(cmd: list[str], cwd: Path, timeout: int = 600) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    proc = run_process(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def imported(hf_source):
    out = hf_source.root / "imported"
    _run([sys.executable, "-m", "engram_train.hf.importer", "--hf", str(hf_source.hf),
          "--out", str(out), "--seq-length", "64"], cwd=hf_source.root)
    return out


@pytest.fixture(scope="module")
def imported_pp2(hf_source):
    """The same folder imported on two pipeline stages (two processes)."""
    out = hf_source.root / "imported_pp2"
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
          f"--master-port={free_port()}", "-m", "engram_train.hf.importer",
          "--hf", str(hf_source.hf), "--out", str(out), "--seq-length", "64",
          "--pipeline-parallel-size", "2"], cwd=hf_source.root)
    return out


@pytest.fixture(scope="module")
def imported_tp2ep2(hf_source):
    """The same folder imported at tensor x expert parallel 2 x 2 (four processes)."""
    out = hf_source.root / "imported_tp2ep2"
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4",
          f"--master-port={free_port()}", "-m", "engram_train.hf.importer",
          "--hf", str(hf_source.hf), "--out", str(out), "--seq-length", "64",
          "--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2"],
         cwd=hf_source.root)
    return out


@pytest.fixture(scope="module")
def parity(hf_source, imported, imported_pp2, imported_tp2ep2):
    out = hf_source.root / "parity"
    result = torchrun("huggingface_parity.py", 1, out, "--imported", str(imported),
                      "--imported-pp2", str(imported_pp2), "--imported-tp2ep2",
                      str(imported_tp2ep2), "--batch", str(hf_source.batch))[0]
    return SimpleNamespace(out=out, losses=result["losses"])


def _load(folder: Path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, output_loading_info=True)
    return model.eval(), info


def _load_matching_megatron(parity, case: str):
    """The case's export, loaded by transformers with no missing or unexpected key, and its
    logits within TOL of the megatron model's; (model, megatron's record)."""
    model, info = _load(parity.out / case / "hf")
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    record = torch.load(parity.out / case / "megatron.pt")
    with torch.no_grad():
        logits = model(record["ids"]).logits
    diff = rel(logits, record["logits"])
    print(f"{case}: largest relative logit difference {diff:.2e}")
    assert diff <= TOL
    return model, record


@pytest.mark.parametrize("case", MOE_CASES)
def test_export_is_a_stock_deepseek_v3_folder_with_the_same_logits(parity, case):
    folder = parity.out / case / "hf"
    names = sorted(p.name for p in folder.iterdir())
    assert "model.safetensors.index.json" in names and "tokenizer.json" in names
    assert len([n for n in names if n.startswith("model-0")]) > 1  # sharded at 1 MiB
    model, _ = _load_matching_megatron(parity, case)
    assert type(model) is transformers.DeepseekV3ForCausalLM
    assert json.loads((folder / "config.json").read_text())["model_type"] == "deepseek_v3"


@pytest.mark.parametrize("case", ["engram", "engram_mhc"])
def test_engram_class_matches_megatron_and_decodes_with_its_cache(parity, case):
    model, record = _load_matching_megatron(parity, case)
    assert type(model).__name__ == "EngramDeepseekV3ForCausalLM"
    prompt = record["ids"][:, :8]
    cached = model.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False)
    assert torch.equal(cached, record["greedy"])  # megatron: greedy by full forward passes
    with pytest.raises(ValueError, match="num_beams"):
        model.generate(prompt, max_new_tokens=2, num_beams=2)
    with pytest.raises(ValueError, match="input_ids"):
        model(inputs_embeds=torch.zeros(1, 2, model.config.hidden_size))


def test_imported_checkpoint_computes_the_transformers_loss(parity, hf_source):
    losses = parity.losses
    print(f"step-0 loss: transformers {hf_source.loss:.6f}, imported {losses}")
    assert abs(losses["backbone"] - hf_source.loss) / hf_source.loss <= TOL
    assert abs(losses["engram_zero"] - hf_source.loss) / hf_source.loss <= TOL
    assert abs(losses["backbone_pp2"] - hf_source.loss) / hf_source.loss <= TOL
    assert abs(losses["engram_zero_tp2ep2"] - hf_source.loss) / hf_source.loss <= TOL
    assert losses["engram_normal"] != losses["engram_zero"]  # the normal init adds to h at once


@pytest.mark.parametrize("layout", ["imported", "imported_tp2ep2"])
def test_import_on_any_layout_holds_the_weights_alone_and_exports_back_exactly(
        layout, request, hf_source, tmp_path):
    """One process and TP2 x EP2: a model-only checkpoint (iteration 0, no optimizer or
    scheduler state) whose export is the source function (logits within 1e-5)."""
    from engram_train.export.checkpoint_reader import DistCheckpointReader
    from engram_train.export.hf_export import export_hf

    ckpt = request.getfixturevalue(layout)
    manifest = json.loads((ckpt / "iter_0000000" / "manifest.json").read_text())
    assert manifest["contents"] == ["model"] and manifest["iteration"] == 0
    reader = DistCheckpointReader(ckpt / "iter_0000000")
    assert not [k for k in reader.tensors if k.startswith(("optimizer", "chained_"))]
    common = reader.common_state() or {}
    assert "scheduler" not in (common.get("extra") or {})
    export_hf(ckpt, tmp_path / "hf", tokenizer=hf_source.hf, log=lambda _: None)
    model, info = _load(tmp_path / "hf")
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    batch = torch.load(hf_source.batch)
    with torch.no_grad():
        logits = model(batch["ids"][:, :-1]).logits
    diff = rel(logits, batch["logits"])
    print(f"{layout}: exported back, largest relative logit difference {diff:.2e}")
    assert diff <= 1e-5


def test_import_memory_is_its_shard_plus_bounded_blocks(imported, imported_tp2ep2):
    """Peak RSS per rank (engram-import-hf's own record) within docs/huggingface.md's bound:
    12 bytes per shard parameter + 1 GiB; the TP2 x EP2 shards are smaller than the whole."""
    for ckpt in (imported, imported_tp2ep2):
        for rank in json.loads((ckpt / "import_memory.json").read_text()):
            assert rank["peak_rss"] <= 12 * rank["shard_parameters"] + 2**30, rank
    whole = json.loads((imported / "import_memory.json").read_text())[0]["shard_parameters"]
    shards = json.loads((imported_tp2ep2 / "import_memory.json").read_text())
    assert len(shards) == 4 and all(r["shard_parameters"] < 0.75 * whole for r in shards)


@pytest.mark.every_lane
def test_round_trip_import_train_export_generate(imported, hf_source, tmp_path):
    """transformers -> engram-import-hf -> 3 trainer steps with Engram -> engram-export
    --format hf -> transformers load and generate."""
    run = tmp_path / "run"
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1",
          f"--master-port={free_port()}", "-m", "engram_train.train",
          "--config-dir", str(imported / "conf"), "model=hf_import", "model.use_engram=true",
          "model.engram_vocab_size=[2003,2003]", f"checkpoint.load={imported}",
          "checkpoint.load_engram=false", f"checkpoint.save={run / 'checkpoints'}",
          f"data.tokenizer={hf_source.hf}", f"data.path={DATA}", "train.train_iters=3",
          "train.global_batch_size=2", "train.micro_batch_size=2", "train.seq_length=64",
          "train.lr_warmup_iters=0", "train.eval_interval=null", "train.log_interval=1",
          f"experiment.exp_dir={run}"], cwd=tmp_path)
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert first["iteration"] == 1 and 0 < first["lm_loss"] < 20
    _run([sys.executable, "-m", "engram_train.export", "--load", str(run / "checkpoints"),
          "--out", str(tmp_path / "hf"), "--format", "hf"], cwd=tmp_path)
    model, info = _load(tmp_path / "hf")
    assert type(model).__name__ == "EngramDeepseekV3ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    prompt = torch.load(hf_source.batch)["ids"][:, :6]
    cached = model.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    full = model.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False,
                          use_cache=False)
    assert torch.equal(cached, full)


# -- refusals and readers (no process launched) ---------------------------------------------

def _doc(**changes) -> dict:
    doc = json.loads(hf_source_config().to_json_string(use_diff=True))  # as config.json holds it
    doc.update(changes)
    return doc


@pytest.mark.parametrize("changes,field", [
    (dict(attention_bias=True), "attention_bias"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(num_key_value_heads=2), "num_key_value_heads"),
    (dict(norm_topk_prob=False), "norm_topk_prob"),
    (dict(topk_group=1), "topk_group"),
    (dict(rms_norm_eps=1e-5), "rms_norm_eps"),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}), "rope_type"),
    (dict(quantization_config={"quant_method": "gptq"}), "quantization_config"),
    (dict(moe_layer_freq=2), "moe_layer_freq"),
    (dict(my_new_field=1), "my_new_field"),
])
def test_import_refuses_what_it_cannot_honour_naming_the_field(changes, field):
    with pytest.raises(HFConfigError, match=field):
        preset_from_hf(_doc(**changes))


def test_import_honours_deepseek_v3_fields():
    hub = _doc(q_lora_rank=None, rope_scaling={"type": "yarn", "factor": 40, "beta_fast": 32,
               "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
               "original_max_position_embeddings": 4096}, rope_theta=10000,
               first_k_dense_replace=3, tie_word_embeddings=True, num_nextn_predict_layers=1,
               topk_method="noaux_tc", scoring_func="sigmoid", aux_loss_alpha=0.001)
    del hub["rope_parameters"]
    preset = preset_from_hf(hub)
    assert preset["q_lora_rank"] is None and preset["rope_type"] == "yarn"
    assert preset["rotary_scaling_factor"] == 40 and preset["first_k_dense_replace"] == 3
    assert preset["moe_router_num_groups"] == 2 and preset["moe_router_topk_scaling_factor"] == 2.0
    assert preset["moe_aux_loss_coeff"] == 0.001


@pytest.mark.parametrize("changes,field", [
    (dict(moe_router_num_groups=2, moe_router_group_topk=2), "moe_router_group_topk"),
    (dict(layernorm_epsilon=1e-5), "layernorm_epsilon"),
    (dict(moe_router_score_function="softmax"), "moe_router_score_function"),
    (dict(mtp_num_layers=1), "mtp_num_layers"),
])
def test_export_refuses_what_transformers_cannot_express(changes, field):
    model = dict(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                 q_lora_rank=32, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8,
                 v_head_dim=16, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                 moe_shared_expert_intermediate_size=32, first_k_dense_replace=1)
    hf_config(model, VOCAB)  # the tiny preset exports
    with pytest.raises(HFConfigError, match=field):
        hf_config({**model, **changes}, VOCAB)


def test_fp8_block_scaled_weights_are_dequantized(tmp_path):
    from safetensors.torch import save_file

    weight = torch.randn(200, 300)
    scale = torch.rand(2, 3) + 0.5
    expanded = scale.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    fp8 = (weight / expanded).to(torch.float8_e4m3fn)
    save_file({"w": fp8, "w_scale_inv": scale}, str(tmp_path / "model.safetensors"))
    folder = HFFolder(tmp_path)
    assert folder.names() == ["w"]
    torch.testing.assert_close(folder.read("w"), fp8.float() * expanded)
    torch.testing.assert_close(dequantize(fp8, scale, (128, 128)), fp8.float() * expanded)


def test_mtp_layers_are_refused_unless_dropped(hf_source, tmp_path):
    from safetensors.torch import save_file

    from engram_train.hf.importer import HFImportError, import_hf

    folder = tmp_path / "with_mtp"
    shutil.copytree(hf_source.hf, folder)
    save_file({"model.layers.4.embed_tokens.weight": torch.zeros(2, 2)},
              str(folder / "mtp.safetensors"))
    index_file = folder / "model.safetensors.index.json"
    if index_file.exists():
        index = json.loads(index_file.read_text())
    else:  # without an index transformers (and the import) read model.safetensors alone
        from safetensors import safe_open

        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            index = {"weight_map": {k: "model.safetensors" for k in f.keys()}}
    index["weight_map"]["model.layers.4.embed_tokens.weight"] = "mtp.safetensors"
    index_file.write_text(json.dumps(index))
    with pytest.raises(HFImportError, match="num_nextn_predict_layers.*--drop-mtp"):
        import_hf(folder, tmp_path / "out", log=lambda _: None)


# -- batched generation: left padding is skipped (no process launched) -----------------------

def _random_engram_model(streams: int):
    """A small random EngramDeepseekV3ForCausalLM (Engram at layers 1 and 2, and mHC's
    `streams` when > 1) with every weight, the conv and the hash constants off zero."""
    from engram_train.hf.modeling import EngramDeepseekV3Config, EngramDeepseekV3ForCausalLM

    heads, head_dim, rows = 2 * 2, 16, 97
    engram = dict(engram_layer_ids=[1, 2], max_ngram_size=3, n_head_per_ngram=2,
                  n_embed_per_ngram=32, num_raw_ids=VOCAB, compressed_pad_id=5,
                  engram_kernel_size=4, engram_init_std=0.02, engram_hc_mult=streams,
                  table_rows={"1": rows * heads, "2": rows * heads})
    mhc = dict(num_residual_streams=streams, sinkhorn_iterations=20, norm_eps=1e-6) if streams > 1 else {}
    base = json.loads(hf_source_config(num_hidden_layers=3, rope_interleave=True).to_json_string())
    for key in ("model_type", "architectures", "transformers_version"):
        base.pop(key, None)
    config = EngramDeepseekV3Config(engram=engram, hyper_connections=mhc, **base)
    torch.manual_seed(0)
    model = EngramDeepseekV3ForCausalLM(config).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "engram" in name or "_hc" in name or "hc_head" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
        hashes = model.model.engram_hash
        hashes.lookup.copy_(torch.randint(0, 1000, (VOCAB,), generator=g))
        for layer in (1, 2):
            getattr(hashes, f"multipliers_{layer}").copy_(torch.randint(1, 10**6, (3,), generator=g))
            getattr(hashes, f"primes_{layer}").fill_(rows)
            model.model.layers[layer].engram.multi_head_embedding.offsets.copy_(
                torch.arange(heads) * rows)
    return model


@pytest.mark.parametrize("streams", [1, 4])
def test_left_padded_batch_decodes_each_row_as_alone(streams):
    model = _random_engram_model(streams)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, VOCAB, (1, n), generator=g) for n in (3, 11)]
    batch = torch.zeros(2, 11, dtype=torch.long)
    mask = torch.zeros(2, 11, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        batch[row, 11 - prompt.shape[1]:] = prompt
        mask[row, 11 - prompt.shape[1]:] = 1
    with torch.no_grad():
        padded = model(batch, attention_mask=mask, use_cache=False).logits
        for row, prompt in enumerate(prompts):
            alone = model(prompt, use_cache=False).logits[0]
            assert rel(padded[row, 11 - prompt.shape[1]:], alone) <= 1e-5
    for use_cache in (True, False):
        together = model.generate(batch, attention_mask=mask, max_new_tokens=12,
                                  min_new_tokens=12, do_sample=False, use_cache=use_cache)
        for row, prompt in enumerate(prompts):
            alone = model.generate(prompt, max_new_tokens=12, min_new_tokens=12,
                                   do_sample=False, use_cache=use_cache)
            assert torch.equal(together[row, 11:], alone[0, prompt.shape[1]:]), (row, use_cache)
    right = torch.flip(mask, [1])
    with pytest.raises(ValueError, match="right padding"):
        model(batch, attention_mask=right)


# -- the folder's own code: loads where engram_train is not importable -----------------------

_WITHOUT_ENGRAM_TRAIN = """
import sys

import torch


class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "engram_train":
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
        return None


sys.meta_path.insert(0, Blocked())
import transformers

folder, record, out = sys.argv[1:]
try:
    transformers.AutoModelForCausalLM.from_pretrained(folder)
    refusal = ""
except ValueError as err:
    refusal = str(err)
model = transformers.AutoModelForCausalLM.from_pretrained(
    folder, trust_remote_code=True, dtype=torch.float32).eval()
ids = torch.load(record)["ids"]
with torch.no_grad():
    logits = model(ids).logits
greedy = model.generate(ids[:, :8], max_new_tokens=20, min_new_tokens=20, do_sample=False)
torch.save({"logits": logits, "greedy": greedy, "refusal": refusal,
            "class": type(model).__module__, "engram_train": "engram_train" in sys.modules}, out)
"""


def test_export_loads_with_its_own_code_where_engram_train_is_not_installed(parity, tmp_path):
    folder = parity.out / "engram_mhc" / "hf"
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == (
        "modeling_engram_deepseek_v3.EngramDeepseekV3ForCausalLM")
    script = tmp_path / "load.py"
    script.write_text(_WITHOUT_ENGRAM_TRAIN)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    proc = run_process([sys.executable, str(script), str(folder),
                           str(parity.out / "engram_mhc" / "megatron.pt"), str(tmp_path / "out.pt")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    remote = torch.load(tmp_path / "out.pt")
    assert "trust_remote_code=True" in remote["refusal"]
    assert not remote["engram_train"] and "engram_train" not in remote["class"]
    model, record = _load_matching_megatron(parity, "engram_mhc")  # the installed class
    with torch.no_grad():
        logits = model(record["ids"]).logits
    assert rel(remote["logits"], logits) <= 1e-6
    greedy = model.generate(record["ids"][:, :8], max_new_tokens=20, min_new_tokens=20,
                            do_sample=False)
    assert torch.equal(remote["greedy"], greedy)

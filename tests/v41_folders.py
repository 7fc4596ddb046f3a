"""NeMo-written DeepSeek-V4.1 folders for the import and export tests, and what those tests share.

NeMo's ``DeepseekV41ForCausalLM`` built from a text config (inside ``v41_reference.side()``),
its weights moved away from their initial values (construction leaves ``torch.empty`` storage;
zero-initialised parts would hide mistakes), written under NeMo's ``to_hf`` names, unquantized
or in the released quantized layout (the project's encoder: NeMo has no weight quantizer).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import v41_reference as ref
from launch import REPO, free_port, run_process

TP2_EP2 = ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2"]


def env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def launch(nproc: int, module: str, *args) -> str:
    """``torchrun -m module args`` on `nproc` processes; its stdout (the test fails with the
    log tail on a non-zero exit)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={free_port()}", "-m", module, *map(str, args)]
    proc = run_process(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout


def v41_config(text: dict, engram):
    """NeMo's composite config: the backbone fields of `text`, the Engram fields of `engram`
    (a dict under V4.1's names, or ``DeepseekV41EngramArgs``), no vision tower."""
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config

    from engram_train.engram.v41_ngram_hash import DeepseekV41EngramArgs

    args = engram
    if isinstance(engram, dict):
        args = DeepseekV41EngramArgs(**engram, hc_mult=text.get("hc_mult", 4), rms_norm_eps=1e-20,
                                     initializer_range=0.02)
    backbone = {k: v for k, v in text.items() if k != "hidden_size"}
    text_config = ref.text_config(args, text["hidden_size"], **backbone).to_dict()
    return DeepseekV41Config(text_config=text_config, vision_config={"num_hidden_layers": 0})


def nemo_model(config, seed: int):
    """NeMo's model for `config` with float32 weights initialised, experts run eagerly."""
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM
    from test_deepseek_v41_blocks import eager_experts, nemo_backend

    torch.manual_seed(seed)
    backend = nemo_backend()
    backend.enable_hf_state_dict_adapter = True
    model = DeepseekV41ForCausalLM(config, backend=backend, tokenizer=ref.tokenizer()).eval()
    model.initialize_weights(dtype=torch.float32)
    for layer in model.model.layers.values():
        eager_experts(layer.ffn)
    return model


def move_weights(model, perturb_seed: int, *, hc: bool = True, gates: bool = True,
                 zero_rows: int = 0) -> None:
    """Weights of order one at the logits, the Engram tables' rows N(0, 1) (the first
    `zero_rows` all zero), mHC parameters (`hc`) and the Engram gate's norms (`gates`) off
    their initial values, then every parameter perturbed (``perturb``)."""
    from test_deepseek_v41_blocks import perturb

    with torch.no_grad():
        for layer in model.model.layers.values():
            layer.attn.reset_parameters(0.05)
            layer.ffn.init_weights(torch.device("cpu"), init_std=0.05)
            if hc:
                layer.attn_hc.reset_parameters(0.05)
                layer.ffn_hc.reset_parameters(0.05)
            if layer.engram is not None:
                layer.engram.embed.weight.normal_(0.0, 1.0)
                layer.engram.embed.weight[:zero_rows].zero_()
                layer.engram.wkv.weight.normal_(0.0, 0.3)
                if gates:
                    layer.engram.q_weight.uniform_(0.5, 1.5)
                    layer.engram.k_weight.uniform_(-1.5, 1.5)
        model.model.embed_tokens.weight.normal_()
        model.lm_head.weight.normal_(std=0.05)
    perturb(model, perturb_seed)


def write_folder(model, config, folder: Path, *, quantized: bool,
                 extra: dict | None = None) -> dict[str, torch.Tensor]:
    """`model` as a Hugging Face folder (config, one safetensors file, the tokenizer); the
    tensors stored (quantized with the release's rules when `quantized`)."""
    from engram_train.models.deepseek_v41.hf.v41_quant_layout import (
        RELEASE_QUANTIZATION_CONFIG,
        quantize_for_release,
    )

    plain = {k: v.detach().contiguous() for k, v in
             model.state_dict_adapter.to_hf(model.state_dict()).items()}
    plain.update(extra or {})
    stored = plain
    if quantized:
        stored = dict(p for name, value in plain.items() for p in quantize_for_release(name, value))
        config.quantization_config = dict(RELEASE_QUANTIZATION_CONFIG)
    folder.mkdir(parents=True)
    config.save_pretrained(str(folder))
    save_file(stored, str(folder / "model.safetensors"))
    shutil.copyfile(ref.TOKENIZER, folder / "tokenizer.json")
    return stored


def nemo_source(root: Path, write, seed: int, batch: int, seq: int) -> dict:
    """The folder ``write(folder, ids)`` makes under `root` (inside ``side()``, before any
    process group: NeMo's Engram tables take a process group's world as their owners), the
    ids (also as ``ids.json`` for engram-logits) and the reference logits `write` returns."""
    import json

    import torch.distributed as dist

    assert not dist.is_initialized()
    ids = torch.randint(1, 4000, (batch, seq), generator=torch.Generator().manual_seed(seed))
    with ref.side():
        logits = write(root / "source", ids)
    (root / "ids.json").write_text(json.dumps(ids.tolist()))
    return {"root": root, "folder": root / "source", "ids": ids, "logits": logits}


def logits_difference(source: dict, checkpoint: Path, name: str) -> float:
    """engram-logits of `checkpoint` (one process) for the source's ids: the largest absolute
    difference from the source's reference logits (printed beside their scale)."""
    out = source["root"] / f"logits_{name}.safetensors"
    launch(1, "engram_train.inference.logits", "--load", checkpoint,
           "--ids", source["root"] / "ids.json", "--out", out)
    logits, expected = load_file(str(out))["logits"], source["logits"]
    assert logits.shape == expected.shape
    error = (logits - expected).abs().max().item()
    print(f"{name}: logits max abs difference {error:.2e} (logits up to "
          f"{expected.abs().max().item():.2f})")
    return error


def folder_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's safetensors files, as stored."""
    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


def release_values(tensors: dict) -> dict[str, torch.Tensor]:
    """The values a folder's tensors stand for: quantized ones decoded, scales dropped."""
    from engram_train.models.deepseek_v41.hf import v41_quant as q
    from engram_train.models.deepseek_v41.hf.v41_quant_layout import dequantize_from_release, stored_format

    return {n: dequantize_from_release(n, v, tensors.get(q.scale_name(n)))
            for n, v in tensors.items() if stored_format(n) != "e8m0"}

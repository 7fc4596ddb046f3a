"""Shared pieces of the Hugging Face checks: run configs, megatron models with every weight
away from its init (norms, router bias, the Engram conv), forward passes and greedy decoding."""

from __future__ import annotations

import os
from importlib.metadata import version
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from engram_train.config import register
from omegaconf import OmegaConf
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "examples" / "data" / "tokenizer"
VOCAB = 4096  # the demo tokenizer's, a multiple of 128

# Two backbones that differ in routing groups, RoPE flavour and dense/MoE layout.
CASES = {
    "groups_rope": [
        "model.num_moe_experts=8", "model.moe_router_topk=4", "+model.moe_router_num_groups=4",
        "+model.moe_router_group_topk=2", "+model.moe_router_topk_scaling_factor=2.5",
        "model.first_k_dense_replace=1",
    ],
    "yarn_dense2_top1": [
        "model.first_k_dense_replace=2", "model.moe_router_topk=1",
        "+model.rope_type=yarn", "+model.rotary_scaling_factor=4.0",
        "+model.original_max_position_embeddings=32", "+model.mscale=1.0",
        "+model.mscale_all_dim=1.0", "model.rotary_base=5000",
    ],
}
if Version(version("megatron-core")) < Version("0.19"):
    # without q LoRA too; megatron-core 0.19's MLA refuses the local spec's q norm without it
    CASES["yarn_dense2_top1"].append("model.q_lora_rank=null")


def run_config(overrides: list[str], use_engram: bool, seq_length: int = 48):
    register()  # the run config's schema (conf/train.yaml's defaults)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose("train", overrides=[
            f"model.use_engram={str(use_engram).lower()}", f"data.tokenizer={TOKENIZER}",
            f"train.seq_length={seq_length}", *overrides])
    return cfg


def perturb(model: torch.nn.Module, seed: int = 0) -> None:
    """Norm weights, router biases, the Engram conv and mHC's gating off their init."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or ".norm" in name or "norms." in name:
                p.add_(0.2 * torch.randn(p.shape, generator=g))
            elif "short_conv.conv" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif "value_proj" in name or "key_projs" in name:
                p.mul_(5.0)
            elif name.endswith(("_hc.scale", "hc_scale")):  # mHC gating off its small init
                p.fill_(0.5)
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g))


def megatron_logits(chunk, ids: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(ids.shape[1]).expand_as(ids).contiguous()
    with torch.no_grad():
        return chunk(ids, positions, None).float()


def megatron_loss(chunk, ids: torch.Tensor, labels: torch.Tensor) -> float:
    positions = torch.arange(ids.shape[1]).expand_as(ids).contiguous()
    with torch.no_grad():
        return float(chunk(ids, positions, None, labels=labels).float().mean())


def megatron_greedy(chunk, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy decoding by full forward passes (no cache)."""
    ids = prompt
    for _ in range(steps):
        nxt = megatron_logits(chunk, ids)[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids


def save_config(cfg, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, path, resolve=True)
    return path


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

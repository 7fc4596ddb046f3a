"""The DeepSeek-V4.1 model (``models/deepseek_v41/v41_model.py``, preset
``deepseek_v41_tiny``) against NeMo Automodel 0.7.0's ``DeepseekV41ForCausalLM`` with the same
weights, float32 on the CPU: logits within 1e-5 (max abs, logits of order 1) and every
parameter's first gradient within 1e-5 of its largest entry.

The tiny preset's schedule holds every CSA2 layer kind (window; full at ratio 2; reindex;
reuse; full at ratio 1 as the candidate source; reuse; reindex inside the candidates) and its
widths block by 32, so FP8/FP4 fake quantization is active. NeMo's weights are initialised as
NeMo does (``initialize_weights``), then moved away from their init (norms, sinks, mHC ``fn``,
``base``, ``scale``, the router's correction biases), and copied into ours by a name map.
NeMo comes from the side folder ``.v41-ref`` (tests/v41_reference.py).
"""

from __future__ import annotations

import re

import pytest
import torch

import v41_reference as ref
from engram_train.models.presets import model_preset
from test_deepseek_v41_blocks import (
    assert_close_grads,
    eager_experts,
    identity,
    layer_grad_name,
    layer_state_dict,
    nemo_backend,
    perturb,
    weights,
)

LOGIT_TOLERANCE = 1e-5  # max abs, logits of order 1
GRADIENT_TOLERANCE = 1e-5  # max abs over the gradient's max abs
VOCAB, BATCH, SEQ = 256, 2, 40
ENGRAM_KEYS = ("engram_", "use_engram", "max_ngram_size", "n_embed_per_ngram",
               "n_head_per_ngram")


def tiny_model_section() -> dict:
    """The tiny preset's backbone fields (Engram off)."""
    return {k: v for k, v in model_preset("deepseek_v41_tiny").items()
            if not k.startswith(ENGRAM_KEYS)}


def nemo_model(ids: torch.Tensor, targets: torch.Tensor):
    """NeMo's model on the tiny preset's fields (the same names), its logits and the gradients
    of the mean cross entropy."""
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM
    from engram_train.models.deepseek_v41.v41_config import V41_FIELDS

    section = tiny_model_section()
    text = {k: v for k, v in section.items() if k in V41_FIELDS}
    text.update(vocab_size=VOCAB, engram_layer_ids=[], engram_num_embeddings=[],
                num_nextn_predict_layers=0, dspark_noise_token_id=0, dtype="float32")
    config = DeepseekV41Config(text_config=text, vision_config={"num_hidden_layers": 0})
    torch.manual_seed(0)
    model = DeepseekV41ForCausalLM(config, backend=nemo_backend())
    model.initialize_weights(dtype=torch.float32)  # construction leaves torch.empty storage
    with torch.no_grad():
        for layer in model.model.layers.values():
            layer.attn.reset_parameters(0.05)
            layer.ffn.init_weights(torch.device("cpu"), init_std=0.05)
            layer.attn_hc.reset_parameters(0.05)
            layer.ffn_hc.reset_parameters(0.05)
            eager_experts(layer.ffn)
        model.model.embed_tokens.weight.normal_()
        model.lm_head.weight.normal_(std=0.05)  # logits of order 1
    perturb(model, 3)
    logits = model(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
    loss.backward()
    return {"state_dict": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "logits": logits.detach(), "loss": loss.item(),
            "grads": {k: p.grad for k, p in model.named_parameters() if p.grad is not None}}


def our_state_dict(nemo_state: dict) -> dict:
    """NeMo's names -> ours (the layers' map is the blocks test's)."""
    ours = {"embedding.word_embeddings.weight": nemo_state["model.embed_tokens.weight"],
            "final_norm.weight": nemo_state["model.norm.weight"],
            "output_layer.weight": nemo_state["lm_head.weight"]}
    layers: dict[int, dict] = {}
    for name, value in nemo_state.items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        if m:
            layers.setdefault(int(m.group(1)), {})[m.group(2)] = value
    for i, state in layers.items():
        ours.update({f"layers.{i}.{k}": v for k, v in layer_state_dict(state).items()})
    return ours


def nemo_grad_name(name: str):
    """Our parameter name -> (NeMo's, the gradient's transform)."""
    top = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
           "final_norm.weight": "model.norm.weight", "output_layer.weight": "lm_head.weight"}
    if name in top:
        return top[name], identity
    i, rest = re.fullmatch(r"layers\.(\d+)\.(.+)", name).groups()
    nemo_name, transform = layer_grad_name(rest)
    return f"model.layers.{i}.{nemo_name}", transform


@pytest.fixture(scope="module")
def inputs():
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


@pytest.fixture(scope="module")
def nemo(inputs):
    with ref.side():
        return nemo_model(*inputs)


def our_model():
    from engram_train.models.builder import build_gpt_model
    from engram_train.models.deepseek_v41.v41_config import deepseek_v41_config

    config = deepseek_v41_config(tiny_model_section(), dict(params_dtype=torch.float32,
                                                            perform_initialization=False))
    return build_gpt_model(config, VOCAB, SEQ)


def test_tiny_schedule_has_every_layer_kind():
    from engram_train.models.deepseek_v41.v41_args import DeepseekV41BackboneArgs
    from engram_train.models.deepseek_v41.v41_config import V41_FIELDS

    section = tiny_model_section()
    args = DeepseekV41BackboneArgs(**{k: v for k, v in section.items() if k in V41_FIELDS})
    kinds = [args.role(i).kind for i in range(args.num_hidden_layers)]
    assert kinds == ["window", "full", "reindex", "reuse", "full", "reuse", "reindex"]
    assert sorted(set(args.compress_ratios)) == [0, 1, 2]
    assert args.index_topk < args.candidate_topk_blocks * args.candidate_block_size


def test_model_matches_nemo(one_rank, nemo, inputs):
    """The logits and every parameter's gradient of the mean cross entropy."""
    from engram_train.models.deepseek_v41.v41_model import DeepseekV41GPTModel

    ids, targets = inputs
    model = our_model()
    assert isinstance(model, DeepseekV41GPTModel)
    missing, unexpected = model.load_state_dict(our_state_dict(nemo["state_dict"]), strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing,
                                                                               unexpected)
    logits = model(ids)
    scale = nemo["logits"].abs().max().item()
    error = (logits - nemo["logits"]).abs().max().item()
    print(f"logits: max abs error {error:.2e} (logits up to {scale:.2f})")
    assert 0.5 < scale < 20 and error <= LOGIT_TOLERANCE
    loss = model(ids, labels=targets)  # megatron's vocab-parallel cross entropy, [b, s]
    assert loss.shape == (BATCH, SEQ)
    assert abs(loss.mean().item() - nemo["loss"]) <= 1e-6
    loss.mean().backward()
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            nemo_name, transform = nemo_grad_name(name)
            grads.setdefault(nemo_name, []).append(transform(p.grad))
    worst = assert_close_grads(grads, nemo["grads"], GRADIENT_TOLERANCE)
    print(f"gradients: worst relative error {worst:.2e} over {len(grads)} parameters")
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen and all(".attn.indexer." in n for n in frozen)  # NeMo's frozen indexer

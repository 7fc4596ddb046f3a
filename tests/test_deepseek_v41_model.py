"""The DeepSeek-V4.1 model (``models/deepseek_v41/v41_model.py``, preset
``deepseek_v41_tiny``) against NeMo Automodel 0.7.0's ``DeepseekV41ForCausalLM`` with the same
weights (its MoE applying the routing weights after ``w2``, as ours: `weight_after_down`),
float32 on the CPU: logits within 1e-5 (max abs, logits of order 1) and every
parameter's first gradient within 1e-5 of its largest entry. mHC's `scale` vectors are held to
NeMo's own spread instead: NeMo against itself relabeled (experts reversed, output rows
permuted: the same forward bits, other float32 sums in the backward) differs by more than 1e-5
there, and ours may differ from NeMo by at most twice that (and 5e-5).

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
# mHC's three-entry `scale`: each entry's gradient is a sum over every token and coefficient
# whose terms cancel, so the last-bit differences of the backward (the order the experts' and
# the cross entropy's contributions are summed in) weigh ~100 times more there. The mHC itself
# follows NeMo's order (forward and stream gradients bitwise equal given the same inputs); NeMo
# relabeled spreads 2.3e-5 and 2.9e-5 there (measured), ours 2.6e-5 and 1.8e-5 from NeMo
SCALE_GRADIENT_TOLERANCE = 5e-5
# The rest of a sublayer's mHC mapping (`fn`, `base`) and the Engram gate weights (`q_weight`,
# `k_weight`: one scalar gate per token and stream) sum over every token in the same way: the
# sparse attention against the dense one (the same model, exact to rounding: a float64 gradient
# check passes) moves them by 1.4-3.2e-5 relative, every other gradient by at most 1e-5; so they
# take NeMo's own spread too
MHC_ILL_CONDITIONED = ("_hc.scale", "_hc.fn", "_hc.base", "engram.q_weight", "engram.k_weight")
# With Engram on, the token embedding's gradient also passes through the Engram gate, whose
# derivative 1 / (2 sqrt|dot|) turns last-bit differences of a token with a small gate dot into
# relative ones (docs/deepseek-v41.md 'Why layouts part with Engram'): measured against NeMo,
# 9.8e-6 at 2 threads and 1.0e-5 at 1 (the per-worker thread count of `make test`), 4.9e-7
# without Engram; so it takes NeMo's own spread in the Engram model
ENGRAM_ILL_CONDITIONED = ("model.embed_tokens.weight",)
BATCH, SEQ = 2, 40
ENGRAM_NAMES = {"embed.weight": "multi_head_embedding.weight", "wkv.weight": "wkv.weight",
                "q_weight": "q_weight", "k_weight": "k_weight"}  # NeMo's -> ours


def tiny_model_section(engram: bool = True) -> dict:
    """The tiny preset's model section (Engram on layers 1 and 3, or off), on the shipped
    tokenizer."""
    return dict(model_preset("deepseek_v41_tiny"), use_engram=engram,
                engram_tokenizer_name_or_path=str(ref.TOKENIZER))


def tiny_config(engram: bool = True):
    from engram_train.models.deepseek_v41.v41_config import deepseek_v41_config

    return deepseek_v41_config(tiny_model_section(engram), dict(params_dtype=torch.float32,
                                                                perform_initialization=False))


def relabel(model, vocab_order: torch.Tensor) -> None:
    """NeMo's `model` made the same function with other float32 sums: every MoE's experts in
    reverse order (the experts' contributions to a token's gradient add up in another order)
    and the output rows in `vocab_order` (the cross entropy's sums)."""
    with torch.no_grad():
        for layer in model.model.layers.values():
            gate, experts = layer.ffn.gate, layer.ffn.experts
            for t in (gate.weight, gate.e_score_correction_bias, gate.bias_vl,
                      experts.gate_and_up_projs, experts.down_projs):
                t.copy_(t.flip(0))
        model.lm_head.weight.copy_(model.lm_head.weight[vocab_order])


def nemo_weights_moved(text: dict):
    """NeMo's ``DeepseekV41ForCausalLM`` of the text config `text` (inside ``ref.side()``),
    initialised as NeMo does (``initialize_weights``), then its weights moved away from their
    init from seed 0 (norms, sinks, mHC, the router's correction biases; logits of order 1)."""
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM

    config = DeepseekV41Config(text_config=text, vision_config={"num_hidden_layers": 0})
    torch.manual_seed(0)
    model = DeepseekV41ForCausalLM(config, backend=nemo_backend(), tokenizer=ref.tokenizer())
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
        for layer in model.model.layers.values():
            if layer.engram is not None:
                layer.engram.embed.weight.normal_(0.0, 1.0)
                layer.engram.wkv.weight.normal_(0.0, 0.3)
                layer.engram.q_weight.uniform_(0.5, 1.5)
                layer.engram.k_weight.uniform_(-1.5, 1.5)
    perturb(model, 3)
    return model


def weight_after_down(model) -> None:
    """NeMo's MoE with its ``apply_router_weight_after_down`` (ours: each expert's output times
    its routing weight in float32, so that the weights stay out of the expert-parallel
    exchange; NeMo's default multiplies the SwiGLU before ``w2``: the same function, other
    float32 roundings, which move the Engram model's embedding gradient by 1.4e-5 of its
    largest entry, past GRADIENT_TOLERANCE, and the backbone's gradients by 1e-6)."""
    for layer in model.model.layers.values():
        layer.ffn.experts.config.apply_router_weight_after_down = True


def nemo_model(ids: torch.Tensor, targets: torch.Tensor, engram: bool, relabeled: bool = False):
    """NeMo's model on the tiny preset's fields (the same names), its logits and the gradients
    of the mean cross entropy; `relabeled`: the same model relabeled (`relabel`), the logits
    in the original order (the experts', the gate's and the output layer's gradients not)."""
    from engram_train.engram.variant import v41_engram_args
    from engram_train.models.deepseek_v41.v41_config import V41_FIELDS

    ours = tiny_config(engram=True)  # the Engram fields, also when NeMo's are dropped
    backbone = {k: v for k, v in tiny_model_section().items()
                if k in V41_FIELDS and k != "hidden_size"}
    # the Engram fields under V4.1's names (engram/variant.py's map), rows the primes' sums
    text = ref.text_config(v41_engram_args(ours), ours.hidden_size, **backbone).to_dict()
    if not engram:
        text.update(engram_layer_ids=[], engram_num_embeddings=[])
    model = nemo_weights_moved(text)
    weight_after_down(model)
    vocab = model.config.text_config.vocab_size
    restore = torch.arange(vocab)
    if relabeled:
        order = torch.randperm(vocab, generator=torch.Generator().manual_seed(1))
        relabel(model, order)
        restore[order] = torch.arange(vocab)  # new row restore[t] holds the old row t
        targets = restore[targets]
    logits = model(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))
    loss.backward()
    return {"state_dict": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "logits": logits.detach()[..., restore], "loss": loss.item(), "vocab": vocab,
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
        ours.update({f"layers.{i}.engram.{ENGRAM_NAMES[k[len('engram.'):]]}": v
                     for k, v in state.items() if k.startswith("engram.")})
    return ours


def nemo_grad_name(name: str):
    """Our parameter name -> (NeMo's, the gradient's transform)."""
    top = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
           "final_norm.weight": "model.norm.weight", "output_layer.weight": "lm_head.weight"}
    if name in top:
        return top[name], identity
    i, rest = re.fullmatch(r"layers\.(\d+)\.(.+)", name).groups()
    if rest.startswith("engram."):
        theirs = {v: k for k, v in ENGRAM_NAMES.items()}[rest[len("engram."):]]
        return f"model.layers.{i}.engram.{theirs}", identity
    nemo_name, transform = layer_grad_name(rest)
    return f"model.layers.{i}.{nemo_name}", transform


@pytest.fixture(scope="module")
def inputs():
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 4000, (BATCH, SEQ + 1), generator=generator)  # the demo's 4,096
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


@pytest.fixture(scope="module")
def nemo(inputs):
    import torch.distributed as dist

    assert not dist.is_initialized()  # else NeMo's tables take the world as their owners
    with ref.side():
        return {engram: dict(nemo_model(*inputs, engram),
                             relabeled=nemo_model(*inputs, engram, relabeled=True))
                for engram in (False, True)}


def our_model(vocab: int, engram: bool):
    from engram_train.models.builder import build_gpt_model

    return build_gpt_model(tiny_config(engram), vocab, SEQ)


def test_tiny_schedule_has_every_layer_kind():
    from engram_train.models.deepseek_v41.v41_args import DeepseekV41BackboneArgs
    from engram_train.models.deepseek_v41.v41_config import V41_FIELDS

    section = tiny_model_section()
    args = DeepseekV41BackboneArgs(**{k: v for k, v in section.items() if k in V41_FIELDS})
    kinds = [args.role(i).kind for i in range(args.num_hidden_layers)]
    assert kinds == ["window", "full", "reindex", "reuse", "full", "reuse", "reindex"]
    assert sorted(set(args.compress_ratios)) == [0, 1, 2]
    assert args.index_topk < args.candidate_topk_blocks * args.candidate_block_size


@pytest.mark.parametrize("engram", [False, True], ids=["backbone", "engram"])
def test_model_matches_nemo(nemo, inputs, one_rank, engram):
    """The logits and every parameter's gradient of the mean cross entropy. (NeMo's model is
    built before torch.distributed starts: with a process group its Engram tables expect
    FSDP's sharding.)"""
    from engram_train.models.deepseek_v41.v41_model import DeepseekV41GPTModel

    from engram_train.engram.variant import build_hash_mapping

    ids, targets = inputs
    nemo = nemo[engram]
    model = our_model(nemo["vocab"], engram)
    assert isinstance(model, DeepseekV41GPTModel)
    assert [i for i, layer in enumerate(model.layers)
            if layer.engram is not None] == ([1, 3] if engram else [])
    missing, unexpected = model.load_state_dict(our_state_dict(nemo["state_dict"]), strict=False)
    assert not unexpected and all(k.endswith(("_extra_state", "multi_head_embedding.offsets"))
                                  for k in missing), (missing, unexpected)
    hash_ids = None
    if engram:
        hash_ids = torch.as_tensor(build_hash_mapping(model.config).hash_block(ids.numpy()))
    logits = model(ids, engram_hash_ids=hash_ids)  # [L, B, S, K], as the trainer's batches
    scale = nemo["logits"].abs().max().item()
    error = (logits - nemo["logits"]).abs().max().item()
    print(f"logits: max abs error {error:.2e} (logits up to {scale:.2f})")
    assert 0.5 < scale < 20 and error <= LOGIT_TOLERANCE
    # megatron's vocab-parallel cross entropy, per token [b, s]
    loss = model(ids, labels=targets, engram_hash_ids=hash_ids)
    assert loss.shape == (BATCH, SEQ)
    assert abs(loss.mean().item() - nemo["loss"]) <= 1e-6
    loss.mean().backward()
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            nemo_name, transform = nemo_grad_name(name)
            grads.setdefault(nemo_name, []).append(transform(p.grad))
    ill = MHC_ILL_CONDITIONED + (ENGRAM_ILL_CONDITIONED if engram else ())
    scales = {k: g for k, g in grads.items() if k.endswith(ill)}
    worst = assert_close_grads({k: g for k, g in grads.items() if k not in scales},
                               {k: g for k, g in nemo["grads"].items() if k not in scales},
                               GRADIENT_TOLERANCE)
    worst_scale = assert_close_grads(scales, {k: nemo["grads"][k] for k in scales},
                                     SCALE_GRADIENT_TOLERANCE)
    relabeled = nemo["relabeled"]  # NeMo against itself: the same forward bits
    assert torch.equal(relabeled["logits"], nemo["logits"])
    # the same logits; the loss sums them in the permuted vocabulary's order (last bits)
    assert abs(relabeled["loss"] - nemo["loss"]) <= 1e-6
    spread = assert_close_grads({k: [relabeled["grads"][k]] for k in scales},
                                {k: nemo["grads"][k] for k in scales}, float("inf"))
    print(f"gradients: worst relative error {worst:.2e} over {len(grads) - len(scales)} "
          f"parameters, {worst_scale:.2e} over the {len(scales)} mHC scales (NeMo relabeled "
          f"against NeMo: {spread:.2e})")
    # the scales' float32 gradients are not determined to 1e-5: when NeMo's own spread falls
    # below it, the scales take GRADIENT_TOLERANCE like every other parameter
    assert spread > GRADIENT_TOLERANCE and worst_scale <= 2 * spread, (spread, worst_scale)
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen and all(".attn.indexer." in n for n in frozen)  # NeMo's frozen indexer


def test_trainer_runs_the_tiny_preset_with_a_falling_loss(tmp_path):
    """``model=deepseek_v41_tiny`` (Engram on) through the trainer on the shipped corpus: one
    process, 20 steps; megatron's schedule and optimizer, the Engram table optimizer."""
    import json
    import os
    import sys

    from launch import REPO, free_port, run_process

    exp = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1",
           f"--master-port={free_port()}", "-m", "engram_train.train", "model=deepseek_v41_tiny",
           f"experiment.exp_dir={exp}", "train.train_iters=20", "train.global_batch_size=4",
           "train.micro_batch_size=4", "train.seq_length=64", "train.log_interval=5",
           "train.eval_interval=null", "train.lr_warmup_iters=3"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = run_process(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    records = [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    losses = [r["lm_loss"] for r in records]
    assert [r["iteration"] for r in records] == [5, 10, 15, 20]
    assert losses[-1] < losses[0] - 0.5, losses
    assert all("engram wait (ms)" in line for line in proc.stdout.splitlines()
               if " iteration " in line and "lm loss:" in line)


@pytest.mark.parametrize("overrides, world, match", [
    (["system.tensor_model_parallel_size=2", "system.sequence_parallel=false"], 2,
     r"tensor_model_parallel_size > 1 needs sequence parallelism"),
    (["system.pipeline_model_parallel_size=2"], 2,  # 7 layers: no even split over 2 stages
     r"num_layers=7 must be divisible by system.pipeline_model_parallel_size=2"),
    (["system.expert_model_parallel_size=8", "train.micro_batch_size=1"], 8,
     r"num_moe_experts=4 must be divisible by"),
    (["system.context_parallel_size=2", "+model.attention_impl=dense"], 2,
     r"context_parallel_size=2 with attention_impl=dense"),
    (["+model.num_layers=4"], 1, r"unknown keys \['num_layers'\] for model_family=deepseek_v41"),
    (["+model.enable_hyper_connections=true"], 1, r"V4.1 always runs its own single-pass mHC"),
    (["model.model_family=deepseek_v5"], 1, r"model_family='deepseek_v5' is not a model family"),
    (["model.compress_ratios=[0,2,2,2,1,1]"], 1, r"compress_ratios has 6 entries"),
    (["data.reset_position_ids=true"], 1, r"reset_position_ids=true with model_family=deepseek"),
])
def test_what_the_v41_config_refuses(overrides, world, match):
    from test_presets import _cfg

    from engram_train.errors import ConfigError
    from engram_train.training.run_config import validate_run_config

    with pytest.raises(ConfigError, match=match):
        validate_run_config(_cfg(["model=deepseek_v41_tiny", *overrides]), world)


def test_family_fields_of_both_families():
    """V3 presets leave ``model_family`` at deepseek_v3; a V4.1 preset's megatron view."""
    from test_presets import _cfg

    from engram_train.config.family import model_family
    from engram_train.training.run_config import build_transformer_config, validate_run_config

    assert model_family(build_transformer_config(_cfg([]))) == "deepseek_v3"
    config = validate_run_config(_cfg(["model=deepseek_v41_tiny"]), 2)  # data-parallel
    assert model_family(config) == "deepseek_v41"
    assert (config.num_layers, config.num_moe_experts, config.moe_router_topk,
            config.layernorm_epsilon, config.engram_hc_mult) == (7, 4, 2, 1e-20, 4)
    assert config.deepseek_v41.compress_ratios == (0, 2, 2, 2, 1, 1, 1)


def test_single_pass_mhc_keeps_the_saved_bytes_rule():
    """docs/mhc.md's rule for the single-pass variant: a sublayer's mapping and write-back keep X
    and y in their own dtype, ``(n + 1) h 2`` bytes per token in bf16, plus the float32 ``post``
    and ``comb`` (``(n + n^2) 4`` bytes); the collapse keeps X and ``pre`` only."""
    from engram_train.models.deepseek_v41.v41_hyper_connection import (
        DeepseekV41HyperConnection,
        collapse,
        expand,
    )

    n, h = 4, 256
    hc = DeepseekV41HyperConnection(h, n)

    def saved_bytes(tokens: int, part: str) -> int:
        streams = torch.randn(tokens, 1, n, h, dtype=torch.bfloat16, requires_grad=True)
        output = torch.randn(tokens, 1, h, dtype=torch.bfloat16, requires_grad=True)
        pre = torch.rand(tokens, 1, n, requires_grad=True)
        storages = {}

        def pack(t):
            if not isinstance(t, torch.nn.Parameter):
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if part == "mapping":
                expand(output, streams, hc(streams))
            else:
                collapse(streams, pre)
        return sum(storages.values())

    per_token = {part: (saved_bytes(64, part) - saved_bytes(32, part)) // 32
                 for part in ("mapping", "collapse")}
    assert per_token == {"mapping": (n + 1) * h * 2 + (n + n * n) * 4,
                         "collapse": n * h * 2 + n * 4}, per_token


def test_engram_plan_plans_v41(one_rank):
    """engram-plan plans V4.1 (tests/test_memory_plan_v41.py has the rest); a layout the trainer
    does not run yet is planned with a note saying so."""
    from test_presets import _cfg

    from engram_train.memory_plan.plan_cli import make_plan

    cfg = _cfg(["model=deepseek_v41_flash", "train.micro_batch_size=1",
                "train.global_batch_size=64"])
    plan = make_plan(cfg, 64, 8, vocab_size=129280).to_json()
    assert plan["layout"]["dp"] == 64 and "notes" not in plan
    assert plan["breakdown"]["stage0"]["items"]["moe"]["bytes"] > 0

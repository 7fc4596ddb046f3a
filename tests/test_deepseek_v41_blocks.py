"""DeepSeek-V4.1's backbone blocks against NeMo Automodel 0.7.0's, run in this process.

Each block (`engram_train.models.deepseek_v41`) gets NeMo's weights through a name map, with
the norms, sinks, mHC parameters and the router's correction bias moved away from their init,
and must agree in float32 on the CPU: the forward within 1e-6 (max abs), every gradient within
1e-5 of the largest, the CSA2 selections and candidates equal; the 8-layer stack, where the
blocks' last-bit differences compound, within 1e-6 of its largest output and 5e-5 for gradients. NeMo comes from the side folder
``.v41-ref`` (tests/v41_reference.py; without it these tests fail and name ``make v41-ref``).
Inputs are batch-first on NeMo's side, sequence-first on ours.
"""

from __future__ import annotations

import functools

import pytest
import torch

import v41_reference as ref
from engram_train.errors import ConfigError, InputError
from engram_train.models.deepseek_v41.v41_args import DeepseekV41BackboneArgs
from engram_train.models.deepseek_v41.v41_attention import DeepseekV41Attention
from engram_train.models.deepseek_v41.v41_csa import CSAState, candidate_mask
from engram_train.models.deepseek_v41.v41_hyper_connection import collapse, first_pre
from engram_train.models.deepseek_v41.v41_layer import DeepseekV41Layer
from engram_train.models.deepseek_v41.v41_moe import DeepseekV41MoE
from engram_train.models.deepseek_v41.v41_primitives import (
    apply_rope,
    fake_quantize,
    layer_frequencies,
    rope_angles,
)

FORWARD_TOLERANCE = 1e-6  # max abs
GRADIENT_TOLERANCE = 1e-5  # max abs over the gradient's max abs
# the 8-layer stack compounds the blocks' last-bit differences over 16 sublayers (measured:
# forward 2.9e-7 of the output's max, gradients up to 9e-6 of their max, in mHC's `scale`)
STACK_TOLERANCE = {"forward": 1e-6, "gradient": 5e-5}
SEQ, BATCH, HIDDEN = 24, 2, 64
# 8 layers, every CSA2 role: window, full (ratio 2), reindex, reuse, full (ratio 1, candidate
# source), reuse, reindex inside the candidates, reuse
FIELDS = dict(
    hidden_size=HIDDEN, num_hidden_layers=8, num_attention_heads=4, head_dim=64,
    qk_rope_head_dim=16, q_lora_rank=32, o_lora_rank=32, o_groups=2, sliding_window=8,
    compress_ratios=[0, 2, 2, 2, 1, 1, 1, 1], kv_source_layer_ids=[1, 4],
    index_source_layer_ids=[1, 2, 4, 6], index_n_heads=2, index_head_dim=32, index_topk=4,
    candidate_source_layer_id=4, candidate_topk_blocks=3, candidate_block_size=2,
    moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=3, hc_mult=4,
)
ARGS = DeepseekV41BackboneArgs(**FIELDS)
KINDS = ["window", "full", "reindex", "reuse", "full", "reuse", "reindex", "reuse"]


def padding_mask() -> torch.Tensor:
    """[b, s] bool: row 1 right-padded from token 19 (a ratio-2 run half padding)."""
    valid = torch.ones(BATCH, SEQ, dtype=torch.bool)
    valid[1, 19:] = False
    return valid


def weights(shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# --- NeMo's side (inside ref.side(); plain tensors leave it) -------------------------------------


def nemo_backend():
    from nemo_automodel.components.models.common import BackendConfig

    return BackendConfig(attn="eager", linear="torch", rms_norm="torch_fp32", rope="torch",
                         experts="torch", dispatcher="torch")


def nemo_config():
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41TextConfig

    return DeepseekV41TextConfig(vocab_size=64, engram_layer_ids=[], engram_num_embeddings=[],
                                 num_nextn_predict_layers=0, dspark_noise_token_id=0,
                                 dtype="float32", **FIELDS)


def nemo_moe_config():
    from nemo_automodel.components.moe.config import MoEConfig

    return MoEConfig(
        dim=HIDDEN, inter_dim=32, moe_inter_dim=32, n_routed_experts=8, n_shared_experts=1,
        n_activated_experts=3, n_expert_groups=0, n_limited_groups=0, train_gate=True,
        gate_bias_update_factor=0.0, aux_loss_coeff=0.0, score_func="sqrtsoftplus",
        route_scale=1.5, norm_topk_prob=True, router_weights_fp32=True,
        force_e_score_correction_bias=True, swiglu_limit=10.0, dtype=torch.float32)


def eager_experts(moe) -> None:
    """NeMo's clamped SwiGLU is ``torch.compile``d (fullgraph, which a CPU without a compiler
    cannot build); its eager function computes the same."""
    from nemo_automodel.components.moe import experts

    function = experts.swiglu_clamped_deepep
    moe.experts.expert_activation_grouped = functools.partial(
        getattr(function, "__wrapped__", function), limit=10.0)


@torch.no_grad()
def perturb(module, seed: int) -> None:
    """Norms, sinks, mHC parameters and correction biases away from their init."""
    g = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        noise = torch.randn(p.shape, generator=g)
        if "norm" in name or name.endswith(("base", "scale")):
            p.add_(0.2 * noise)
        elif "sinks" in name:
            p.copy_(noise)
        elif name.endswith(".fn"):
            p.mul_(5)
    for name, b in module.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.3 * torch.randn(b.shape, generator=g))


def packed_documents() -> torch.Tensor:
    """[b, s] document ids: row 0 three documents starting at 0, 7 and 17 (not on ratio-2
    runs' starts), row 1 two starting at 0 and 8, then right padding (0) from token 19."""
    documents = torch.zeros(BATCH, SEQ, dtype=torch.long)
    documents[0, :7], documents[0, 7:17], documents[0, 17:] = 1, 2, 3
    documents[1, :8], documents[1, 8:19] = 1, 2
    return documents


def local_positions(documents: torch.Tensor) -> torch.Tensor:
    """[b, s] positions inside each document (NeMo's packed ``position_ids``)."""
    positions = torch.zeros_like(documents)
    for row in range(documents.shape[0]):
        for i in range(1, documents.shape[1]):
            same = documents[row, i] == documents[row, i - 1]
            positions[row, i] = positions[row, i - 1] + 1 if same else 0
    return positions


def nemo_attention_stack(valid, seq: int = SEQ, documents=None):
    """NeMo's attention for layers 0..7 chained, and the gradients of a fixed loss; with
    `documents`, packed (``packed_seq_ids``, document-local positions)."""
    from nemo_automodel.components.models.deepseek_v41.attention import (
        DeepseekV41Attention as NemoAttention,
        DeepseekV41AttentionState,
    )

    torch.manual_seed(0)
    config, backend = nemo_config(), nemo_backend()
    layers = [NemoAttention(config, i, backend) for i in range(8)]
    for i, layer in enumerate(layers):
        layer.reset_parameters(0.05)
        perturb(layer, i)
    inputs = [weights((BATCH, seq, HIDDEN), 100 + i).requires_grad_() for i in range(8)]
    positions = (torch.arange(seq).expand(BATCH, -1) if documents is None
                 else local_positions(documents))
    mask = None if valid is None else valid.long()
    state, outputs, states = DeepseekV41AttentionState(), [], []
    for layer, x in zip(layers, inputs):
        out = layer(x, position_ids=positions, state=state, attention_mask=mask,
                    packed_seq_ids=documents)
        state = out.state
        outputs.append(out.hidden_states)
        states.append(state)
    sum((o * weights(o.shape, 200 + i)).sum() for i, o in enumerate(outputs)).backward()
    return {
        "state_dicts": [{k: v.detach().clone() for k, v in layer.state_dict().items()}
                        for layer in layers],
        "inputs": [x.detach() for x in inputs], "outputs": [o.detach() for o in outputs],
        "input_grads": [x.grad for x in inputs],
        "grads": [{k: p.grad for k, p in layer.named_parameters() if p.grad is not None}
                  for layer in layers],
        "topk": [s.topk_indices for s in states], "candidates": [s.candidates for s in states],
        "compressed_kv": [None if s.compressed_kv is None else s.compressed_kv.detach()
                          for s in states],
    }


def nemo_moe(valid):
    from nemo_automodel.components.models.deepseek_v4.config import DeepseekV4Config
    from nemo_automodel.components.models.deepseek_v4.model import DeepseekV4VisionGate
    from nemo_automodel.components.moe.layers import MoE

    torch.manual_seed(1)
    config = nemo_moe_config()
    moe = MoE(config, nemo_backend())
    moe.gate = DeepseekV4VisionGate(DeepseekV4Config(vocab_size=64), config,
                                    gate_precision=torch.float32, hash_routing=False)
    eager_experts(moe)
    with torch.no_grad():
        moe.init_weights(torch.device("cpu"), init_std=0.3)
        moe.experts.down_projs.mul_(0.01)  # large SwiGLU inputs (clamped), outputs of order 1
        moe.shared_experts.down_proj.weight.mul_(0.01)
    perturb(moe, 7)
    x = (3 * weights((BATCH, SEQ, HIDDEN), 300)).requires_grad_()
    out = moe(x, None if valid is None else ~valid)
    (out * weights(out.shape, 301)).sum().backward()
    return {"state_dict": {k: v.detach().clone() for k, v in moe.state_dict().items()},
            "input": x.detach(), "output": out.detach(), "input_grad": x.grad,
            "grads": {k: p.grad for k, p in moe.named_parameters()}}


def nemo_layer_stack(valid):
    """NeMo's ``DeepseekV41Block`` for layers 0..7 (no Engram) on random streams, then the
    final collapse with the last ``pre``."""
    from nemo_automodel.components.models.deepseek_v41.attention import DeepseekV41AttentionState
    from nemo_automodel.components.models.deepseek_v41.layers import DeepseekV41HyperConnection
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41Block

    torch.manual_seed(2)
    config, backend = nemo_config(), nemo_backend()
    blocks = [DeepseekV41Block(config, i, backend, nemo_moe_config()) for i in range(8)]
    with torch.no_grad():
        for i, block in enumerate(blocks):
            block.attn.reset_parameters(0.05)
            block.ffn.init_weights(torch.device("cpu"), init_std=0.05)
            block.attn_hc.reset_parameters(0.05)
            block.ffn_hc.reset_parameters(0.05)
            eager_experts(block.ffn)
            perturb(block, 10 + i)
    streams = weights((BATCH, SEQ, 4, HIDDEN), 400).requires_grad_()
    pre = torch.zeros(BATCH, SEQ, 4)
    pre[..., 0] = 1
    positions = torch.arange(SEQ).expand(BATCH, -1)
    mask = None if valid is None else valid.long()
    x, state = streams, DeepseekV41AttentionState()
    for block in blocks:
        x, pre, state = block(x, pre, state, position_ids=positions, attention_mask=mask)
    out = DeepseekV41HyperConnection.collapse(x, pre)
    (out * weights(out.shape, 401)).sum().backward()
    return {"state_dicts": [{k: v.detach().clone() for k, v in b.state_dict().items()}
                            for b in blocks],
            "input": streams.detach(), "output": out.detach(), "pre": pre.detach(),
            "input_grad": streams.grad,
            "grads": [{k: p.grad for k, p in b.named_parameters() if p.grad is not None}
                      for b in blocks]}


def nemo_hyper_connection():
    """NeMo's mHC mapping of one sublayer, and the collapse and write-back around a stand-in
    sublayer output."""
    from nemo_automodel.components.models.deepseek_v41.layers import DeepseekV41HyperConnection

    hc = DeepseekV41HyperConnection(nemo_config())
    perturb(hc, 20)
    streams = weights((BATCH, SEQ, 4, HIDDEN), 500).requires_grad_()
    output = weights((BATCH, SEQ, HIDDEN), 501).requires_grad_()
    pre = torch.softmax(weights((BATCH, SEQ, 4), 502), -1)
    mix = hc(streams)
    collapsed = hc.collapse(streams, pre)
    expanded = hc.expand(output, streams, mix)
    loss = sum((t * weights(t.shape, 510 + i)).sum()
               for i, t in enumerate((mix.pre, mix.post, mix.comb, collapsed, expanded)))
    loss.backward()
    return {"state_dict": {k: v.detach().clone() for k, v in hc.state_dict().items()},
            "streams": streams.detach(), "output": output.detach(), "pre": pre,
            "results": [t.detach() for t in (mix.pre, mix.post, mix.comb, collapsed, expanded)],
            "streams_grad": streams.grad, "output_grad": output.grad,
            "grads": {k: p.grad for k, p in hc.named_parameters()}}


@pytest.fixture(scope="module")
def nemo():
    """Every NeMo result the tests compare with, computed once."""
    with ref.side():
        return {
            "attention": nemo_attention_stack(None),
            "attention_padded": nemo_attention_stack(padding_mask()),
            "attention_odd": nemo_attention_stack(None, SEQ - 1),
            "attention_packed": nemo_attention_stack(packed_documents() > 0,
                                                     documents=packed_documents()),
            "moe": nemo_moe(None), "moe_padded": nemo_moe(padding_mask()),
            "layers": nemo_layer_stack(None), "layers_padded": nemo_layer_stack(padding_mask()),
            "mhc": nemo_hyper_connection(),
        }


# --- name maps NeMo -> ours ----------------------------------------------------------------------


def attention_state_dict(nemo_state: dict) -> dict:
    return {("attn_sink" if k == "sinks_param.weight" else k): v for k, v in nemo_state.items()}


def moe_state_dict(nemo_state: dict, prefix: str = "") -> dict:
    """NeMo's fused ``gate_and_up_projs [E, h, 2I]`` / ``down_projs [E, I, h]`` -> our stacked
    ``w1``/``w3`` ``[E, I, h]`` and ``w2`` ``[E, h, I]``; the shared expert's names; no
    ``bias_vl`` (the image tokens' bias)."""
    gate_up = nemo_state[f"{prefix}experts.gate_and_up_projs"]
    inter = gate_up.shape[-1] // 2
    ours = {
        f"{prefix}gate.weight": nemo_state[f"{prefix}gate.weight"],
        f"{prefix}gate.e_score_correction_bias":
            nemo_state[f"{prefix}gate.e_score_correction_bias"],
        f"{prefix}experts.w1": gate_up[..., :inter].transpose(1, 2),
        f"{prefix}experts.w3": gate_up[..., inter:].transpose(1, 2),
        f"{prefix}experts.w2": nemo_state[f"{prefix}experts.down_projs"].transpose(1, 2),
    }
    for nemo_name, our_name in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
        ours[f"{prefix}shared_experts.{our_name}.weight"] = \
            nemo_state[f"{prefix}shared_experts.{nemo_name}.weight"]
    return ours


def layer_state_dict(nemo_state: dict) -> dict:
    ours = moe_state_dict(nemo_state, "ffn.")
    for k, v in nemo_state.items():
        if k.startswith(("attn.", "attn_norm.", "ffn_norm.", "attn_hc.", "ffn_hc.")):
            ours["attn.attn_sink" if k == "attn.sinks_param.weight" else k] = v
    return ours


def mapped_grads(module, mapping) -> dict:
    """Our gradients under NeMo's names: `mapping(our name) -> (nemo name, transform)`."""
    out = {}
    for name, p in module.named_parameters():
        if p.grad is not None:
            nemo_name, transform = mapping(name)
            out.setdefault(nemo_name, []).append(transform(p.grad))
    return out


def assert_close_grads(ours: dict, theirs: dict, tolerance: float = GRADIENT_TOLERANCE) -> float:
    """Every gradient of NeMo's within `tolerance` of ours (relative to its max)."""
    worst = 0.0
    assert set(ours) == set(theirs), set(ours) ^ set(theirs)
    for name, grad in theirs.items():
        mine = ours[name]
        mine = mine[0] if len(mine) == 1 else torch.cat(mine, dim=-1)
        error = ((mine - grad).abs().max() / grad.abs().max().clamp_min(1e-30)).item()
        assert error <= tolerance, (name, error)
        worst = max(worst, error)
    return worst


def megatron_config():
    from megatron.core.model_parallel_config import ModelParallelConfig

    return ModelParallelConfig(use_cpu_initialization=True, perform_initialization=False,
                               params_dtype=torch.float32)


def seq_first(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1)


def max_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return (ours - theirs).abs().max().item()


def identity(grad):
    return grad


# --- the pieces ----------------------------------------------------------------------------------


def quantization_inputs() -> torch.Tensor:
    """Random values over many scales, exact FP4 midpoints and levels times powers of two,
    zeros, and blocks at the scales' floors."""
    g = torch.Generator().manual_seed(3)
    spread = torch.randn(64, 64, generator=g) * torch.logspace(-6, 4, 64).unsqueeze(-1)
    levels = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0,
                           5.0, 6.0, -0.25, -0.75, -2.5, -5.0, 6.0, 1e-3, -1e-3, 0.3, 448.0,
                           -448.0, 240.0, 0.0, 0.0, 2.0 ** -10, 3.0, 4.5, 5.5])
    crafted = torch.stack([levels * 2.0 ** e for e in range(-8, 8)]).repeat(1, 2)
    tiny = torch.full((4, 64), 1e-9)
    return torch.cat((spread, crafted, tiny, torch.zeros(4, 64)))


def test_fake_quantization_matches_nemo_bitwise_and_passes_the_gradient():
    x = quantization_inputs()
    with ref.side():
        from nemo_automodel.components.models.deepseek_v41.quantization import quantize_cache

        expected = {(fmt, block): quantize_cache(x, format=fmt, block_size=block)
                    for fmt, block in (("fp8", 32), ("mxfp4", 32), ("nvfp4", 16))}
    for (fmt, block), theirs in expected.items():
        ours = fake_quantize(x, fmt, block)
        assert torch.equal(ours, theirs), (fmt, max_error(ours, theirs))
        leaf = x.clone().requires_grad_()
        grad = weights(x.shape, 4)
        fake_quantize(leaf, fmt, block).backward(grad)
        assert torch.equal(leaf.grad, grad)  # straight through
    with pytest.raises(InputError, match="multiple of the block"):
        fake_quantize(torch.zeros(2, 40), "fp8", 32)
    with pytest.raises(InputError, match="format"):
        fake_quantize(x, "int8", 32)


def test_rope_matches_nemo_bitwise():
    """Both bases (YaRN on the compressed layers only), heads or not, the inverse rotation."""
    x = weights((BATCH, SEQ, 4, 64), 5)
    with ref.side():
        from nemo_automodel.components.models.deepseek_v41.attention import (
            _apply_rope,
            _RotaryEmbedding,
        )

        positions = torch.arange(SEQ).expand(BATCH, -1)
        expected = {}
        for compressed in (False, True):
            angles = _RotaryEmbedding(nemo_config(), compressed=compressed)(positions)
            expected[compressed] = (angles, _apply_rope(x, angles),
                                    _apply_rope(x[:, :, 0], angles, inverse=True))
    for compressed, (angles, rotated, inverse) in expected.items():
        ours = rope_angles(torch.arange(SEQ), layer_frequencies(ARGS, compressed))
        assert torch.equal(ours, angles[0])
        assert torch.equal(seq_first(apply_rope(seq_first(x), ours)), rotated)
        assert torch.equal(seq_first(apply_rope(seq_first(x[:, :, 0]), ours, inverse=True)),
                           inverse)


def test_released_schedule_roles():
    args = DeepseekV41BackboneArgs()
    kinds = [args.role(i).kind for i in range(args.num_hidden_layers)]
    assert kinds[:3] == ["window", "window", "full"] and kinds[3:8] == ["reuse"] * 5
    assert [i for i, k in enumerate(kinds) if k == "full"] == [2, 8, 14, 20]
    assert [i for i, k in enumerate(kinds) if k == "reindex"] == [24, 28, 32, 36]
    assert args.role(20).candidate_source and not args.role(20).uses_candidates
    assert args.role(24).uses_candidates and not args.role(14).uses_candidates
    assert [args.role(i).compress_ratio for i in (2, 19, 20, 39)] == [2, 2, 1, 1]


@pytest.mark.parametrize("change, message", [
    (dict(kv_source_layer_ids=[1, 4], index_source_layer_ids=[4]), "not in index_source"),
    (dict(compress_ratios=[0, 2, 2, 1, 1, 1, 1, 1]), "no kv source of the same ratio"),
    (dict(compress_ratios=[2, 2, 2, 2, 1, 1, 1, 1]), "no kv source of the same ratio"),
    (dict(index_source_layer_ids=[0, 1, 4]), "window only"),
    (dict(candidate_source_layer_id=2), "candidate_source_layer_id"),
    (dict(candidate_source_layer_id=1), "candidates"),
    (dict(compress_ratios=[0, 2]), "one ratio per layer"),
    (dict(head_dim=48), "multiple of 32"),
    (dict(num_attention_heads=3), "multiple of o_groups"),
    (dict(n_shared_experts=2), "exactly one"),
    (dict(scoring_func="sigmoid"), "sqrtsoftplus"),
])
def test_schedules_the_blocks_cannot_run_are_refused(change, message):
    with pytest.raises(ConfigError, match=message):
        DeepseekV41BackboneArgs(**{**FIELDS, **change})


# --- the blocks ----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["attention", "attention_padded", "attention_odd",
                                  "attention_packed"],
                         ids=["full", "right_padding", "incomplete_last_run", "packed"])
def test_attention_and_csa2_match_nemo(one_rank, nemo, case):
    """Eight layers, every CSA2 role, chained through the state: outputs, the selections and
    candidates, the compressed KV, and the gradients of the inputs and of every parameter;
    with right padding, with a sequence whose last ratio-2 run is incomplete, and packed
    (documents starting off the runs' starts, and padding)."""
    result = nemo[case]
    valid = seq_first(padding_mask()) if case == "attention_padded" else None
    documents = None
    if case == "attention_packed":
        documents = seq_first(packed_documents())
        valid = documents > 0
    layers = [DeepseekV41Attention(ARGS, i, megatron_config()) for i in range(8)]
    assert [layer.role.kind for layer in layers] == KINDS
    for layer, state_dict in zip(layers, result["state_dicts"]):
        layer.load_state_dict(attention_state_dict(state_dict))
    inputs = [seq_first(x).clone().requires_grad_() for x in result["inputs"]]
    state, loss = CSAState(), 0
    for i, (layer, x) in enumerate(zip(layers, inputs)):
        out, state = layer(x, state, valid, documents)
        assert max_error(seq_first(out), result["outputs"][i]) <= FORWARD_TOLERANCE, i
        if result["topk"][i] is None:
            assert state.topk_indices is None
        else:
            assert torch.equal(seq_first(state.topk_indices), result["topk"][i]), i
            assert torch.equal(seq_first(state.compressed_kv), result["compressed_kv"][i]), i
        if result["candidates"][i] is not None:  # ours: block ids; NeMo's: the keys' mask
            width, s = state.compressed_kv.shape[0], x.shape[0]
            keys = candidate_mask(state.candidates, width, ARGS.candidate_block_size)
            visible = torch.arange(width) < ((torch.arange(s) + 1) // state.compression_ratio
                                             ).view(-1, 1, 1)  # NeMo's mask is of these only
            if state.compressed_valid is not None:
                visible = visible & state.compressed_valid.t().unsqueeze(0)
            if documents is not None:
                query_doc = documents.unsqueeze(-1)
                visible = visible & (query_doc == state.compressed_documents.t().unsqueeze(0))
                visible = visible & (query_doc > 0)
            assert torch.equal(seq_first(keys & visible), result["candidates"][i]), i
        loss = loss + (seq_first(out) * weights(result["outputs"][i].shape, 200 + i)).sum()
    assert (seq_first(state.topk_indices) >= 0).sum() > (seq_first(state.topk_indices) < 0).sum()
    loss.backward()
    for x, grad in zip(inputs, result["input_grads"]):
        assert max_error(seq_first(x.grad), grad) <= FORWARD_TOLERANCE
    for layer, grads in zip(layers, result["grads"]):
        ours = mapped_grads(layer, lambda n: ("sinks_param.weight" if n == "attn_sink" else n,
                                              identity))
        assert_close_grads(ours, grads)
    assert all(not p.requires_grad for layer in layers if layer.indexer is not None
               for p in layer.indexer.parameters())


def moe_grad_name(name: str, prefix: str = ""):
    stacked = {"experts.w1": "experts.gate_and_up_projs", "experts.w3": "experts.gate_and_up_projs",
               "experts.w2": "experts.down_projs"}
    shared = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    local = name.removeprefix(prefix)
    if local in stacked:
        return prefix + stacked[local], lambda grad: grad.transpose(1, 2)
    if local.startswith("shared_experts."):
        _, ours, rest = local.split(".", 2)
        return f"{prefix}shared_experts.{shared[ours]}.{rest}", identity
    return name, identity


@pytest.mark.parametrize("padded", [False, True], ids=["full", "right_padding"])
def test_moe_matches_nemo(one_rank, nemo, padded):
    """Routing (the correction bias moved: it picks other experts than the scores alone),
    clamped SwiGLU (inputs past the clamp), the shared expert, padding tokens skipping the
    routed experts; forward and every gradient."""
    result = nemo["moe_padded" if padded else "moe"]
    moe = DeepseekV41MoE(ARGS, megatron_config())
    moe.load_state_dict(moe_state_dict(result["state_dict"]))
    x = seq_first(result["input"]).clone().requires_grad_()
    out = moe(x, seq_first(padding_mask()) if padded else None)
    assert max_error(seq_first(out), result["output"]) <= FORWARD_TOLERANCE
    (seq_first(out) * weights(result["output"].shape, 301)).sum().backward()
    assert max_error(seq_first(x.grad), result["input_grad"]) <= FORWARD_TOLERANCE
    grads = {k: v for k, v in result["grads"].items() if v is not None}
    assert_close_grads(mapped_grads(moe, moe_grad_name), grads)
    with torch.no_grad():
        pre_activations = seq_first(result["input"]).reshape(-1, HIDDEN) @ moe.experts.w1[0].t()
    assert pre_activations.abs().max() > 10  # the clamp is exercised
    flat = seq_first(result["input"]).reshape(-1, HIDDEN)
    biased = moe.gate(flat)[1]
    unbiased = torch.sqrt(torch.nn.functional.softplus(flat @ moe.gate.weight.t())).topk(3)[1]
    assert not torch.equal(biased.sort(-1).values, unbiased.sort(-1).values)


def test_single_pass_mhc_matches_nemo(nemo):
    """One sublayer's mapping (pre, post, comb), the collapse and the write-back, and their
    gradients; the mapping uses the project mHC's projection and Sinkhorn."""
    from engram_train.models.deepseek_v41.v41_hyper_connection import (
        DeepseekV41HyperConnection,
        expand,
    )

    result = nemo["mhc"]
    hc = DeepseekV41HyperConnection(HIDDEN, 4, 20, 1e-6, ARGS.rms_norm_eps)
    hc.load_state_dict(result["state_dict"])
    streams = seq_first(result["streams"]).clone().requires_grad_()
    output = seq_first(result["output"]).clone().requires_grad_()
    mix = hc(streams)
    ours = (*mix, collapse(streams, seq_first(result["pre"])), expand(output, streams, mix))
    loss = 0
    for i, (mine, theirs) in enumerate(zip(ours, result["results"])):
        assert max_error(seq_first(mine), theirs) <= FORWARD_TOLERANCE, i
        loss = loss + (seq_first(mine) * weights(theirs.shape, 510 + i)).sum()
    loss.backward()
    assert max_error(seq_first(streams.grad), result["streams_grad"]) <= FORWARD_TOLERANCE
    assert max_error(seq_first(output.grad), result["output_grad"]) <= FORWARD_TOLERANCE
    assert_close_grads({k: [p.grad] for k, p in hc.named_parameters()}, result["grads"])
    assert torch.equal(first_pre(streams)[..., 0], torch.ones(SEQ, BATCH))


def layer_grad_name(name: str):
    if name == "attn.attn_sink":
        return "attn.sinks_param.weight", identity
    return moe_grad_name(name, "ffn.") if name.startswith("ffn.") else (name, identity)


@pytest.mark.parametrize("padded", [False, True], ids=["full", "right_padding"])
def test_layer_stack_matches_nemo(one_rank, nemo, padded):
    """NeMo's ``DeepseekV41Block`` x 8 (every CSA2 role, the single-pass mHC hand-over from
    layer to layer, stream 0 first, the last pre collapsing): forward and every gradient."""
    result = nemo["layers_padded" if padded else "layers"]
    layers = [DeepseekV41Layer(ARGS, i, megatron_config()) for i in range(8)]
    for layer, state_dict in zip(layers, result["state_dicts"]):
        layer.load_state_dict(layer_state_dict(state_dict))
    streams = seq_first(result["input"]).clone().requires_grad_()
    x, pre, state = streams, first_pre(streams), CSAState()
    for layer in layers:
        x, pre, state = layer(x, pre, state, seq_first(padding_mask()) if padded else None)
    out = collapse(x, pre)
    scale = result["output"].abs().max().item()  # ~7
    assert max_error(seq_first(out), result["output"]) <= STACK_TOLERANCE["forward"] * scale
    assert max_error(seq_first(pre), result["pre"]) <= FORWARD_TOLERANCE
    (seq_first(out) * weights(result["output"].shape, 401)).sum().backward()
    assert max_error(seq_first(streams.grad), result["input_grad"]) \
        <= GRADIENT_TOLERANCE * result["input_grad"].abs().max().item()
    for layer, grads in zip(layers, result["grads"]):
        assert_close_grads(mapped_grads(layer, layer_grad_name), grads,
                           STACK_TOLERANCE["gradient"])


def test_wrong_inputs_are_refused(one_rank):
    reuse = DeepseekV41Attention(ARGS, 3, megatron_config())
    x = torch.zeros(SEQ, BATCH, HIDDEN)
    with pytest.raises(InputError, match="needs the compressed KV of a full layer"):
        reuse(x, CSAState())
    with pytest.raises(InputError, match="valid must be a bool"):
        reuse(x, CSAState(), torch.ones(BATCH, SEQ, dtype=torch.bool))
    full = DeepseekV41Attention(ARGS, 1, megatron_config())
    _, state = full(x)
    with pytest.raises(InputError, match="another batch or sequence"):
        reuse(x[:, :1], state)
    layer = DeepseekV41Layer(ARGS, 0, megatron_config())
    with pytest.raises(InputError, match="pre must be float32"):
        layer(torch.zeros(SEQ, BATCH, 4, HIDDEN), torch.zeros(SEQ, BATCH, 4, dtype=torch.bfloat16))

"""DeepSeek-V4.1's sparse attention (``attention_impl: sparse``) against the dense oracle
(``attention_impl: dense``): the core function on random inputs (a float64 gradient check, and
float32 forward and gradients within 1e-6 of the largest value), every CSA2 layer kind chained
through the state at sequences 64 to 1024 with padding, and the causality of the model: a
prefix's logits equal the prefix's logits inside a longer sequence (the CSA2 selections' ties
once depended on the sequence's length).
"""

from __future__ import annotations

import pytest
import torch

from engram_train.models.deepseek_v41 import v41_sparse_attention as sparse_module
from engram_train.models.deepseek_v41.v41_args import DeepseekV41BackboneArgs
from engram_train.models.deepseek_v41.v41_csa import CSAState, ordered_top
from engram_train.models.deepseek_v41.v41_sparse_attention import sparse_attention

TOLERANCE = 1e-6  # float32, max abs error over the largest value


def dense_attention(query, kv, compressed, indices, documents, sink, window, scale):
    """The oracle: ``[b, H, s, s + t]`` scores, masked, softmax with the sink (the dense path's
    arithmetic, in query's dtype when float64)."""
    s, b = query.shape[:2]
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    offset = torch.arange(s).unsqueeze(1) - torch.arange(s).unsqueeze(0)
    mask = ((offset >= 0) & (offset < window)).unsqueeze(0).expand(b, s, s)
    if documents is not None:
        doc = documents.t()
        mask = mask & (doc.unsqueeze(1) == doc.unsqueeze(2)) & (doc != 0).unsqueeze(1)
    keys = kv
    if compressed is not None:
        t = compressed.shape[0]
        picks = indices.transpose(0, 1)
        picked = torch.zeros(b, s, t + 1, dtype=torch.bool).scatter(
            -1, torch.where(picks >= 0, picks, t), True)[..., :t]
        mask, keys = torch.cat((mask, picked), -1), torch.cat((kv, compressed), 0)
    logits = torch.einsum("sbhd,tbd->bhst", query.to(acc), keys.to(acc)) * scale
    logits = logits.masked_fill(~mask.unsqueeze(1), -torch.inf)
    sinks = sink.to(acc).view(1, -1, 1, 1).expand(b, -1, s, 1)
    probabilities = torch.cat((logits, sinks), -1).softmax(-1)[..., :-1]
    return torch.einsum("bhst,tbd->sbhd", probabilities, keys.to(acc)).to(query.dtype)


def random_case(s, b, heads, dim, t, k, documents, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def leaf(*shape):
        return torch.randn(*shape, generator=generator, dtype=dtype).requires_grad_()

    query, kv, compressed, sink = leaf(s, b, heads, dim), leaf(s, b, dim), leaf(t, b, dim), leaf(heads)
    picks = torch.stack([torch.randperm(t, generator=generator)[:k] for _ in range(s * b)])
    picks = picks.view(s, b, k).masked_fill(torch.rand(s, b, k, generator=generator) < 0.3, -1)
    docs = None
    if documents:  # three documents, then right padding (0)
        docs = torch.randint(1, 4, (s, b), generator=generator).sort(0).values
        docs[-max(1, s // 10):] = 0
    return query, kv, compressed, picks, docs, sink


def outputs_and_grads(fn, case, window, scale):
    query, kv, compressed, picks, docs, sink = case
    for leaf in (query, kv, compressed, sink):
        leaf.grad = None
    out = fn(query, kv, compressed, picks, docs, sink, window, scale)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=out.dtype)
    (out * weights).sum().backward()
    return [out.detach()] + [leaf.grad.clone() for leaf in (query, kv, compressed, sink)]


def relative_error(ours, theirs):
    return ((ours - theirs).abs().max() / theirs.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("s,b,heads,window,t,k,documents,block", [
    (64, 2, 4, 16, 32, 8, False, None),
    (333, 2, 3, 16, 50, 8, True, 32),
    (1024, 1, 2, 128, 512, 16, True, None),
], ids=["one_block", "documents_padding_blocks", "long"])
def test_core_matches_dense(monkeypatch, s, b, heads, window, t, k, documents, block):
    if block:  # force several query blocks
        monkeypatch.setattr(sparse_module, "WORKING_SET_BYTES",
                            4 * b * heads * block * (block + window + k))
    case = random_case(s, b, heads, 32, t, k, documents)
    dense = outputs_and_grads(dense_attention, case, window, 32 ** -0.5)
    sparse = outputs_and_grads(sparse_attention, case, window, 32 ** -0.5)
    errors = [relative_error(a, b_) for a, b_ in zip(sparse, dense)]
    assert max(errors) <= TOLERANCE, errors


def test_core_gradient_check_float64(monkeypatch):
    """The backward is the forward's derivative (finite differences in float64, three blocks)."""
    monkeypatch.setattr(sparse_module, "WORKING_SET_BYTES", 8 * 2 * 16 * (16 + 4 + 3))
    query, kv, compressed, picks, docs, sink = random_case(40, 1, 2, 4, 10, 3, True,
                                                           torch.float64)

    def run(query, kv, compressed, sink):
        return sparse_attention(query, kv, compressed, picks, docs, sink, 4, 0.5)

    assert torch.autograd.gradcheck(run, (query, kv, compressed, sink), fast_mode=True)
    dense = dense_attention(query, kv, compressed, picks, docs, sink, 4, 0.5)
    assert relative_error(run(query, kv, compressed, sink), dense) <= 1e-12


def test_ordered_top_breaks_ties_by_the_lower_index_whatever_the_width():
    scores = torch.tensor([[0.0, 0.5, 0.0, -0.0, 0.0, 0.5, -torch.inf]])
    assert sorted(ordered_top(scores, 3).tolist()[0]) == [0, 1, 5]
    assert ordered_top(scores, 4, sorted=True).tolist() == [[1, 5, 0, 2]]
    wide = torch.cat((scores, torch.full((1, 1000), -torch.inf)), dim=-1)
    assert sorted(ordered_top(wide, 3).tolist()[0]) == [0, 1, 5]


# --- every layer kind, chained ------------------------------------------------------------------

# window; full ratio 4; reuse 4; full ratio 2; reindex 2; full ratio 1 (candidate source);
# reuse 1; reindex inside the candidates
FIELDS = dict(
    hidden_size=64, num_hidden_layers=8, num_attention_heads=4, head_dim=64,
    qk_rope_head_dim=16, q_lora_rank=32, o_lora_rank=32, o_groups=2, sliding_window=16,
    compress_ratios=[0, 4, 4, 2, 2, 1, 1, 1], kv_source_layer_ids=[1, 3, 5],
    index_source_layer_ids=[1, 3, 4, 5, 7], index_n_heads=2, index_head_dim=32, index_topk=8,
    candidate_source_layer_id=5, candidate_topk_blocks=4, candidate_block_size=4,
    moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, hc_mult=4,
)
QUANTIZE = False
"""The stack compares the continuous model: with the FP8/FP4 fake quantization on, a 1e-7
relative perturbation of the inputs alone moves some parameter gradients by 2e-4 (codes flip),
far above any difference between two float32 summation orders (measured at s = 1024)."""
KINDS = ["window", "full", "reuse", "full", "reindex", "full", "reuse", "reindex"]


def attention_stack(impl: str):
    from megatron.core.transformer import TransformerConfig

    from engram_train.models.deepseek_v41.v41_attention import DeepseekV41Attention

    args = DeepseekV41BackboneArgs(**FIELDS, attention_impl=impl, fake_quantize=QUANTIZE)
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4,
                               params_dtype=torch.float32, perform_initialization=False)
    torch.manual_seed(0)
    layers = [DeepseekV41Attention(args, i, config) for i in range(8)]
    with torch.no_grad():
        for layer in layers:
            layer.reset_parameters(0.05)
            for name, param in layer.named_parameters():
                if "norm" in name:
                    param.uniform_(0.5, 1.5)
            layer.attn_sink.normal_(0, 0.5)
    return layers


@pytest.mark.parametrize("s,padded", [(64, False), (203, True), (1024, False)],
                         ids=["64", "203_padded", "1024"])
def test_every_layer_kind_matches_dense(one_rank, s, padded):
    """The eight layers chained through the CSA2 state, sparse against dense: every output,
    the selections, the input gradients and every parameter's gradient."""
    b = 2
    valid = None
    if padded:
        valid = torch.ones(s, b, dtype=torch.bool)
        valid[s - 37:, 1] = False
    inputs = torch.randn(8, s, b, 64, generator=torch.Generator().manual_seed(5))
    results = {}
    for impl in ("dense", "sparse"):
        layers = attention_stack(impl)
        assert [layer.role.kind for layer in layers] == KINDS
        xs = [x.clone().requires_grad_() for x in inputs]
        state, loss, outs, picks = CSAState(), 0, [], []
        for i, (layer, x) in enumerate(zip(layers, xs)):
            out, state = layer(x, state, valid)
            outs.append(out.detach())
            picks.append(state.topk_indices)
            loss = loss + (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(
                i))).sum()
        loss.backward()
        grads = [x.grad for x in xs] + [p.grad for layer in layers for p in layer.parameters()
                                        if p.grad is not None]
        results[impl] = outs, picks, grads
    (dense_out, dense_picks, dense_grads), (out, picks, grads) = results["dense"], results["sparse"]
    for ours, theirs in zip(picks, dense_picks):
        assert (ours is None and theirs is None) or torch.equal(ours, theirs)
    assert sum(p is not None and bool((p >= 0).any()) for p in picks) == 7
    errors = [relative_error(a, b_) for a, b_ in zip(out + grads, dense_out + dense_grads)]
    assert len(grads) == len(dense_grads) > 8 and max(errors) <= TOLERANCE, max(errors)


# --- the model: causality, packed documents -------------------------------------------------------


def tiny_model(**fields):
    """The tiny preset (Engram off, `fields` over it) in eval mode, its weights drawn from seed
    0 away from their init (norms around 1, sinks and router biases spread): the same weights
    for every `fields` that keeps the shapes."""
    from engram_train.models.builder import build_gpt_model
    from engram_train.models.deepseek_v41.v41_config import deepseek_v41_config
    from engram_train.models.presets import model_preset

    section = dict(model_preset("deepseek_v41_tiny"), use_engram=False, **fields)
    config = deepseek_v41_config(section, dict(params_dtype=torch.float32,
                                               perform_initialization=False))
    model = build_gpt_model(config, 4096, 256)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(torch.rand(param.shape, generator=generator) + 0.5)
            elif "sink" in name or "bias" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return model.eval()



def test_prefix_logits_equal_the_longer_sequences(one_rank):
    """The tiny preset (all CSA2 kinds, fake quantization on): logits of the first L tokens
    alone equal those positions' logits within 200 tokens (and other tokens after them change
    nothing). Before the selections' ties were defined, L = 24 moved by 0.065."""
    model = tiny_model()
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 4000, (1, 200), generator=generator)
    other = ids.clone()
    other[:, 24:] = torch.randint(0, 4000, (1, 176), generator=generator)
    with torch.no_grad():
        full, changed = model(ids, None, None), model(other, None, None)
        assert torch.equal(full[:, :24], changed[:, :24])
        for length in (24, 45, 64, 199):
            prefix = model(ids[:, :length], None, None)
            assert (full[:, :length] - prefix).abs().max().item() <= 1e-5, length


def test_packed_documents_equal_each_document_alone(one_rank):
    """``document_eos_id``: in a row of two documents (the second starting on an even token,
    so its compressed runs fall as they do alone), each document's logits equal the logits of
    that document run alone; without it the second document's logits differ (it sees the
    first). The FP8/FP4 rounding is off: its code flips turn the last bits of other GEMM shapes
    into 4e-5 now and then (measured)."""
    eos = 7
    models = {packed: tiny_model(fake_quantize=False, document_eos_id=eos if packed else None)
              for packed in (True, False)}
    generator = torch.Generator().manual_seed(4)
    first = torch.randint(8, 4000, (1, 69), generator=generator)
    first = torch.cat((first, torch.tensor([[eos]])), dim=1)  # 70 tokens, the EOS ends it
    second = torch.randint(8, 4000, (1, 90), generator=generator)
    row = torch.cat((first, second), dim=1)
    with torch.no_grad():
        packed = models[True](row, None, None)
        alone = [models[True](first, None, None), models[True](second, None, None)]
        unpacked = models[False](row, None, None)
    assert (packed[:, :70] - alone[0]).abs().max().item() <= 1e-5
    assert (packed[:, 70:] - alone[1]).abs().max().item() <= 1e-5
    assert (unpacked[:, 70:] - alone[1]).abs().max().item() > 1e-2

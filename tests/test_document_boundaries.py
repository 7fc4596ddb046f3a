"""Document boundaries with ``engram_reset_at_eos``: the n-gram hash restarts at EOS, and the
short conv's look-back (K-1) x N stops at the document start too, so a document's Engram output
does not depend on the document before it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engram_train.config import EngramConfig
from engram_train.engram.engram_module import Engram, ShortConv
from engram_train.engram.ngram_hash import NgramHashMapping, document_distance

EOS = 7


def _config(**overrides) -> EngramConfig:
    fields = dict(use_engram=True, engram_tokenizer_name_or_path="unused",
                  engram_vocab_size=[300, 200], n_embed_per_ngram=16, n_head_per_ngram=2,
                  engram_layer_ids=[0, 2], engram_reset_at_eos=True, engram_eos_id=EOS)
    return EngramConfig(**{**fields, **overrides})


def _mapping(config) -> NgramHashMapping:
    return NgramHashMapping(config, np.arange(64))


@pytest.mark.parametrize("streams", [1, 2])
def test_masked_conv_equals_the_conv_of_each_document_alone(streams):
    """Independent truth: the plain conv (zero padding) run on each document by itself."""
    torch.manual_seed(0)
    conv = ShortConv(8, streams, kernel_size=4, dilation=3)
    conv.conv.reset_parameters()
    ids = torch.tensor([[1, 2, 3, 4, 5, EOS, 9, 9, 9, 9, 9, 9, 9, EOS, 3, 3, 3, 3, 3, 3],
                        [EOS, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]])
    seq = ids.shape[1]
    x = torch.randn(seq, 2, streams, 8)
    distance = torch.from_numpy(document_distance(ids.numpy(), EOS)).T
    got = conv(x, document_distance=distance)
    for b in range(2):
        row = ids[b].tolist()
        cuts = [0] + [j + 1 for j, tok in enumerate(row) if tok == EOS and j + 1 < seq] + [seq]
        for start, end in zip(cuts, cuts[1:]):
            alone = conv(x[start:end, b : b + 1])
            torch.testing.assert_close(got[start:end, b : b + 1], alone, rtol=1e-6, atol=1e-6)
    # no EOS in the look-back window: the plain conv
    torch.testing.assert_close(conv(x, document_distance=torch.full((seq, 2), 99)), conv(x))


def test_a_documents_engram_output_does_not_depend_on_the_document_before():
    torch.manual_seed(1)
    config = _config()
    engram = Engram(config, 12, 0, zero_init_conv=False)
    mapping = _mapping(config)
    first = torch.randint(8, 64, (2, 9))
    other_first = torch.randint(8, 64, (2, 9))
    second = torch.randint(8, 64, (2, 11))
    eos = torch.full((2, 1), EOS)
    a = torch.cat([first, eos, second], 1)
    b = torch.cat([other_first, eos, second], 1)
    hidden_second = torch.randn(11, 2, 12)

    def run(ids, conv_stops: bool):
        block = torch.as_tensor(mapping.hash_block(ids.numpy()))
        assert block.shape[0] == len(config.engram_layer_ids) + 1  # the document slice
        hidden = torch.cat([torch.randn(10, 2, 12), hidden_second])  # before: anything
        distance = block[-1, :, :, 0].T if conv_stops else None
        return engram(hidden, hash_ids=block[0].transpose(0, 1), document_distance=distance)

    torch.testing.assert_close(run(a, True)[10:], run(b, True)[10:], rtol=0, atol=0)
    # the control: without the mask the conv reads the document before (hash reset alone)
    assert not torch.allclose(run(a, False)[10:], run(b, False)[10:])


def test_hash_block_without_reset_is_hash_stacked():
    config = EngramConfig(use_engram=True, engram_tokenizer_name_or_path="unused",
                          engram_vocab_size=[300, 200], n_embed_per_ngram=16, n_head_per_ngram=2,
                          engram_layer_ids=[0, 2])
    mapping = _mapping(config)
    ids = np.random.default_rng(0).integers(0, 64, (2, 16))
    np.testing.assert_array_equal(mapping.hash_block(ids), mapping.hash_stacked(ids))
    with_docs = _mapping(_config()).hash_block(torch.as_tensor(ids))
    np.testing.assert_array_equal(with_docs[-1, :, :, 3].numpy(), document_distance(ids, EOS))


def test_streamed_distances_and_conv_equal_the_whole_sequence():
    """Decoding in chunks (EngramMemory, the Hugging Face class) carries where the next token
    lies in its document; chunk by chunk equals the whole sequence."""
    from engram_train.engram.incremental_hash import continue_document_distance
    from engram_train.inference.memory import _StreamingShortConv

    rng = np.random.default_rng(3)
    ids = rng.integers(0, 10, (3, 40))
    ids[0, [4, 5, 17]] = EOS
    ids[1, 0] = EOS
    want = document_distance(ids, EOS)
    torch.manual_seed(2)
    conv = ShortConv(8, 1, kernel_size=4, dilation=3)
    conv.conv.reset_parameters()
    x = torch.randn(40, 3, 1, 8)
    whole = conv(x, document_distance=torch.from_numpy(want).T)
    streaming = _StreamingShortConv(conv)
    streaming.state = torch.zeros(3, 8, conv.left_pad)
    since, got, outputs = np.zeros(3, np.int64), [], []
    for start, end in ((0, 1), (1, 6), (6, 7), (7, 18), (18, 18), (18, 40)):
        distance, since = continue_document_distance(ids[:, start:end], EOS, since)
        got.append(distance)
        outputs.append(streaming(x[start:end], document_distance=torch.from_numpy(distance).T))
    np.testing.assert_array_equal(np.concatenate(got, axis=1), want)
    torch.testing.assert_close(torch.cat(outputs), whole, rtol=1e-6, atol=1e-6)


def _hugging_face_model(vocab: int):
    """A small EngramDeepseekV3ForCausalLM with Engram (reset at EOS) on layer 0, its table,
    conv and value projection off zero; the model and its Engram module."""
    from engram_train.hf.modeling import EngramDeepseekV3Config, EngramDeepseekV3ForCausalLM

    engram = _config(engram_layer_ids=[0])
    mapping = _mapping(engram)
    fields = {name: getattr(engram, name) for name in EngramConfig.field_names()}
    fields.update(num_raw_ids=vocab, compressed_pad_id=0,
                  table_rows={"0": int(np.sum(mapping.primes[0]))})
    config = EngramDeepseekV3Config(
        engram=fields, vocab_size=vocab, hidden_size=32, intermediate_size=64,
        moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, n_shared_experts=1, n_routed_experts=4, n_group=1, topk_group=1,
        num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
        qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=64,
        num_nextn_predict_layers=0)
    torch.manual_seed(4)
    model = EngramDeepseekV3ForCausalLM(config).eval()
    hash_module = model.model.engram_hash
    with torch.no_grad():
        hash_module.lookup.copy_(torch.arange(vocab))
        hash_module.multipliers_0.copy_(torch.from_numpy(mapping.multipliers[0]))
        hash_module.primes_0.copy_(torch.from_numpy(np.asarray(mapping.primes[0])))
        layer = model.model.layers[0].engram
        layer.multi_head_embedding.weight.normal_(0.0, 1.0)
        layer.multi_head_embedding.offsets.copy_(torch.from_numpy(mapping.offsets[0]))
        layer.short_conv.conv.weight.normal_(0.0, 1.0)
        layer.value_proj.weight.normal_(0.0, 0.5)
    hash_module._hasher = None
    return model, layer


def test_hugging_face_class_stops_the_conv_at_document_starts():
    """Engram on layer 0 reads the embeddings, which do not depend on context: its output on a
    document is the same whatever document came before, and the cached decoding agrees."""
    import transformers  # a test dependency: missing, the test fails rather than skips

    vocab = 64
    model, layer = _hugging_face_model(vocab)
    config = model.config
    outputs = []
    layer.register_forward_hook(lambda mod, args, out: outputs.append(out.detach().clone()))
    second = torch.randint(8, vocab, (1, 12))
    runs = []
    for seed in (0, 1):
        first = torch.randint(8, vocab, (1, 9), generator=torch.Generator().manual_seed(seed))
        ids = torch.cat([first, torch.full((1, 1), EOS), second], 1)
        outputs.clear()
        with torch.no_grad():
            model(ids, use_cache=False)
        runs.append(outputs[0][10:])  # sequence first: the second document's positions
    torch.testing.assert_close(runs[0], runs[1], rtol=0, atol=0)
    # cached decoding carries the document position: token by token equals the whole call
    outputs.clear()
    cache = transformers.DynamicCache(config=config)
    with torch.no_grad():
        model(ids[:, :7], past_key_values=cache, use_cache=True)
        for t in range(7, ids.shape[1]):
            model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
    torch.testing.assert_close(torch.cat(outputs)[10:], runs[1], rtol=1e-5, atol=1e-6)


def test_hugging_face_left_padded_batch_with_documents_decodes_each_row_as_alone():
    """Left padding and the reset at EOS together: a row's pads are left out of its document
    distances as of its n-gram history, so each row of a left-padded batch whose prompts hold
    EOS gives the logits and the greedy continuation it gives alone."""
    vocab = 64
    model, _ = _hugging_face_model(vocab)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(8, vocab, (1, n), generator=g) for n in (5, 14)]
    prompts[0][0, 2] = EOS
    prompts[1][0, 4] = EOS
    prompts[1][0, 11] = EOS
    width = max(p.shape[1] for p in prompts)
    batch = torch.full((2, width), EOS, dtype=torch.long)  # pads are EOS: they must not count
    mask = torch.zeros(2, width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        batch[row, width - prompt.shape[1]:] = prompt
        mask[row, width - prompt.shape[1]:] = 1
    with torch.no_grad():
        padded = model(batch, attention_mask=mask, use_cache=False).logits
        for row, prompt in enumerate(prompts):
            alone = model(prompt, use_cache=False).logits[0]
            torch.testing.assert_close(padded[row, width - prompt.shape[1]:], alone,
                                       rtol=1e-5, atol=1e-5)
    for use_cache in (True, False):
        together = model.generate(batch, attention_mask=mask, max_new_tokens=10,
                                  min_new_tokens=10, do_sample=False, use_cache=use_cache,
                                  pad_token_id=2)
        for row, prompt in enumerate(prompts):
            alone = model.generate(prompt, max_new_tokens=10, min_new_tokens=10,
                                   do_sample=False, use_cache=use_cache, pad_token_id=2)
            assert torch.equal(together[row, width:], alone[0, prompt.shape[1]:]), (row, use_cache)

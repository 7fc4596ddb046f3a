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
    return EngramConfig(use_engram=True, engram_tokenizer_name_or_path="unused",
                        engram_vocab_size=[300, 200], n_embed_per_ngram=16, n_head_per_ngram=2,
                        engram_layer_ids=[0, 2], engram_reset_at_eos=True, engram_eos_id=EOS,
                        **overrides)


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

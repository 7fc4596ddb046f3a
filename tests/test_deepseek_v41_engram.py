"""DeepSeek-V4.1's Engram variant against NeMo Automodel 0.7.0, run in this process.

The hash ids must be bit-exact with NeMo's ``DeepseekV41NgramHash`` (compressed-token map,
primes, offsets, multipliers; padding and packed documents included) and the module within
1e-6 (float32, max abs) of NeMo's ``DeepseekV41Engram`` with the same weights, forward and the
gradient of every parameter. NeMo comes from the side folder ``.v41-ref`` (tests/v41_reference.py);
without it these tests fail and say that ``make v41-ref`` installs it.
"""

from __future__ import annotations

import dataclasses
import pickle
import sys

import numpy as np
import pytest
import torch

import v41_reference as ref
from engram_train.engram.compressed_tokenizer import CompressedTokenizer, build_compressed_lookup
from engram_train.engram.ngram_hash import NgramHashMapping, document_distance
from engram_train.engram.v41_engram_module import DeepseekV41Engram
from engram_train.engram.v41_ngram_hash import (
    DeepseekV41EngramArgs,
    DeepseekV41NgramHashMapping,
    document_ids,
)
from engram_train.errors import ConfigError, InputError, InputTypeError

TOLERANCE = 1e-6
VOCAB = 4096  # the shipped tokenizer's raw ids
ARGS = DeepseekV41EngramArgs(
    engram_layer_ids=(1, 3), engram_max_ngram_size=4, engram_n_heads=2, engram_head_dim=8,
    engram_vocab_size=50, engram_pad_token_id=0, hc_mult=4,
)
# other orders, head counts, layer lists and pads: the prime walk and the look-back rule
HASH_ARGS = [
    ARGS,
    DeepseekV41EngramArgs(engram_layer_ids=(0,), engram_max_ngram_size=2, engram_n_heads=3,
                          engram_vocab_size=2, engram_pad_token_id=5),
    DeepseekV41EngramArgs(engram_layer_ids=(2, 5, 9), engram_max_ngram_size=3, engram_n_heads=4,
                          engram_vocab_size=1000, engram_pad_token_id=17),
    DeepseekV41EngramArgs(engram_layer_ids=(1, 14), engram_max_ngram_size=5, engram_n_heads=1,
                          engram_vocab_size=100_003, engram_pad_token_id=2),
]
# NeMo state-dict names -> this project's
NAME_MAP = {"embed.weight": "multi_head_embedding.weight", "wkv.weight": "wkv.weight",
            "q_weight": "q_weight", "k_weight": "k_weight"}


@pytest.fixture(scope="module")
def lookup() -> np.ndarray:
    return build_compressed_lookup(ref.TOKENIZER)


def random_batch(seed: int, batch: int, seq_len: int):
    """Raw ids, a token mask with padding tails and scattered dead tokens, and packed
    document ids with 0 on the padding (as NeMo's packer writes them)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq_len), generator=g)
    mask = torch.rand(batch, seq_len, generator=g) > 0.15
    documents = torch.zeros(batch, seq_len, dtype=torch.long)
    for b in range(batch):
        used = int(torch.randint(seq_len // 2, seq_len + 1, (1,), generator=g))
        starts = sorted({0, *torch.randint(1, max(used, 2), (3,), generator=g).tolist()})
        for doc, start in enumerate(starts, 1):
            documents[b, start:used] = doc + 10 * b
        mask[b, used:] = False
    return ids, mask, documents


def nemo_rows(args, ids, mask=None, documents=None) -> torch.Tensor:
    return ref.ngram_hash(args, ids, token_mask=mask, sequence_ids=documents)


def our_rows(mapping, ids, mask=None, documents=None) -> torch.Tensor:
    """Our table rows in NeMo's layout [B, T, L, K]."""
    local = mapping.hash_stacked(ids, mask, documents)
    return torch.stack([mapping.table_rows(layer, local[i])
                        for i, layer in enumerate(mapping.layer_ids)], dim=2)


# --- the side folder ---------------------------------------------------------------------------


def test_missing_side_folder_fails_naming_make_target(tmp_path, monkeypatch):
    monkeypatch.setattr(ref, "SIDE", tmp_path / ".v41-ref")
    with pytest.raises(pytest.fail.Exception, match=r"`make v41-ref` installs it"):
        ref.require()


def test_side_folder_leaves_the_environment_transformers(lookup):
    """The suite's transformers (5.24) is what other tests see before and after NeMo's (5.18)."""
    import transformers

    version, origin = transformers.__version__, transformers.__file__
    assert not origin.startswith(str(ref.SIDE))
    with ref.side():
        import transformers as side_transformers

        assert side_transformers.__version__ == "5.18.0"
        assert side_transformers.__file__.startswith(str(ref.SIDE))
    import transformers as after

    assert (after.__version__, after.__file__) == (version, origin)
    assert str(ref.SIDE) not in sys.path


# --- the hash ----------------------------------------------------------------------------------


def test_compressed_token_map_matches_nemo(lookup):
    token_map, size = ref.compressed_token_map()
    assert lookup.tolist() == token_map
    assert int(lookup.max()) + 1 == size


def test_compressed_token_map_with_added_tokens(tmp_path):
    """Added tokens (special ones decoded as text, a plain one) extend the raw ids as
    transformers counts them."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(ref.TOKENIZER))
    tok.add_special_tokens(["<|doc|>", "<|pad|>"])
    tok.add_tokens([AddedToken(" Hello", normalized=False), "WORLD"])
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    token_map, size = ref.compressed_token_map(path)
    ours = CompressedTokenizer(path, use_cache=False)
    assert ours.lookup.tolist() == token_map and ours.vocab_size == size
    assert ours.num_raw_ids == VOCAB + 4


def test_primes_offsets_multipliers_match_nemo(lookup):
    for args in HASH_ARGS:
        ours = DeepseekV41NgramHashMapping(args, lookup)
        with ref.side():
            from nemo_automodel.components.models.deepseek_v41.engram import DeepseekV41NgramHash

            theirs = DeepseekV41NgramHash(ref.text_config(args, 64), ref.tokenizer())
        layers = ours.layer_ids
        assert theirs.primes.tolist() == [ours.primes[i].tolist() for i in layers]
        assert theirs.offsets.tolist() == [ours.offsets[i].tolist() for i in layers]
        assert theirs.multipliers.tolist() == [ours.multipliers[i].tolist() for i in layers]
        assert theirs.pad_id == ours.pad_id


def test_released_row_counts_are_the_prime_sums(lookup):
    """V4.1-Flash's `engram_num_embeddings` (NeMo's defaults) are exactly the sums of the
    layers' primes, so a table of sum(primes) rows holds the released checkpoint's rows."""
    with ref.side():
        from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41TextConfig

        released = DeepseekV41TextConfig()
        rows = list(released.engram_num_embeddings)
        flash = DeepseekV41EngramArgs(
            engram_layer_ids=tuple(released.engram_layer_ids),
            engram_max_ngram_size=released.engram_max_ngram_size,
            engram_n_heads=released.engram_n_heads, engram_vocab_size=released.engram_vocab_size,
            engram_num_embeddings=tuple(rows),
        )
    assert rows == [384006168, 384016682]
    mapping = DeepseekV41NgramHashMapping(flash, lookup)  # checks the rows
    assert [mapping.num_rows[layer] for layer in mapping.layer_ids] == rows


@pytest.mark.parametrize("index", range(len(HASH_ARGS)))
def test_hash_bit_exact_with_nemo(lookup, index):
    """Plain rows, padding and dead tokens, packed documents, and both, over random batches."""
    args = HASH_ARGS[index]
    mapping = DeepseekV41NgramHashMapping(args, lookup)
    for seed in range(4):
        ids, mask, documents = random_batch(100 * index + seed, 3, 29 + seed)
        for kwargs in ({}, dict(mask=mask), dict(documents=documents),
                       dict(mask=mask, documents=documents)):
            theirs = nemo_rows(args, ids, **kwargs)
            ours = our_rows(mapping, ids, **kwargs)
            assert torch.equal(theirs, ours), (seed, list(kwargs))


def test_look_back_stops_at_documents_and_dead_tokens(lookup):
    """Worked example: a position sees only the live run of its own document ending at it."""
    args = DeepseekV41EngramArgs(engram_layer_ids=(0,), engram_max_ngram_size=3,
                                 engram_n_heads=1, engram_vocab_size=1000, engram_pad_token_id=0)
    mapping = DeepseekV41NgramHashMapping(args, lookup)
    ids = torch.tensor([[11, 12, 13, 14, 15, 16, 17, 18]])
    mask = torch.tensor([[True, True, True, False, True, True, True, True]])
    documents = torch.tensor([[1, 1, 2, 2, 2, 2, 2, 0]])
    pad = mapping.pad_id
    c = mapping.lookup[ids[0].numpy()].tolist()
    shifts = mapping.shifted_ids(ids.numpy(), mask.numpy(), documents.numpy())
    expected = [  # (t, t-1, t-2) as the hash reads them
        (c[0], pad, pad), (c[1], c[0], pad), (c[2], pad, pad), (pad, pad, pad),
        (c[4], pad, pad), (c[5], c[4], pad), (c[6], c[5], c[4]), (pad, pad, pad),
    ]
    assert [tuple(int(s[0, t]) for s in shifts) for t in range(8)] == expected
    assert torch.equal(nemo_rows(args, ids, mask, documents), our_rows(mapping, ids, mask, documents))


def test_documents_from_eos_equal_the_paper_reset(lookup):
    """`document_ids` of EOS-delimited rows gives V4.1 the paper variant's EOS reset: the same
    ids as `NgramHashMapping` with engram_reset_at_eos, and NeMo's with those documents."""
    eos = 7
    ids, _, _ = random_batch(5, 2, 40)
    ids[0, [3, 4, 20]] = eos
    ids[1, [0, 39]] = eos
    documents = document_ids(ids, eos)
    assert torch.equal(documents, torch.from_numpy(document_ids(ids.numpy(), eos)))
    distance = document_distance(ids.numpy(), eos)
    starts = [[int((documents[b] == documents[b, t]).nonzero()[0]) for t in range(40)]
              for b in range(2)]
    assert (np.arange(40) - np.array(starts) == distance).all()
    paper = ARGS.paper_fields()
    paper.engram_reset_at_eos, paper.engram_eos_id = True, eos
    v41 = DeepseekV41NgramHashMapping(ARGS, lookup)
    assert np.array_equal(NgramHashMapping(paper, lookup).hash_stacked(ids.numpy()),
                          v41.hash_stacked(ids.numpy(), sequence_ids=documents.numpy()))
    assert np.array_equal(NgramHashMapping(ARGS.paper_fields(), lookup).hash_stacked(ids.numpy()),
                          v41.hash_stacked(ids.numpy()))
    assert torch.equal(nemo_rows(ARGS, ids, documents=documents),
                       our_rows(v41, ids, documents=documents))


def test_hash_inputs_numpy_torch_and_one_row(lookup):
    mapping = DeepseekV41NgramHashMapping(ARGS, lookup, num_threads=2)
    ids, mask, documents = random_batch(9, 2, 17)
    stacked = mapping.hash_stacked(ids, mask, documents)
    assert isinstance(stacked, torch.Tensor) and stacked.shape == (2, 2, 17, 6)
    assert np.array_equal(stacked.numpy(),
                          mapping.hash_stacked(ids.numpy(), mask.numpy(), documents.numpy()))
    assert torch.equal(mapping.hash_stacked(ids[1], mask[1], documents[1]), stacked[:, 1])
    assert torch.equal(mapping.hash_block(ids, None, documents), mapping.hash_stacked(ids, None, documents))
    block = mapping.hash_block(ids, mask, documents)  # the token mask rides as slice L
    assert torch.equal(block[:2], stacked) and torch.equal(block[2, ..., 0], mask.long())
    assert torch.equal(mapping(ids, mask, documents)[3], stacked[1])
    copy = pickle.loads(pickle.dumps(mapping))  # as a data-loader worker receives it
    assert copy.args == ARGS and torch.equal(copy.hash_stacked(ids, mask, documents), stacked)


def test_hash_refusals(lookup):
    with pytest.raises(ConfigError, match="engram_compressed_vocab_size=99092"):
        DeepseekV41NgramHashMapping(
            DeepseekV41EngramArgs(engram_layer_ids=(1,), engram_compressed_vocab_size=99092),
            lookup)
    rows = DeepseekV41NgramHashMapping(ARGS, lookup).num_rows
    assert rows == {1: 384, 3: 552}
    with pytest.raises(ConfigError, match="gives layer 3 553 rows; its hash heads address exactly 552"):
        DeepseekV41NgramHashMapping(
            dataclasses.replace(ARGS, engram_num_embeddings=(384, 553)), lookup)
    with pytest.raises(ConfigError, match="gives layer 3 553 rows"):
        DeepseekV41Engram(dataclasses.replace(ARGS, engram_num_embeddings=(384, 553)), 32, 3)
    with pytest.raises(ConfigError, match="strictly increasing"):
        DeepseekV41EngramArgs(engram_layer_ids=(3, 1))
    mapping = DeepseekV41NgramHashMapping(ARGS, lookup)
    ids, mask, _ = random_batch(0, 2, 8)
    with pytest.raises(InputError, match="token_mask shape"):
        mapping.hash_stacked(ids, mask[:, :4])
    with pytest.raises(InputTypeError, match="token_mask must be boolean"):
        mapping.hash_stacked(ids, mask.long())


# --- the module --------------------------------------------------------------------------------


def module_pair(args, hidden_size: int, layer_id: int, seed: int, dead_stream: bool = False):
    """NeMo's module with weights moved away from their init, and ours loaded from it by the
    state-dict name map. ``dead_stream``: stream 1's key rows of wkv at zero (its gate's dot
    is exactly 0, the signed square root's floor)."""
    torch.manual_seed(seed)
    theirs = ref.engram(args, hidden_size, layer_id)
    with torch.no_grad():
        theirs.embed.weight.normal_(0.0, 1.0)
        theirs.wkv.weight.normal_(0.0, 0.3)
        theirs.q_weight.uniform_(0.5, 1.5)
        theirs.k_weight.uniform_(-1.5, 1.5)
        if dead_stream:
            theirs.wkv.weight[hidden_size : 2 * hidden_size] = 0.0
    ours = DeepseekV41Engram(args, hidden_size, layer_id, seed=seed + 1)
    state = theirs.state_dict()
    assert set(state) == set(NAME_MAP)
    mapped = {NAME_MAP[name]: value for name, value in state.items()}
    mapped["multi_head_embedding.offsets"] = ours.multi_head_embedding.offsets
    ours.load_state_dict(mapped, strict=True)
    assert set(dict(ours.named_parameters())) == set(NAME_MAP.values())
    return theirs, ours


MODULE_CASES = {
    "hc4": dict(args=ARGS, hidden=32, layer=3, mask=False),
    "hc4-padding": dict(args=ARGS, hidden=32, layer=1, mask=True),
    "hc4-dead-stream": dict(args=ARGS, hidden=32, layer=3, mask=True, dead_stream=True),
    "hc2-3gram": dict(args=DeepseekV41EngramArgs(
        engram_layer_ids=(0, 2), engram_max_ngram_size=3, engram_n_heads=3, engram_head_dim=4,
        engram_vocab_size=20, engram_pad_token_id=3, hc_mult=2), hidden=24, layer=2, mask=True),
    "hc1": dict(args=DeepseekV41EngramArgs(
        engram_layer_ids=(4,), engram_max_ngram_size=2, engram_n_heads=2, engram_head_dim=16,
        engram_vocab_size=30, engram_pad_token_id=0, hc_mult=1), hidden=16, layer=4, mask=True),
}


@pytest.mark.parametrize("name", MODULE_CASES)
def test_engram_matches_nemo(lookup, name):
    """Forward and every parameter's gradient (and the hidden states') within 1e-6, from
    packed rows with padding hashed by each side's own hash."""
    case = MODULE_CASES[name]
    args, d, layer = case["args"], case["hidden"], case["layer"]
    theirs, ours = module_pair(args, d, layer, seed=len(name), dead_stream=case.get("dead_stream", False))
    mapping = DeepseekV41NgramHashMapping(args, lookup)
    ids, mask, documents = random_batch(len(name), 3, 21)
    mask = mask if case["mask"] else None
    documents = documents if case["mask"] else None
    index = list(args.engram_layer_ids).index(layer)
    rows = nemo_rows(args, ids, mask, documents)[:, :, index]
    local = mapping.hash_stacked(ids, mask, documents)[index]
    assert torch.equal(mapping.table_rows(layer, local), rows)

    hidden = torch.randn(3, 21, args.hc_mult, d, generator=torch.Generator().manual_seed(1))
    h_theirs, h_ours = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    with ref.side():
        out_theirs = theirs(h_theirs, rows, token_mask=mask)
    out_ours = h_ours + ours(h_ours, local, token_mask=mask)
    error = (out_theirs - out_ours).abs().max().item()
    assert error <= TOLERANCE, error
    if mask is not None:
        assert torch.equal(out_ours[~mask], hidden[~mask])

    weight = torch.randn(out_ours.shape, generator=torch.Generator().manual_seed(2))
    (out_theirs * weight).sum().backward()
    (out_ours * weight).sum().backward()
    grads = dict(hidden=(h_theirs.grad, h_ours.grad))
    ours_params = dict(ours.named_parameters())
    for their_name, param in theirs.named_parameters():
        grads[their_name] = (param.grad, ours_params[NAME_MAP[their_name]].grad)
    for key, (a, b) in grads.items():
        assert b is not None and a.shape == b.shape, key
        assert a.abs().max() > 0, key  # the comparison is not vacuous
        error = (a - b).abs().max().item()
        assert error <= TOLERANCE, (key, error)


def test_sequence_first_and_memory_path():
    """Per position, so the project's sequence-first layout gives the transposed output; the
    prefetch path (memory looked up first) gives the same values."""
    torch.manual_seed(0)
    module = DeepseekV41Engram(ARGS, 32, 1)
    smallest_head = min(module.multi_head_embedding.head_sizes)  # head-local ids below it
    ids = torch.randint(0, smallest_head, (3, 5, ARGS.num_hash_heads))
    hidden = torch.randn(3, 5, 4, 32)
    batch_first = module(hidden, ids)
    sequence_first = module(hidden.transpose(0, 1), ids.transpose(0, 1))
    assert torch.equal(sequence_first, batch_first.transpose(0, 1))
    memory = module.issue_lookup(ids).wait()
    assert torch.equal(module(hidden, memory=memory), batch_first)
    assert all(getattr(p, "is_engram", False) for p in module.parameters())
    assert module.multi_head_embedding.weight.is_engram_table
    half = DeepseekV41Engram(ARGS, 32, 1, dtype=torch.bfloat16)
    assert half.multi_head_embedding.weight.dtype == torch.bfloat16
    assert half(hidden.bfloat16(), ids).dtype == torch.bfloat16
    with pytest.raises(InputError, match="does not match the hash ids' positions"):
        module(hidden[:, :, :2], ids)
    with pytest.raises(InputError, match="exactly one of hash_ids or memory"):
        module(hidden)
    with pytest.raises(ConfigError, match="not in engram_layer_ids"):
        DeepseekV41Engram(ARGS, 32, 2)

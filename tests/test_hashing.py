"""Hashing, compressed tokenizer and table layout: properties against an independent oracle.

The oracle below recomputes the spec with Python integers (two's-complement wrap to int64,
floor modulo), position by position; the vectorized implementation must agree exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_train.config import EngramConfig
from engram_train.engram import compressed_tokenizer as tokenizer_module
from engram_train.engram.tables import (
    INIT_BLOCK_ROWS,
    MultiHeadEmbedding,
    partition_invariant_normal_,
)
from engram_train.engram.ngram_hash import (
    NgramHashMapping,
    document_distance,
    engram_head_vocab_sizes,
    head_offsets,
    is_prime,
    layer_multipliers,
)
from engram_train.engram.compressed_tokenizer import CompressedTokenizer

# The repository's own copy: $ENGRAM_GOLDEN_DIR may point at cases with other tokenizers.
GOLDEN_TOKENIZER = Path(__file__).resolve().parent / "data" / "golden" / "tok_bpe4k"


def _wrap64(x: int) -> int:
    return (x + (1 << 63)) % (1 << 64) - (1 << 63)


def oracle_hash(ids, lookup, raw_pad, multipliers, head_sizes, eos=None):
    """Spec section 2, one position at a time, in Python integers."""
    pad = int(lookup[raw_pad])
    n_max = len(multipliers)
    out = []
    for row in np.asarray(ids).tolist():
        row_out = []
        for t in range(len(row)):
            start = 0
            if eos is not None:
                start = max([j + 1 for j in range(t) if row[j] == eos], default=0)
            values = []
            for n in range(2, n_max + 1):
                mix = 0
                for k in range(n):
                    s = int(lookup[row[t - k]]) if t - k >= start else pad
                    mix ^= _wrap64(s * int(multipliers[k]))
                values += [mix % p for p in head_sizes[n - 2]]
            row_out.append(values)
        out.append(row_out)
    return np.array(out, dtype=np.int64).reshape(len(out), -1, sum(map(len, head_sizes)))


def make_config(**overrides) -> EngramConfig:
    values = dict(
        use_engram=True,
        engram_tokenizer_name_or_path="unused-when-a-lookup-is-given",
        engram_vocab_size=[50, 40],
        max_ngram_size=3,
        n_embed_per_ngram=16,
        n_head_per_ngram=2,
        engram_layer_ids=[0, 2],
    )
    values.update(overrides)
    return EngramConfig(**values)


# -- primes, multipliers, offsets -----------------------------------------------------------

def test_spec_row_totals():
    sizes = engram_head_vocab_sizes([16_000_000] * 3, 4, 8, [1, 14])
    assert {layer: sum(map(sum, orders)) for layer, orders in sizes.items()} == {
        1: 384_006_168,
        14: 384_016_682,
    }


def test_prime_walk_is_global_and_increasing():
    sizes = engram_head_vocab_sizes([100, 100], 3, 3, [5, 1])
    flat = [p for layer in (5, 1) for order in sizes[layer] for p in order]
    assert len(set(flat)) == len(flat)  # no modulus shared anywhere
    assert sizes[5] == [[101, 103, 107], [109, 113, 127]]  # layer order = list order
    assert sizes[1] == [[131, 137, 139], [149, 151, 157]]


def test_is_prime():
    def trial(n):
        return n >= 2 and all(n % d for d in range(2, int(n**0.5) + 1))

    assert [n for n in range(3000) if is_prime(n)] == [n for n in range(3000) if trial(n)]
    # Strong pseudoprimes to several bases, Carmichael numbers, Mersenne primes.
    for composite in (561, 3215031751, 3825123056546413051, 318665857834031151167461):
        assert not is_prime(composite)
    for prime in (2**31 - 1, 2**61 - 1, 1_000_000_007):
        assert is_prime(prime)


def test_multipliers_are_the_reference_draws():
    got = layer_multipliers([1, 15], 3, compressed_vocab_size=2811, seed=7)
    half = (np.iinfo(np.int64).max // 2811) // 2
    for layer in (1, 15):
        rng = np.random.default_rng(7 + 10007 * layer)
        want = rng.integers(0, half, size=3, dtype=np.int64) * 2 + 1
        np.testing.assert_array_equal(got[layer], want)
        assert got[layer].dtype == np.int64 and (got[layer] % 2 == 1).all()


def test_offsets_and_table_rows():
    config = make_config()
    mapping = NgramHashMapping(config, np.arange(30))
    for layer in config.engram_layer_ids:
        primes = mapping.primes[layer]
        np.testing.assert_array_equal(head_offsets(primes), np.r_[0, np.cumsum(primes)[:-1]])
        assert mapping.num_rows[layer] == primes.sum()
        hashes = mapping.hash(np.arange(30).reshape(2, 15) % 30)[layer]
        rows = mapping.table_rows(layer, hashes)
        lo, hi = mapping.offsets[layer], mapping.offsets[layer] + primes
        assert ((rows >= lo) & (rows < hi)).all()  # each head stays inside its own table
        rows_t = mapping.table_rows(layer, torch.from_numpy(hashes))
        np.testing.assert_array_equal(rows_t.numpy(), rows)


# -- hashing properties ---------------------------------------------------------------------

@st.composite
def hashing_case(draw):
    n_max = draw(st.integers(2, 4))
    heads = draw(st.integers(1, 3))
    num_raw = draw(st.integers(2, 60))
    lookup = np.array(draw(st.lists(st.integers(0, num_raw - 1), min_size=num_raw,
                                     max_size=num_raw)), dtype=np.int64)
    config = make_config(
        max_ngram_size=n_max,
        n_head_per_ngram=heads,
        n_embed_per_ngram=heads * 4,
        engram_vocab_size=draw(st.lists(st.integers(2, 3000), min_size=n_max - 1,
                                        max_size=n_max - 1)),
        engram_layer_ids=draw(st.lists(st.integers(0, 40), min_size=1, max_size=3, unique=True)),
        engram_seed=draw(st.integers(0, 2**20)),
        engram_pad_id=draw(st.integers(0, num_raw - 1)),
    )
    batch, seq = draw(st.integers(1, 3)), draw(st.integers(1, 9))
    ids = np.array(draw(st.lists(st.integers(0, num_raw - 1), min_size=batch * seq,
                                 max_size=batch * seq)), dtype=np.int64).reshape(batch, seq)
    return config, lookup, ids


@settings(max_examples=60, deadline=None)
@given(hashing_case())
def test_hash_matches_oracle(case):
    config, lookup, ids = case
    mapping = NgramHashMapping(config, lookup)
    hashes = mapping.hash(ids)
    again = mapping.hash(torch.from_numpy(ids))
    k = (config.max_ngram_size - 1) * config.n_head_per_ngram
    for layer in config.engram_layer_ids:
        got = hashes[layer]
        assert got.shape == (*ids.shape, k) and got.dtype == np.int64
        assert ((got >= 0) & (got < mapping.primes[layer])).all()
        np.testing.assert_array_equal(again[layer].numpy(), got)  # torch in == numpy in
        want = oracle_hash(ids, lookup, config.engram_pad_id, mapping.multipliers[layer],
                           mapping.head_vocab_sizes[layer])
        np.testing.assert_array_equal(got, want)


@settings(max_examples=30, deadline=None)
@given(hashing_case())
def test_first_position_sees_only_padding(case):
    # Row start padding = the compressed pad id: prefixing N-1 raw pads changes nothing.
    config, lookup, ids = case
    mapping = NgramHashMapping(config, lookup)
    lead = np.full((ids.shape[0], config.max_ngram_size - 1), config.engram_pad_id)
    padded = mapping.hash(np.concatenate([lead, ids], axis=1))
    plain = mapping.hash(ids)
    for layer in config.engram_layer_ids:
        np.testing.assert_array_equal(plain[layer], padded[layer][:, lead.shape[1]:])


def test_one_dimensional_input():
    mapping = NgramHashMapping(make_config(), np.arange(20))
    ids = np.arange(12) % 20
    flat, batched = mapping.hash(ids), mapping.hash(ids[None])
    for layer in (0, 2):
        np.testing.assert_array_equal(flat[layer], batched[layer][0])


@pytest.mark.parametrize("bad", [-1, 20, 10**12])
def test_out_of_range_ids_raise(bad):
    mapping = NgramHashMapping(make_config(), np.arange(20))
    ids = np.array([[3, 4, bad, 5]])
    for value in (ids, torch.from_numpy(ids)):
        with pytest.raises(ValueError, match=rf"token id {bad} at index \(0, 2\).*\[0, 20\)"):
            mapping.hash(value)


def test_pad_id_out_of_range_raises():
    with pytest.raises(ValueError, match="engram_pad_id"):
        NgramHashMapping(make_config(engram_pad_id=20), np.arange(20))


# -- EOS reset --------------------------------------------------------------------------------

def test_document_distance():
    ids = np.array([[5, 9, 5, 5, 9, 9, 5]])
    # documents: [5 9] [5 5 9] [9] [5]
    np.testing.assert_array_equal(document_distance(ids, 9), [[0, 1, 0, 1, 2, 0, 0]])


@settings(max_examples=40, deadline=None)
@given(hashing_case(), st.data())
def test_eos_reset_equals_per_document_hashing(case, data):
    config, lookup, ids = case
    eos = data.draw(st.integers(0, len(lookup) - 1))
    positions = data.draw(st.lists(st.integers(0, ids.size - 1), max_size=ids.size))
    ids = ids.copy()
    ids.reshape(-1)[positions] = eos
    reset = NgramHashMapping(
        make_config(**{**_fields(config), "engram_reset_at_eos": True, "engram_eos_id": eos}),
        lookup,
    )
    plain = NgramHashMapping(config, lookup)
    hashes = reset.hash(ids)
    for b, row in enumerate(ids):
        cuts = [0] + [j + 1 for j, tok in enumerate(row) if tok == eos and j + 1 < len(row)]
        documents = [row[s:e] for s, e in zip(cuts, cuts[1:] + [len(row)])]
        for layer in config.engram_layer_ids:
            per_doc = np.concatenate([plain.hash(doc)[layer] for doc in documents])
            np.testing.assert_array_equal(hashes[layer][b], per_doc)
            want = oracle_hash(row[None], lookup, config.engram_pad_id,
                               plain.multipliers[layer], plain.head_vocab_sizes[layer], eos=eos)
            np.testing.assert_array_equal(hashes[layer][b], want[0])


def _fields(config: EngramConfig) -> dict:
    return {name: getattr(config, name) for name in EngramConfig.field_names()}


def test_reset_off_is_reference_behaviour():
    ids = np.array([[1, 2, 3, 2, 4, 5]])
    on = NgramHashMapping(make_config(engram_reset_at_eos=True, engram_eos_id=3), np.arange(8))
    off = NgramHashMapping(make_config(), np.arange(8))
    h_on, h_off = on.hash(ids)[0], off.hash(ids)[0]
    np.testing.assert_array_equal(h_on[:, :3], h_off[:, :3])  # up to and including the EOS
    assert not np.array_equal(h_on[:, 3], h_off[:, 3])  # the token after EOS forgets it


# -- compressed tokenizer ---------------------------------------------------------------------

def _word_level_tokenizer(tmp_path, words):
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


def test_compression_key_rule(tmp_path):
    words = ["<unk>", "Hello", "hello", "HÉLLO", " ", "\t", "  World ", "world", "\u0301"]
    path = _word_level_tokenizer(tmp_path, words)
    lookup = CompressedTokenizer(path, cache_dir=tmp_path / "cache").lookup
    assert lookup[1] == lookup[2] == lookup[3]  # case and accents fold
    assert lookup[4] == lookup[5]  # a lone whitespace run becomes " "
    assert lookup[6] == lookup[7]  # surrounding spaces strip
    assert lookup[8] not in lookup[:8]  # normalizes to "": keeps its own text
    assert lookup.tolist() == [0, 1, 1, 1, 2, 2, 3, 3, 4]  # dense, first-seen order


def test_tokenizer_cache_roundtrip(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = CompressedTokenizer(GOLDEN_TOKENIZER, cache_dir=cache)
    files = sorted(p.name for p in cache.iterdir())
    assert files == [f"compressed_lookup_v1_{first.sha256}.npy"]  # no leftover tmp files

    def fail(_):
        raise AssertionError("the cached table should have been used")

    monkeypatch.setattr(tokenizer_module, "build_compressed_lookup", fail)
    monkeypatch.setenv("ENGRAM_CACHE_DIR", str(cache))
    second = CompressedTokenizer(GOLDEN_TOKENIZER / "tokenizer.json")
    np.testing.assert_array_equal(second.lookup, first.lookup)
    assert (second.num_raw_ids, second.vocab_size) == (first.num_raw_ids, first.vocab_size)


def test_tokenizer_sizes_and_compress(tmp_path):
    tok = CompressedTokenizer(GOLDEN_TOKENIZER, cache_dir=tmp_path)
    config = json.loads((GOLDEN_TOKENIZER.parent / "case_a_meta.json").read_text())
    assert tok.num_raw_ids == 4096 and tok.vocab_size == config["compressed_vocab_size"]
    ids = np.array([[0, 5, 4095]])
    np.testing.assert_array_equal(tok.compress(ids), tok.lookup[ids])
    out = tok.compress(torch.from_numpy(ids))
    assert isinstance(out, torch.Tensor) and out.dtype == torch.int64
    with pytest.raises(ValueError, match=r"token id 4096 .*\[0, 4096\)"):
        tok.compress(np.array([1, 4096]))
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        CompressedTokenizer(tmp_path / "nowhere")


# -- table layout and partition-invariant init ----------------------------------------------

@pytest.mark.parametrize("split", [1, 7, INIT_BLOCK_ROWS - 1, INIT_BLOCK_ROWS,
                                   INIT_BLOCK_ROWS + 1, 2 * INIT_BLOCK_ROWS + 5])
def test_partition_invariant_init(split):
    rows, dim = 3 * INIT_BLOCK_ROWS + 17, 4
    full = partition_invariant_normal_(torch.empty(rows, dim), 3, 7, 0, 0.02)
    head = partition_invariant_normal_(torch.empty(split, dim), 3, 7, 0, 0.02)
    tail = partition_invariant_normal_(torch.empty(rows - split, dim), 3, 7, split, 0.02)
    torch.testing.assert_close(torch.cat([head, tail]), full, rtol=0, atol=0)


def test_init_depends_on_seed_and_layer():
    def init(seed, layer):
        return partition_invariant_normal_(torch.empty(100, 4), seed, layer, 0, 0.02)

    assert not torch.equal(init(0, 1), init(1, 1))
    assert not torch.equal(init(0, 1), init(0, 2))
    assert torch.equal(init(0, 1), init(0, 1))
    values = partition_invariant_normal_(torch.empty(INIT_BLOCK_ROWS * 4, 8), 0, 0, 0, 0.02)
    assert abs(values.std().item() - 0.02) < 1e-3


def test_sharded_tables_equal_the_full_table():
    sizes = [5003, 5009, 4001, 4003]
    full = MultiHeadEmbedding(sizes, 8, layer_id=3, seed=1)
    cuts = [0, 4444, 9000, sum(sizes)]  # ragged shards, one crossing a head boundary
    shards = [MultiHeadEmbedding(sizes, 8, layer_id=3, seed=1, row_start=a, row_end=b)
              for a, b in zip(cuts, cuts[1:])]
    torch.testing.assert_close(torch.cat([s.weight for s in shards]), full.weight,
                               rtol=0, atol=0)
    hashes = torch.stack([torch.randint(0, p, (6, 5)) for p in sizes], dim=-1)
    rows = full.table_rows(hashes)
    partial = sum(s.lookup_rows(rows, partial=True) for s in shards)
    torch.testing.assert_close(partial, full.lookup_rows(rows), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="shard"):
        shards[0](hashes)


def test_embedding_forward_and_marks():
    sizes = [7, 11, 13]
    table = MultiHeadEmbedding(sizes, 4, layer_id=0)
    assert table.weight.shape == (31, 4) and table.offsets.tolist() == [0, 7, 18]
    assert table.weight.is_engram and table.weight.is_engram_table
    hashes = torch.tensor([[[6, 10, 0]]])
    want = torch.cat([table.weight[6], table.weight[17], table.weight[18]])
    torch.testing.assert_close(table(hashes)[0, 0], want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="heads"):
        table(torch.zeros(2, 2, dtype=torch.long))


def test_stacked_threads_and_pickle():
    import pickle

    config = make_config(engram_layer_ids=[3, 0, 7])
    ids = np.random.default_rng(0).integers(0, 30, size=(3, 50))
    single = NgramHashMapping(config, np.arange(30) % 17)
    threaded = NgramHashMapping(config, np.arange(30) % 17, num_threads=2)
    stacked = single.hash_stacked(ids)
    assert stacked.shape == (3, 3, 50, 4)
    per_layer = single.hash(ids)
    for index, layer in enumerate(config.engram_layer_ids):
        np.testing.assert_array_equal(stacked[index], per_layer[layer])
        np.testing.assert_array_equal(threaded.hash(ids)[layer], per_layer[layer])
    restored = pickle.loads(pickle.dumps(threaded))  # data-loader workers may pickle it
    np.testing.assert_array_equal(restored.hash_stacked(ids), stacked)
    as_torch = single.hash_stacked(torch.from_numpy(ids))
    assert torch.equal(as_torch.contiguous(), torch.from_numpy(np.ascontiguousarray(stacked)))

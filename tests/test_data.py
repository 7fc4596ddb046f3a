"""Data pipeline: tokenizer adapter, preprocessing round trip, GPT datasets, micro-batches,
hash prefetching. Runs on the shipped demo corpus (examples/data)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from engram_train.data.batches import HashPrefetchIterator, MicroBatchIterator
from engram_train.data.datasets import (
    DEMO_DATA_PREFIX,
    DEMO_TOKENIZER,
    build_gpt_datasets,
    parse_blend,
)
from engram_train.data.preprocess import iter_documents
from engram_train.data.preprocess import main as preprocess_main
from engram_train.data.text_tokenizer import HFTokenizer, TokenizerNotFoundError, load_tokenizer

REPO = Path(__file__).resolve().parents[1]
DEMO_JSONL = REPO / "examples" / "data" / "demo_corpus.jsonl"
GOLDEN_TOKENIZER = REPO / "tests" / "data" / "golden" / "tok_bpe4k"


@pytest.fixture(scope="module")
def tok() -> HFTokenizer:
    return load_tokenizer(DEMO_TOKENIZER)


@pytest.fixture(scope="module")
def demo_splits(tok, tmp_path_factory):
    cache = tmp_path_factory.mktemp("index_cache")
    return build_gpt_datasets(
        DEMO_DATA_PREFIX, tok, seq_length=64, num_samples=(2000, 100, 20),
        split="90,8,2", seed=1234, cache_dir=cache,
    )  # fmt: skip


def read_indexed(prefix: str) -> list[np.ndarray]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    return [np.array(ds[i]) for i in range(len(ds))]  # copies: the mmap closes with `ds`


# --------------------------------------------------------------------------- tokenizer


def test_tokenizer_missing_names_config_field(tmp_path):
    with pytest.raises(TokenizerNotFoundError, match=r"data\.tokenizer.*tokenizer\.json"):
        load_tokenizer(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=r"data\.tokenizer"):
        load_tokenizer(tmp_path)  # a folder without tokenizer.json


def test_demo_tokenizer_interface(tok):
    assert tok.vocab_size == 4096
    assert tok.eod == tok.pad == 0 and tok.eod_token == "<|endoftext|>"
    text = 'It is a truth universally acknowledged, that a single man...\n\n"Oh!" said she.'
    ids = tok.tokenize(text)
    assert all(isinstance(i, int) for i in ids) and 0 not in ids
    assert tok.detokenize(ids) == text
    assert tok.detokenize(np.asarray(ids + [tok.eod])) == text + "<|endoftext|>"
    assert (
        tok.unique_identifiers["tokenizer_sha256"]
        == load_tokenizer(Path(DEMO_TOKENIZER) / "tokenizer.json").unique_identifiers[
            "tokenizer_sha256"
        ]
    )


def test_tokenizer_config_special_tokens():
    # tokenizer_config.json beside the file names eos/pad; they win over the built-in guesses.
    t = load_tokenizer(GOLDEN_TOKENIZER)
    assert (t.eod_token, t.pad_token) == ("<eos>", "<pad>")
    assert (t.eod, t.pad) == (2, 0)
    with pytest.raises(ValueError, match="not in the vocabulary"):
        load_tokenizer(GOLDEN_TOKENIZER, eod_token="<nope>")


# --------------------------------------------------------------------------- preprocess


def test_preprocess_round_trip_text_and_jsonl(tok, tmp_path):
    paragraphs = [
        "First document,\nover two lines.",
        "Second one.",
        "Third:  with   spaces\tand tab.",
    ]
    txt = tmp_path / "docs.txt"
    txt.write_text("\n\n\n".join(paragraphs) + "\n\n", encoding="utf-8")
    records = [{"text": "A jsonl document. é ü —", "id": 1}, {"text": "   "}, {"text": "Last."}]
    jl = tmp_path / "docs.jsonl"
    jl.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")

    assert preprocess_main([
        "--input", str(txt), str(jl), "--tokenizer", DEMO_TOKENIZER,
        "--output-prefix", str(tmp_path / "out"), "--no-progress",
    ]) == 0  # fmt: skip
    got = read_indexed(str(tmp_path / "out_text_document"))
    docs = paragraphs + ["A jsonl document. é ü —", "Last."]  # the blank jsonl text is skipped
    assert len(got) == len(docs)
    for doc, ids in zip(docs, got):
        assert ids.tolist() == tok.tokenize(doc) + [tok.eod]
    assert got[0].dtype == np.uint16


def test_preprocess_text_doc_modes(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("l1\nl2\n\nl3\n", encoding="utf-8")
    assert list(iter_documents(f)) == ["l1\nl2", "l3"]
    assert list(iter_documents(f, text_doc="line")) == ["l1", "l2", "l3"]
    assert list(iter_documents(f, text_doc="file")) == ["l1\nl2\n\nl3\n"]
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"content": "x"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"b\.jsonl:1: no 'text' field"):
        list(iter_documents(bad))


def test_shipped_demo_dataset_matches_corpus(tok):
    texts = [
        json.loads(line)["text"] for line in DEMO_JSONL.read_text(encoding="utf-8").splitlines()
    ]
    got = read_indexed(DEMO_DATA_PREFIX)
    assert len(got) == len(texts) == 140
    assert [g.tolist() for g in got] == [ids + [tok.eod] for ids in tok.tokenize_batch(texts)]


# --------------------------------------------------------------------------- datasets


def test_gpt_dataset_samples(demo_splits, tok):
    train, valid, test = demo_splits
    assert len(train) >= 2000 and len(valid) >= 100 and len(test) >= 20
    for i in (0, 1, len(train) - 1):
        s = train[i]
        assert set(s) == {"tokens", "labels", "loss_mask", "position_ids"}
        assert s["tokens"].shape == s["labels"].shape == (64,)
        assert s["tokens"].dtype == s["labels"].dtype == torch.int64
        assert torch.equal(s["labels"][:-1], s["tokens"][1:])
        assert torch.equal(s["position_ids"], torch.arange(64))
        assert s["loss_mask"].dtype == torch.float32 and bool((s["loss_mask"] == 1).all())
    # Every sample is a window of the token stream: it occurs in some document concatenation.
    stream = np.concatenate(read_indexed(DEMO_DATA_PREFIX)).astype(np.int64)
    window = torch.cat([train[3]["tokens"], train[3]["labels"][-1:]]).numpy()
    assert len(tok.detokenize(window)) > 64  # decodes to real text
    starts = np.flatnonzero(stream[: len(stream) - 64] == window[0])
    assert any((stream[j : j + 65] == window).all() for j in starts), "not a window of the corpus"


def test_gpt_dataset_deterministic_and_cached(tok, demo_splits, tmp_path):
    again = build_gpt_datasets(
        DEMO_DATA_PREFIX, tok, seq_length=64, num_samples=(2000, 100, 20),
        split="90,8,2", seed=1234, cache_dir=tmp_path,
    )  # fmt: skip
    for a, b in zip(demo_splits, again):
        assert torch.equal(a[7]["tokens"], b[7]["tokens"])
    other_seed = build_gpt_datasets(
        DEMO_DATA_PREFIX, tok, seq_length=64, num_samples=(2000, 100, 20),
        split="90,8,2", seed=7, cache_dir=tmp_path,
    )[0]  # fmt: skip
    assert not all(
        torch.equal(demo_splits[0][i]["tokens"], other_seed[i]["tokens"]) for i in range(4)
    )
    assert any(p.name.endswith("shuffle_index.npy") for p in tmp_path.iterdir())


def test_gpt_dataset_attention_mask_and_blend(tok, tmp_path):
    preprocess_main([
        "--input", str(DEMO_JSONL), "--tokenizer", DEMO_TOKENIZER,
        "--output-prefix", str(tmp_path / "copy"), "--no-progress",
    ])  # fmt: skip
    train, valid, test = build_gpt_datasets(
        [0.3, DEMO_DATA_PREFIX, 0.7, str(tmp_path / "copy_text_document")], tok,
        seq_length=32, num_samples=(500, 50, 0), split="90,10,0", cache_dir=tmp_path / "c",
        create_attention_mask=True,
    )  # fmt: skip
    assert test is None and len(train) == 500 and len(valid) == 50
    s = train[0]
    assert s["attention_mask"].shape == (1, 32, 32) and s["attention_mask"].dtype == torch.bool
    assert bool(s["attention_mask"][0, 0, 1]) and not bool(s["attention_mask"][0, 1, 0])


def test_dataset_errors(tok, tmp_path):
    with pytest.raises(FileNotFoundError, match="engram-preprocess"):
        build_gpt_datasets(str(tmp_path / "missing"), tok, seq_length=8, num_samples=(1, 1, 1))
    # 140 documents: a 1/1000 test share is empty; megatron would loop forever on it.
    with pytest.raises(ValueError, match="test split no document"):
        build_gpt_datasets(
            DEMO_DATA_PREFIX, tok, seq_length=8, num_samples=(1, 1, 1), split="949,50,1",
            cache_dir=tmp_path,
        )  # fmt: skip


def test_parse_blend():
    assert parse_blend("a") == (["a"], None)
    assert parse_blend(["a", "b"]) == (["a", "b"], None)
    assert parse_blend(["30", "a", "70", "b"]) == (["a", "b"], [30.0, 70.0])
    assert parse_blend([(1, "a"), (3, "b")]) == (["a", "b"], [1.0, 3.0])
    assert parse_blend({"a": 2}) == (["a"], [2.0])
    with pytest.raises(ValueError):
        parse_blend([0.5, "a", "b"])


# --------------------------------------------------------------------------- micro-batches


def take(it, n):
    return [next(it) for _ in range(n)]


@pytest.mark.parametrize("dp_size,micro", [(2, 2), (4, 1), (2, 1), (1, 4)])
def test_dp_split_union_is_the_global_batch(demo_splits, dp_size, micro):
    train = demo_splits[0]
    G = 8
    single = MicroBatchIterator(train, global_batch_size=G, micro_batch_size=G)
    ranks = [
        MicroBatchIterator(
            train, global_batch_size=G, micro_batch_size=micro, dp_rank=r, dp_size=dp_size
        )
        for r in range(dp_size)
    ]
    n_micro = G // (micro * dp_size)
    assert all(r.num_microbatches == n_micro for r in ranks)
    for _ in range(3):  # three global batches
        ref = next(single)
        per_rank = [take(r, n_micro) for r in ranks]
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            assert all(mb[key].shape == (micro, 64) for mbs in per_rank for mb in mbs)
            # Megatron order: micro-step k, then rank r, within the global batch.
            merged = torch.cat(
                [per_rank[r][k][key] for k in range(n_micro) for r in range(dp_size)]
            )
            assert torch.equal(merged, ref[key])
        assert ref["tokens"].dtype == torch.int64 and ref["loss_mask"].dtype == torch.float32


def test_resume_from_consumed_samples_equals_continuing(demo_splits):
    train = demo_splits[0]
    kw = dict(global_batch_size=12, micro_batch_size=3, dp_rank=1, dp_size=2)
    it = MicroBatchIterator(train, **kw)
    first = take(it, 2 * 2)  # two optimizer steps of 2 micro-batches
    state = it.state_dict()
    assert state == {"consumed_samples": 24}
    cont = take(it, 6)
    resumed = MicroBatchIterator(train, consumed_samples=state["consumed_samples"], **kw)
    for a, b in zip(cont, take(resumed, 6)):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(first[0]["tokens"], cont[0]["tokens"])


def test_iterator_stops_before_a_partial_global_batch():
    data = [{"tokens": torch.full((4,), i)} for i in range(23)]
    it = MicroBatchIterator(data, global_batch_size=10, micro_batch_size=5, dp_rank=0, dp_size=2)
    assert len(it) == 2
    got = [b["tokens"][:, 0].tolist() for b in it]
    assert got == [[0, 1, 2, 3, 4], [10, 11, 12, 13, 14]]


def test_batch_size_errors_name_fields():
    with pytest.raises(
        ValueError,
        match=r"global_batch_size \(10\).*micro_batch_size \(4\).*data-parallel size \(1\)",
    ):
        MicroBatchIterator([], global_batch_size=10, micro_batch_size=4)
    with pytest.raises(ValueError, match="consumed_samples"):
        MicroBatchIterator(
            [], global_batch_size=8, micro_batch_size=2, dp_size=2, consumed_samples=6
        )
    with pytest.raises(ValueError, match="dp_rank"):
        MicroBatchIterator([], global_batch_size=8, micro_batch_size=2, dp_rank=2, dp_size=2)


# --------------------------------------------------------------------------- hash prefetch


PRIMES = {1: [4001, 4003, 4007], 3: [5003, 5009, 5011]}


def ngram_hash(tokens: torch.Tensor) -> dict[int, np.ndarray]:
    """A deterministic n-gram hash (2-gram and 3-gram heads) in the Engram shape [B, S, K]."""
    x = tokens.numpy().astype(np.int64)
    prev1 = np.pad(x, ((0, 0), (1, 0)))[:, :-1]
    prev2 = np.pad(x, ((0, 0), (2, 0)))[:, :-2]
    out = {}
    for layer, primes in PRIMES.items():
        bigram = (x * 1000003) ^ (prev1 * 999331)
        trigram = bigram ^ (prev2 * 7919 * layer)
        heads = [bigram % primes[0], trigram % primes[1], (trigram * 31 + layer) % primes[2]]
        out[layer] = np.stack(heads, axis=-1)
    return out


@pytest.mark.parametrize("depth", [1, 4])
def test_prefetch_equals_inline(demo_splits, depth):
    def batches():  # the validation split: a few dozen micro-batches, iterated to its end
        return MicroBatchIterator(
            demo_splits[1], global_batch_size=8, micro_batch_size=2, dp_size=2, dp_rank=1
        )

    inline = list(HashPrefetchIterator(batches(), ngram_hash, prefetch=False))
    with HashPrefetchIterator(batches(), ngram_hash, prefetch=True, depth=depth) as it:
        prefetched = list(it)
        assert it.hash_s > 0 and it.wait_s >= 0
    assert len(inline) == len(prefetched) == len(batches())
    for a, b in zip(inline, prefetched):
        assert (
            set(a) == set(b) == {"tokens", "labels", "loss_mask", "position_ids", "engram_hash_ids"}
        )
        assert all(
            torch.equal(a[k], b[k]) for k in ("tokens", "labels", "loss_mask", "position_ids")
        )
        block = b["engram_hash_ids"]  # one [L, B, S, K] block, layers in the mapping's order
        assert block.dtype == torch.int64 and block.shape == (2, 2, 64, 3)
        assert torch.equal(a["engram_hash_ids"], block)
        expected = ngram_hash(b["tokens"])
        for slot, layer in enumerate((1, 3)):
            assert torch.equal(block[slot], torch.from_numpy(expected[layer]))


def test_prefetch_depth_is_validated():
    with pytest.raises(ValueError, match="depth must be a positive int"):
        HashPrefetchIterator([], ngram_hash, depth=0)


@pytest.mark.parametrize("prefetch", [True, False])
def test_hash_exception_reaches_consumer(prefetch):
    data = [{"tokens": torch.full((1, 4), i)} for i in range(5)]

    def hash_fn(tokens):
        if int(tokens[0, 0]) == 2:
            raise KeyError("bad batch 2")
        return {0: tokens.clone()}

    it = HashPrefetchIterator(data, hash_fn, prefetch=prefetch)
    assert [int(next(it)["tokens"][0, 0]) for _ in range(2)] == [0, 1]
    with pytest.raises(KeyError, match="bad batch 2"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)


def test_upstream_exception_reaches_consumer():
    def batches():
        yield {"tokens": torch.zeros(1, 2, dtype=torch.int64)}
        raise OSError("disk gone")

    it = HashPrefetchIterator(batches(), lambda t: {0: t})
    next(it)
    with pytest.raises(OSError, match="disk gone"):
        next(it)


def test_prefetch_runs_ahead_and_never_hands_out_unfinished_hash():
    n = 6
    finished: set[int] = set()
    started = [threading.Event() for _ in range(n)]
    threads = set()

    def hash_fn(tokens):
        i = int(tokens[0, 0])
        threads.add(threading.current_thread().name)
        started[i].set()
        time.sleep(0.02)
        out = {0: tokens * 2}
        finished.add(i)
        return out

    data = [{"tokens": torch.full((1, 3), i)} for i in range(n)]
    with HashPrefetchIterator(data, hash_fn, prefetch=True) as it:
        for i in range(n):
            batch = next(it)
            assert i in finished and torch.equal(batch["engram_hash_ids"][0], batch["tokens"] * 2)
            if i + 1 < n:  # micro-batch i+1 is hashed while the consumer holds micro-batch i ...
                assert started[i + 1].wait(timeout=5)
            time.sleep(0.05)
            if i + 2 < n:  # ... but nothing further ahead
                assert not started[i + 2].is_set()
        with pytest.raises(StopIteration):
            next(it)
    assert threads and threading.main_thread().name not in threads


def test_close_stops_the_thread():
    data = ({"tokens": torch.zeros(1, 2, dtype=torch.int64)} for _ in range(100))
    it = HashPrefetchIterator(data, lambda t: {0: t})
    next(it)
    it.close()
    assert not any(t.name.startswith("engram-hash") for t in threading.enumerate())
    with pytest.raises(StopIteration):
        next(it)

"""engram-export and EngramMemory against independent truth.

One trainer run (engram-train, 4 processes, TP2 x PP2 x eps 2, two steps) saves a checkpoint;
one rank loads it, saves it again as a single-rank checkpoint and records what its Engram
modules compute on a batch (tests/dist/export_reshard.py). Then:
- the two checkpoints export to byte-identical files (the exporter assembles TP/PP/eps shards
  as megatron's own loader does);
- EngramMemory reproduces the recorded Engram outputs: bit-exact on the full sequence, token by
  token to float32 round-off, with addresses bit-exact at every step;
- the DeepSeek reference module (transcribed below from the spec in the reference's layout and
  names, and checked against the golden vectors) loads a layer file as it is and reproduces
  them too, with hash constants recomputed from the config alone.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from golden_cases import GOLDEN_DIR, case_names, engram_config, load_meta, module_cases
from damage import corrupt
from launch import REPO, free_port, torchrun, run_process
from safetensors.numpy import load_file as load_numpy
from safetensors.torch import load_file, save_file
from torch import nn

from engram_train.engram.ngram_hash import NgramHashMapping
from engram_train.engram.engram_module import Engram
from engram_train.engram.reference_io import load_reference_state_dict
from engram_train.engram.compressed_tokenizer import CompressedTokenizer
from engram_train.export import ExportError, ExportFormatError, export_checkpoint, main
from engram_train.export.checkpoint_reader import DistCheckpointReader
from engram_train.export.format import TABLE, layer_tensor_names
from engram_train.inference import EngramMemory, IncrementalNgramHasher, megatron_state_dict

TOKENIZER = REPO / "examples" / "data" / "tokenizer"
DATA = REPO / "examples" / "data" / "demo_text_document"
LAYERS = [1, 3]  # engram_layer_ids of the deepseek_v3_tiny preset


# -- the DeepSeek reference, transcribed (spec sections 2 and 3; reference names, [B, T, G, d]) --

def ref_multipliers(layer_ids, max_ngram_size, compressed_vocab_size, seed):
    half = max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
    return {
        layer: np.random.default_rng(seed + 10007 * layer).integers(
            0, half, size=max_ngram_size, dtype=np.int64) * 2 + 1
        for layer in layer_ids
    }


def _is_prime(p: int) -> bool:
    return p > 1 and all(p % d for d in range(2, math.isqrt(p) + 1))


def ref_primes(vocab_sizes, max_ngram_size, heads, layer_ids):
    """{layer: [order][head]}: one walk over all layers, next unused prime above each start."""
    seen, out = set(), {}
    for layer in layer_ids:
        orders = []
        for n in range(2, max_ngram_size + 1):
            p, found = vocab_sizes[n - 2] - 1, []
            for _ in range(heads):
                p += 1
                while p in seen or not _is_prime(p):
                    p += 1
                seen.add(p)
                found.append(p)
            orders.append(found)
        out[layer] = orders
    return out


def ref_hash(input_ids, lookup, pad_id, multipliers, primes):
    """[B, T] raw ids -> [B, T, K] head-local hashes; `pad_id` compressed."""
    x = lookup[np.asarray(input_ids, dtype=np.int64)]
    seq = x.shape[1]
    shifts = [x] + [np.pad(x, ((0, 0), (k, 0)), constant_values=pad_id)[:, :seq]
                    for k in range(1, len(multipliers))]
    hashes = []
    for n in range(2, len(multipliers) + 1):
        mix = shifts[0] * multipliers[0]
        for k in range(1, n):
            mix = np.bitwise_xor(mix, shifts[k] * multipliers[k])
        hashes += [mix % int(p) for p in primes[n - 2]]
    return np.stack(hashes, axis=2)


class RefMultiHeadEmbedding(nn.Module):
    def __init__(self, head_sizes, dim):
        super().__init__()
        starts = np.concatenate([[0], np.cumsum(head_sizes)[:-1]])
        self.register_buffer("offsets", torch.tensor(starts, dtype=torch.long))
        self.embedding = nn.Embedding(int(sum(head_sizes)), dim)

    def forward(self, hash_ids):
        return self.embedding(hash_ids + self.offsets)


class RefShortConv(nn.Module):
    def __init__(self, hidden, kernel, dilation, streams):
        super().__init__()
        channels = hidden * streams
        self.conv = nn.Conv1d(channels, channels, kernel, groups=channels, bias=False,
                              padding=(kernel - 1) * dilation, dilation=dilation)
        self.norms = nn.ModuleList(nn.RMSNorm(hidden, eps=1e-5) for _ in range(streams))

    def forward(self, x):
        b, t, g, c = x.shape
        normed = torch.cat([self.norms[i](x[:, :, i]) for i in range(g)], dim=-1)
        y = nn.functional.silu(self.conv(normed.transpose(1, 2))[..., :t])
        return y.transpose(1, 2).reshape(b, t, g, c)


class RefEngram(nn.Module):
    def __init__(self, hidden, streams, head_sizes, head_dim, max_ngram_size, kernel):
        super().__init__()
        self.hidden, self.streams = hidden, streams
        memory = len(head_sizes) * head_dim
        self.multi_head_embedding = RefMultiHeadEmbedding(head_sizes, head_dim)
        self.short_conv = RefShortConv(hidden, kernel, max_ngram_size, streams)
        self.value_proj = nn.Linear(memory, hidden)
        self.key_projs = nn.ModuleList(nn.Linear(memory, hidden) for _ in range(streams))
        self.norm1 = nn.ModuleList(nn.RMSNorm(hidden) for _ in range(streams))
        self.norm2 = nn.ModuleList(nn.RMSNorm(hidden) for _ in range(streams))

    def forward(self, hidden_states, hash_ids):
        """hidden [B, T, G, d], hash ids [B, T, K] -> [B, T, G, d] (residual not added)."""
        e = self.multi_head_embedding(hash_ids).flatten(start_dim=-2)
        gates = []
        for g in range(self.streams):
            key = self.norm1[g](self.key_projs[g](e))
            query = self.norm2[g](hidden_states[:, :, g])
            s = (key * query).sum(dim=-1) / math.sqrt(self.hidden)
            s = s.abs().clamp_min(1e-6).sqrt() * s.sign()
            gates.append(s.sigmoid().unsqueeze(-1))
        value = torch.stack(gates, dim=2) * self.value_proj(e).unsqueeze(2)
        return value + self.short_conv(value)


@pytest.mark.parametrize("case,module_key", module_cases())
def test_reference_transcription_reproduces_golden(case, module_key):
    """The transcription above is DeepSeek's reference: it reproduces the golden vectors."""
    meta, spec = load_meta(case), load_meta(case)[module_key]
    layer = spec["layer_id"]
    hashes = load_numpy(str(GOLDEN_DIR / f"{case}_hash.safetensors"))
    golden = load_file(str(GOLDEN_DIR / f"{case}_{module_key}.safetensors"))
    lookup = hashes["compressed_lookup"]
    multipliers = ref_multipliers(meta["layer_ids"], meta["max_ngram_size"],
                                  int(lookup.max()) + 1, meta["seed"])
    primes = ref_primes(meta["engram_vocab_size"], meta["max_ngram_size"],
                        meta["n_head_per_ngram"], meta["layer_ids"])
    assert multipliers[layer].tolist() == meta["multipliers"][str(layer)]
    assert primes[layer] == meta["head_vocab_sizes"][str(layer)]
    hash_ids = ref_hash(golden["input_ids"].numpy(), lookup, int(lookup[meta["pad_id"]]),
                        multipliers[layer], primes[layer])
    np.testing.assert_array_equal(hash_ids, hashes[f"hash_layer{layer}"])

    head_dim = meta["n_embed_per_ngram"] // meta["n_head_per_ngram"]
    ref = RefEngram(spec["hidden_size"], spec["hc_mult"], [p for o in primes[layer] for p in o],
                    head_dim, meta["max_ngram_size"], meta["kernel_size"])
    num_rows, dim = golden["table_num_rows"].tolist()
    table = torch.zeros(num_rows, dim)
    table[golden["table_rows"]] = golden[f"param.{TABLE}.rows"]
    state = {k[len("param."):]: v for k, v in golden.items()
             if k.startswith("param.") and not k.endswith(".rows")}
    ref.load_state_dict({**state, TABLE: table})
    with torch.no_grad():
        output = ref(golden["hidden_states"], torch.from_numpy(hash_ids))
    torch.testing.assert_close(output, golden["output"], rtol=1e-5, atol=1e-6)


# -- one trained checkpoint (TP2 x PP2 x eps 2), its single-rank copy, recorded Engram I/O -------

def _run_trainer(cwd: Path, *overrides: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4",
           f"--master-port={free_port()}", "-m", "engram_train.train", *overrides]
    proc = run_process(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    exp = root / "run"
    ckpt = exp / "checkpoints"  # inside exp_dir: engram-export finds ../config.yaml itself
    _run_trainer(
        root,
        "system.tensor_model_parallel_size=2", "system.pipeline_model_parallel_size=2",
        "model.engram_embedding_parallel_size=2", "train.train_iters=2",
        "train.global_batch_size=4", "train.micro_batch_size=2", "train.seq_length=64",
        "train.lr_warmup_iters=0", "train.eval_interval=null", "train.log_interval=1",
        f"experiment.exp_dir={exp}", f"checkpoint.save={ckpt}", f"data.path={DATA}",
        f"data.tokenizer={TOKENIZER}",
    )
    single = root / "single"
    result = torchrun("export_reshard.py", 1, root / "io", "--ckpt", str(ckpt),
                      "--config", str(exp / "config.yaml"), "--save", str(single))[0]
    assert result == {"iteration": 2, "layers": LAYERS}
    return SimpleNamespace(root=root, exp=exp, ckpt=ckpt, single=single,
                           config=exp / "config.yaml",
                           io=load_file(str(root / "io" / "engram_io.safetensors")),
                           model_state=load_file(str(root / "io" / "model_state.safetensors")))


@pytest.fixture(scope="module")
def exports(trained):
    sharded, single = trained.root / "export_sharded", trained.root / "export_single"
    export_checkpoint(trained.ckpt, sharded, log=lambda _: None)  # run config found by itself
    export_checkpoint(trained.single, single, config=trained.config, log=lambda _: None)
    return SimpleNamespace(sharded=sharded, single=single)


def test_tp2_pp2_eps2_export_equals_single_rank_export(exports, trained):
    files = sorted(p.name for p in exports.sharded.iterdir())
    assert files == sorted(p.name for p in exports.single.iterdir())
    assert files == sorted([
        "backbone-00001-of-00001.safetensors", "backbone.safetensors.index.json",
        ".engram-export.json", "engram_config.json", "engram_hash.safetensors", "engram_layer1.safetensors",
        "engram_layer3.safetensors", "tokenizer.json",
    ])
    for name in files:
        a, b = (exports.sharded / name).read_bytes(), (exports.single / name).read_bytes()
        if name == "engram_config.json":
            a, b = json.loads(a), json.loads(b)
            assert a.pop("source") == {"checkpoint": str((trained.ckpt / "iter_0000002").resolve()),
                                       "iteration": 2}
            assert b.pop("source")["iteration"] == 2
        if name == ".engram-export.json":  # every file's size and SHA-256; engram_config.json's
            a, b = json.loads(a), json.loads(b)  # differs by its source (above)
            for marker, folder in ((a, exports.sharded), (b, exports.single)):
                assert sorted(marker["files"]) == sorted(f for f in files if f != name)
                for f, entry in marker["files"].items():
                    assert entry["sha256"] == hashlib.sha256((folder / f).read_bytes()).hexdigest()
                del marker["files"]["engram_config.json"]
        assert a == b, f"{name} differs between the TP2 x PP2 x eps 2 and the single-rank export"
    # The sharded checkpoint really was sharded: the tables in eps 2 row shards, TP splits.
    reader = DistCheckpointReader(trained.ckpt / "iter_0000002")
    assert len(reader.tensors["decoder.layers.1.engram.multi_head_embedding.weight"].chunks) == 2
    assert len(reader.tensors["decoder.layers.0.self_attention.linear_proj.weight"].chunks) == 2


def test_export_holds_every_tensor_under_its_documented_name(exports, trained):
    out = exports.sharded
    config = json.loads((out / "engram_config.json").read_text())
    reader = DistCheckpointReader(trained.ckpt / "iter_0000002")
    model_keys = reader.model_keys()
    engram_keys = [k for k in model_keys if ".engram." in k]

    # Engram layers: the reference's names; tables [total rows, D] with per-head offsets.
    cfg = engram_config_of(trained.config)
    tokenizer = CompressedTokenizer(TOKENIZER)
    mapping = NgramHashMapping(cfg, tokenizer)
    for layer in LAYERS:
        tensors = load_file(str(out / f"engram_layer{layer}.safetensors"))
        assert sorted(tensors) == sorted(layer_tensor_names(1))
        assert tensors[TABLE].shape == (mapping.num_rows[layer], 16)
        assert tensors["multi_head_embedding.offsets"].tolist() == mapping.offsets[layer].tolist()
        for name, value in tensors.items():
            ours = "multi_head_embedding.weight" if name == TABLE else name
            assert torch.equal(value, reader.read(f"decoder.layers.{layer}.engram.{ours}")), name
        info = config["layers"][str(layer)]
        assert info["num_rows"] == mapping.num_rows[layer]
        assert info["offsets"] == mapping.offsets[layer].tolist()

    # Hash constants, recomputed from the config alone, and the tokenizer's lookup.
    hashes = load_file(str(out / "engram_hash.safetensors"))
    np.testing.assert_array_equal(hashes["compressed_lookup"].numpy(), tokenizer.lookup)
    v_prime = tokenizer.vocab_size
    multipliers = ref_multipliers(LAYERS, 3, v_prime, seed=0)
    primes = ref_primes([20011, 20011], 3, 4, LAYERS)
    for layer in LAYERS:
        assert hashes[f"layer{layer}.multipliers"].tolist() == multipliers[layer].tolist()
        assert config["layers"][str(layer)]["multipliers"] == multipliers[layer].tolist()
        assert hashes[f"layer{layer}.primes"].tolist() == [p for o in primes[layer] for p in o]
        assert config["layers"][str(layer)]["primes"] == primes[layer]
    e = config["engram"]
    assert (e["layer_ids"], e["max_ngram_size"], e["n_head_per_ngram"], e["head_dim"],
            e["seed"], e["kernel_size"], e["hidden_size"], e["pad_id"]) == (
        LAYERS, 3, 4, 16, 0, 4, 64, 0)
    assert e["compressed_pad_id"] == int(tokenizer.lookup[0])
    assert config["tokenizer"]["compressed_vocab_size"] == v_prime
    assert config["tokenizer"]["sha256"] == tokenizer.sha256
    assert (out / "tokenizer.json").read_bytes() == (TOKENIZER / "tokenizer.json").read_bytes()

    # Backbone: every other model tensor, megatron's key, global shape, same values.
    index = json.loads((out / "backbone.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(set(model_keys) - set(engram_keys))
    backbone = load_file(str(out / "backbone-00001-of-00001.safetensors"))
    for key in index["weight_map"]:
        assert torch.equal(backbone[key], reader.read(key)), key
    assert config["backbone"]["vocab_size"] == backbone["embedding.word_embeddings.weight"].shape[0]


def test_export_is_the_whole_single_rank_model(exports, trained):
    """Every tensor of the model as one rank holds it after loading the TP2 x PP2 x eps 2
    checkpoint, under its state-dict name (the documented conversion), equal."""
    state = megatron_state_dict(exports.sharded)
    assert sorted(state) == sorted(trained.model_state)
    for name, value in trained.model_state.items():
        assert torch.equal(state[name], value), name


def engram_config_of(run_config: Path):
    from engram_train.export.exporter import engram_from_run_config
    from omegaconf import OmegaConf

    doc = OmegaConf.to_container(OmegaConf.load(run_config), resolve=True)
    return engram_from_run_config(doc, str(run_config))[0]


def _batch_first(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1).contiguous()


def test_engram_memory_reproduces_the_trained_model(exports, trained):
    memory = EngramMemory(exports.sharded)
    io = trained.io
    ids = io["input_ids"]
    batch, seq = ids.shape
    for layer in LAYERS:
        hidden, want = _batch_first(io[f"layer{layer}.hidden"]), _batch_first(
            io[f"layer{layer}.output"])
        recorded_hashes = _batch_first(io[f"layer{layer}.hash_ids"])

        # Whole sequence at once: the training module's computation, bit for bit.
        state = memory.new_state(batch)
        hash_ids = memory.hash(state, ids)[layer]
        assert torch.equal(hash_ids, recorded_hashes)
        rows = memory.lookup(layer, hash_ids)
        assert torch.equal(rows, _batch_first(io[f"layer{layer}.memory"]))
        output = memory.forward(layer, hidden, rows, state)
        assert torch.equal(output, want)

        # Token by token: addresses bit-exact at every step; output to float32 round-off
        # (only the projections' GEMM shapes differ: [B, E] per step instead of [S*B, E]).
        state, steps = memory.new_state(batch), []
        for t in range(seq):
            step_hashes = memory.hash(state, ids[:, t])[layer]
            assert torch.equal(step_hashes[:, 0], recorded_hashes[:, t])
            steps.append(memory.forward(layer, hidden[:, t:t + 1],
                                        memory.lookup(layer, step_hashes), state))
        torch.testing.assert_close(torch.cat(steps, dim=1), want, rtol=1e-5, atol=1e-7)

        # Prefill then decode.
        state = memory.new_state(batch)
        first = memory.prefetch(state, ids[:, :17])[layer]
        parts = [memory.forward(layer, hidden[:, :17], first, state)]
        for t in range(17, seq):
            parts.append(memory.forward(layer, hidden[:, t:t + 1],
                                        memory.prefetch(state, ids[:, t])[layer], state))
        torch.testing.assert_close(torch.cat(parts, dim=1), want, rtol=1e-5, atol=1e-7)


def test_reference_module_loaded_with_the_export_reproduces_the_trained_model(exports, trained):
    out, io = exports.sharded, trained.io
    lookup = load_numpy(str(out / "engram_hash.safetensors"))["compressed_lookup"]
    pad = int(lookup[0])
    multipliers = ref_multipliers(LAYERS, 3, int(lookup.max()) + 1, seed=0)
    primes = ref_primes([20011, 20011], 3, 4, LAYERS)
    for layer in LAYERS:
        ref = RefEngram(64, 1, [p for o in primes[layer] for p in o], 16, 3, 4)
        ref.load_state_dict(load_file(str(out / f"engram_layer{layer}.safetensors")))  # strict
        hash_ids = ref_hash(io["input_ids"].numpy(), lookup, pad, multipliers[layer],
                            primes[layer])
        np.testing.assert_array_equal(hash_ids, _batch_first(io[f"layer{layer}.hash_ids"]))
        with torch.no_grad():
            output = ref(_batch_first(io[f"layer{layer}.hidden"]).unsqueeze(2),
                         torch.from_numpy(hash_ids)).squeeze(2)
        torch.testing.assert_close(output, _batch_first(io[f"layer{layer}.output"]),
                                   rtol=1e-5, atol=1e-7)


def _with_random_conv(src: Path, dst: Path) -> Path:
    """A copy of an export whose conv weights are large: the conv state must carry them."""
    shutil.copytree(src, dst)
    g = torch.Generator().manual_seed(0)
    for layer in LAYERS:
        path = dst / f"engram_layer{layer}.safetensors"
        tensors = load_file(str(path))
        tensors["short_conv.conv.weight"] = torch.randn(
            tensors["short_conv.conv.weight"].shape, generator=g)
        save_file(tensors, str(path), metadata={"format": "pt"})
    return dst


def test_streaming_conv_state_and_slots(exports, tmp_path):
    out = _with_random_conv(exports.sharded, tmp_path / "export")
    memory = EngramMemory(out)
    config = memory.export.engram_config()
    lookup = load_numpy(str(out / "engram_hash.safetensors"))["compressed_lookup"]
    mapping = NgramHashMapping(config, tokenizer=lookup)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 4096, (3, 30), generator=g)
    hidden = torch.randn(3, 30, 64, generator=g)
    layer = 3
    module = Engram(config, 64, layer)
    load_reference_state_dict(module, load_file(str(out / f"engram_layer{layer}.safetensors")))
    full_hashes = torch.as_tensor(np.ascontiguousarray(mapping.hash(ids.numpy())[layer]))
    with torch.no_grad():
        want = module(_batch_first(hidden), hash_ids=_batch_first(full_hashes)).transpose(0, 1)
    assert want.abs().max() > 1.0  # the conv matters

    def decode(state, slot_ids, slot_hidden):
        hash_ids = memory.hash(state, slot_ids)[layer]
        return memory.forward(layer, slot_hidden, memory.lookup(layer, hash_ids), state)

    state = memory.new_state(3)
    steps = [decode(state, ids[:, t], hidden[:, t:t + 1]) for t in range(30)]
    torch.testing.assert_close(torch.cat(steps, dim=1), want, rtol=1e-5, atol=1e-6)

    # Sequences prefilled alone join a decoding batch; a finished slot restarts.
    batch = memory.new_state(2)
    for slot, row in ((0, 0), (1, 1)):
        alone = memory.new_state(1)
        decode(alone, ids[row:row + 1, :12], hidden[row:row + 1, :12])
        batch.copy_slot_(slot, alone)
    joined = [decode(batch, ids[:2, t], hidden[:2, t:t + 1]) for t in range(12, 20)]
    torch.testing.assert_close(torch.cat(joined, dim=1), want[:2, 12:20], rtol=1e-5, atol=1e-6)
    batch.reset([1])  # slot 0 goes on with sequence 0, slot 1 starts sequence 2
    mixed = [decode(batch, torch.stack([ids[0, 20 + t], ids[2, t]]),
                    torch.stack([hidden[0, 20 + t], hidden[2, t]])[:, None]) for t in range(8)]
    mixed = torch.cat(mixed, dim=1)
    torch.testing.assert_close(mixed[0], want[0, 20:28], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mixed[1], want[2, :8], rtol=1e-5, atol=1e-6)

    with pytest.raises(ValueError, match="call hash"):
        memory.forward(layer, hidden[:, :1], torch.zeros(3, 1, 128), memory.new_state(3))


def test_tables_are_memory_mapped_or_resident_on_request(exports):
    memory = EngramMemory(exports.sharded)
    for layer in LAYERS:
        path = str((exports.sharded / f"engram_layer{layer}.safetensors").resolve())
        table = memory.tables[layer]
        start = table.data_ptr()
        end = start + table.numel() * table.element_size()
        spans = []
        for line in Path("/proc/self/maps").read_text().splitlines():
            if line.endswith(path):
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                spans.append((lo, hi))
        assert any(lo <= start and end <= hi for lo, hi in spans), \
            f"layer {layer}: the table is not a view of a map of {path}"
    resident = EngramMemory(exports.sharded, tables="hugepages")
    for layer in LAYERS:
        assert torch.equal(resident.tables[layer], memory.tables[layer])
        assert resident.tables[layer].data_ptr() % (2 << 20) == 0  # huge-page aligned
    with pytest.raises(ValueError, match="tables="):
        EngramMemory(exports.sharded, tables="ram")
    memory.check_tokenizer(TOKENIZER)
    with pytest.raises(ValueError, match="not the tokenizer this export was trained with"):
        memory.check_tokenizer(GOLDEN_DIR / "tok_bpe4k")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_table_rows_small_and_large(dtype):
    from engram_train.inference.memory import SMALL_GATHER_BYTES, gather_table_rows

    table = torch.randn(5000, 24).to(dtype)
    row_bytes = 24 * table.element_size()
    for n in (1, SMALL_GATHER_BYTES // row_bytes, SMALL_GATHER_BYTES // row_bytes + 1):
        rows = torch.randint(0, 5000, (n,))
        assert torch.equal(gather_table_rows(table, rows), table[rows])
        out = torch.empty(n, 24, dtype=dtype)
        assert gather_table_rows(table, rows, out) is out and torch.equal(out, table[rows])
        with pytest.raises(IndexError):
            gather_table_rows(table, torch.cat([rows, torch.tensor([5000])]))


@pytest.mark.parametrize("reset_at_eos", [False, True])
def test_incremental_hashing_equals_full_sequence(reset_at_eos, tmp_path):
    meta = load_meta(case_names()[0])
    config = engram_config(meta)
    config.engram_reset_at_eos, config.engram_eos_id = reset_at_eos, 7
    mapping = NgramHashMapping(config, CompressedTokenizer(config.engram_tokenizer_name_or_path,
                                                           cache_dir=tmp_path))
    hasher = IncrementalNgramHasher(
        mapping.lookup, mapping.multipliers, mapping.primes, mapping.max_ngram_size,
        mapping.n_head_per_ngram, mapping.pad_id, 7 if reset_at_eos else None)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, mapping.num_raw_ids, size=(4, 200))
    ids[rng.random(ids.shape) < 0.08] = 7  # EOS, sometimes twice in a row
    full = np.stack([mapping.hash(ids)[layer] for layer in mapping.layer_ids])
    for largest in (1, 9):  # token by token, then random chunks (prefill + decode)
        history, t, got = hasher.new_history(4), 0, []
        while t < ids.shape[1]:
            size = int(rng.integers(1, largest + 1))
            got.append(hasher.extend(history, ids[:, t:t + size]))
            t += size
        np.testing.assert_array_equal(np.concatenate(got, axis=2), full)


def test_export_reads_one_stored_shard_at_a_time(trained, tmp_path, monkeypatch):
    from torch.distributed.checkpoint import FileSystemReader

    reads = []
    original = FileSystemReader.read_data

    def spy(self, plan, planner):
        reads.append([item.storage_index.fqn for item in plan.items])
        return original(self, plan, planner)

    monkeypatch.setattr(FileSystemReader, "read_data", spy)
    export_checkpoint(trained.ckpt, tmp_path / "out", log=lambda _: None)
    assert all(len(items) == 1 for items in reads)
    table = "decoder.layers.3.engram.multi_head_embedding.weight"
    assert sum(items == [table] for items in reads) == 2  # its two eps shards, one by one


def test_table_dtype_and_backbone_shards(trained, exports, tmp_path):
    out = export_checkpoint(trained.ckpt, tmp_path / "bf16", table_dtype="bf16",
                            max_shard_bytes=500_000, log=lambda _: None)
    for layer in LAYERS:
        table = load_file(str(out / f"engram_layer{layer}.safetensors"))[TABLE]
        fp32 = load_file(str(exports.sharded / f"engram_layer{layer}.safetensors"))[TABLE]
        assert table.dtype == torch.bfloat16 and torch.equal(table, fp32.bfloat16())
    index = json.loads((out / "backbone.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"backbone-00001-of-{len(files):05d}.safetensors"
    merged = {}
    for name in files:
        merged.update(load_file(str(out / name)))
    reference = load_file(str(exports.sharded / "backbone-00001-of-00001.safetensors"))
    assert merged.keys() == reference.keys()
    assert all(torch.equal(merged[k], reference[k]) for k in merged)
    memory = EngramMemory(out)  # reads bf16 tables, computes in the dense part's dtype
    state = memory.new_state(2)
    y = memory.forward(1, _batch_first(trained.io["layer1.hidden"]),
                       memory.prefetch(state, trained.io["input_ids"])[1], state)
    torch.testing.assert_close(y, _batch_first(trained.io["layer1.output"]), rtol=0.05,
                               atol=1e-3)


def _cli_error(*argv) -> str:
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in argv])
    return str(exc.value)


def test_cli_errors_name_the_problem(trained, tmp_path):
    out = tmp_path / "out"
    assert "does not exist" in _cli_error("--load", tmp_path / "nope", "--out", out)
    (tmp_path / "empty").mkdir()
    assert "is not a checkpoint" in _cli_error("--load", tmp_path / "empty", "--out", out)
    assert "has no iteration 5" in _cli_error("--load", trained.ckpt, "--out", out,
                                              "--iteration", "5")
    assert "--config" in _cli_error("--load", trained.single, "--out", out)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert "--force" in _cli_error("--load", trained.ckpt, "--out", tmp_path / "full")

    text = trained.config.read_text()
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text(text.replace("  - 20011\n  - 20011", "  - 30011\n  - 30011"))
    # The run identity in the manifest names the field; without one (trained.single), the
    # tensor shapes and layers still give the config away.
    message = _cli_error("--load", trained.ckpt, "--out", out, "--config", wrong)
    assert "model.engram_vocab_size: [20011, 20011] in the checkpoint, [30011, 30011] in the run " \
           "config" in message
    message = _cli_error("--load", trained.single, "--out", out, "--config", wrong)
    assert "engram_vocab_size" in message and "multi_head_embedding.embedding.weight" in message
    wrong.write_text(text.replace("engram_layer_ids:\n  - 1\n  - 3",
                                  "engram_layer_ids:\n  - 1\n  - 2"))
    assert "model.engram_layer_ids: [1, 3] in the checkpoint, [1, 2] in the run config" in _cli_error(
        "--load", trained.ckpt, "--out", out, "--config", wrong)
    assert "Engram layers [1, 3]" in _cli_error("--load", trained.single, "--out", out,
                                                "--config", wrong)
    moved = tmp_path / "moved.yaml"
    moved.write_text(text.replace(str(TOKENIZER), "/nowhere/tokenizer"))
    assert "--tokenizer" in _cli_error("--load", trained.ckpt, "--out", out, "--config", moved)
    assert not out.exists()


def test_export_refuses_a_damaged_checkpoint_naming_the_file(trained, tmp_path):
    """64 KiB of random bytes in a shard (issue 26): the trainer's check and message, nothing
    written. --no-verify skips the checksums; sizes are compared either way."""
    damaged = tmp_path / "ckpt"
    shutil.copytree(trained.ckpt, damaged)
    shard = max((damaged / "iter_0000002").glob("*.distcp"), key=lambda p: p.stat().st_size)
    corrupt(shard)
    out = tmp_path / "out"
    message = _cli_error("--load", damaged, "--out", out, "--config", trained.config)
    assert message.startswith(f"engram-export: error: checkpoint {damaged / 'iter_0000002'} is damaged; nothing "
                              f"was exported:\n  {shard}: contents changed since the save (SHA-256 differs)")
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    logged = []
    export_checkpoint(trained.ckpt, out, verify=False, log=logged.append)
    assert any("match manifest.json (sizes only: --no-verify)" in m for m in logged)
    size = shard.stat().st_size
    corrupt(shard, truncate=True)
    message = _cli_error("--load", damaged, "--out", tmp_path / "out2", "--no-verify")
    assert f"{shard}: {size // 2} bytes, {size} were written" in message


def test_export_refuses_a_run_config_of_another_identity(trained, tmp_path):
    """A run config whose engram_seed differs from the checkpoint's (issue 26), or another
    tokenizer: stopped naming the field and both values, nothing written."""
    seed = tmp_path / "seed.yaml"
    text = trained.config.read_text()
    assert "  engram_seed: 0\n" in text
    seed.write_text(text.replace("  engram_seed: 0\n", "  engram_seed: 1\n"))
    out = tmp_path / "out"
    message = _cli_error("--load", trained.ckpt, "--out", out, "--config", seed)
    assert (f"{seed} does not match the run identity stored with checkpoint {trained.ckpt / 'iter_0000002'}:\n"
            "  - model.engram_seed: 0 in the checkpoint, 1 in the run config\n") in message
    assert "multipliers" not in message  # derived from the seed: not repeated
    message = _cli_error("--load", trained.ckpt, "--out", out, "--tokenizer", GOLDEN_DIR / "tok_bpe4k")
    assert "model.engram_tokenizer_name_or_path (or --tokenizer): the compressed vocabulary: " in message
    assert "lookup_sha256" in message and "compressed_vocab_size" in message
    assert not out.exists()


def test_export_says_what_it_could_not_check(trained, tmp_path):
    """A checkpoint saved before manifests existed, and one whose manifest has no run identity
    (saved by a tool): exported, with a warning naming what was not checked."""
    old = tmp_path / "old"
    shutil.copytree(trained.ckpt, old)
    (old / "iter_0000002" / "manifest.json").unlink()
    logged = []
    export_checkpoint(old, tmp_path / "a", config=trained.config, log=logged.append)
    warning = [m for m in logged if m.startswith("warning:")]
    assert len(warning) == 1 and "has no manifest.json (saved before manifests existed)" in warning[0]
    assert "could not be checked for damage (sizes, SHA-256), nor its run identity (Engram hash seed" in warning[0]
    logged = []
    export_checkpoint(trained.single, tmp_path / "b", config=trained.config, log=logged.append)
    assert [m for m in logged if m.startswith("warning:")] == [
        f"warning: {trained.single / 'iter_0000002'}/manifest.json records no run identity (saved by a tool, or "
        "before identities existed): the Engram hash seed, tokenizer, N, H, layer ids, primes and multipliers "
        f"could not be compared with {trained.config}"]
    assert (tmp_path / "a" / "engram_layer1.safetensors").read_bytes() == (
        tmp_path / "b" / "engram_layer1.safetensors").read_bytes()


def test_engram_memory_prompt_edges(exports):
    """An empty prompt (issue 26) gives an empty result, the same for a tensor and a nested list,
    and leaves the state as it was; other dtypes are refused naming the expected one; an
    out-of-range id is reported as a prompt problem."""
    memory = EngramMemory(exports.sharded)
    ids = torch.tensor([[5, 17, 3000, 42]])
    fresh = memory.new_state(1)
    hidden = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(0))
    want = {layer: memory.forward(layer, hidden, rows, fresh)
            for layer, rows in memory.prefetch(fresh, ids).items()}
    for empty in (torch.zeros(1, 0, dtype=torch.long), [[]]):
        state = memory.new_state(1)
        rows = memory.prefetch(state, empty)
        assert {layer: tuple(r.shape) for layer, r in rows.items()} == {layer: (1, 0, 128) for layer in LAYERS}
        for layer in LAYERS:
            assert memory.forward(layer, hidden[:, :0], rows[layer], state).shape == (1, 0, 64)
        assert state.hashed == 0 and (state.history == memory.hasher.pad_id).all()
        assert all(not conv.any() for conv in state.conv.values())
        for layer, rows_ in memory.prefetch(state, ids).items():  # the state goes on as fresh
            torch.testing.assert_close(memory.forward(layer, hidden, rows_, state), want[layer], rtol=0, atol=0)
    for wrong in (torch.tensor([[1.0, 2.0]]), [[1.5]], torch.tensor([[True]])):
        with pytest.raises(TypeError, match=r"token ids must be integers \(torch.int64 / numpy.int64"):
            memory.prefetch(memory.new_state(1), wrong)
    state = memory.new_state(1)
    rows = memory.prefetch(state, ids)
    with pytest.raises(TypeError, match=r"hidden_states has dtype torch.float64, this EngramMemory runs in "
                                        r"torch.float32 .*hidden_states.to\(torch.float32\)"):
        memory.forward(1, hidden.double(), rows[1], state)
    with pytest.raises(ValueError, match=r"token id 4096 at \[sequence, position\] \[0, 1\] of the prompt is "
                                         r"outside the export's tokenizer range \[0, 4096\)") as err:
        memory.prefetch(memory.new_state(1), [[7, 4096]])
    assert "data" not in str(err.value) and "tokenizer.json" in str(err.value)


def test_cli_writes_atomically_and_replaces_with_force(trained, tmp_path, monkeypatch):
    from engram_train.export import exporter

    out = tmp_path / "out"
    calls = []
    original = exporter._write_file

    def fail_second(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 2:
            raise RuntimeError("disk full")
        return original(*args, **kwargs)

    monkeypatch.setattr(exporter, "_write_file", fail_second)
    with pytest.raises(RuntimeError, match="disk full"):
        main(["--load", str(trained.ckpt), "--out", str(out)])
    assert list(tmp_path.iterdir()) == []  # neither the export nor its temporary folder
    monkeypatch.undo()

    out.mkdir()
    (out / "old").write_text("old")
    assert "is not an earlier export" in _cli_error("--load", trained.ckpt, "--out", out, "--force")
    assert (out / "old").read_text() == "old"  # --force replaces only an earlier export
    (out / "old").unlink()
    main(["--load", str(trained.ckpt), "--out", str(out), "--iteration", "2"])
    (out / "old").write_text("old")
    main(["--load", str(trained.ckpt), "--out", str(out), "--force", "--iteration", "2"])
    assert not (out / "old").exists() and (out / "engram_config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]

    help_text = run_process([sys.executable, "-m", "engram_train.export", "--help"],
                               capture_output=True, text=True, check=True).stdout
    for flag in ("--load", "--out", "--iteration", "--config", "--force", "--table-dtype"):
        assert flag in help_text


def test_run_config_sources_and_iteration_folders(trained, exports, tmp_path, monkeypatch):
    from omegaconf import OmegaConf

    # One iteration's folder as --load; --iteration must then agree with it.
    iteration = trained.single / "iter_0000002"
    out = export_checkpoint(iteration, tmp_path / "a", config=trained.config, log=lambda _: None)
    assert json.loads((out / "engram_config.json").read_text())["source"]["iteration"] == 2
    assert "does not match" in _cli_error("--load", iteration, "--out", tmp_path / "b",
                                          "--iteration", "4", "--config", trained.config)
    # A run config stored in the checkpoint's extra state needs no --config.
    run_config = OmegaConf.to_container(OmegaConf.load(trained.config), resolve=True)
    original = DistCheckpointReader.common_state

    def with_run_config(self):
        common = original(self)
        common["extra"]["run_config"] = run_config
        return common

    monkeypatch.setattr(DistCheckpointReader, "common_state", with_run_config)
    messages = []
    out = export_checkpoint(trained.single, tmp_path / "c", log=messages.append)
    assert any("run config: the checkpoint's extra.run_config" in m for m in messages)
    assert (out / "engram_layer1.safetensors").read_bytes() == (
        exports.single / "engram_layer1.safetensors").read_bytes()


def test_reader_refuses_unknown_format_versions(exports, tmp_path):
    out = tmp_path / "export"
    shutil.copytree(exports.sharded, out)
    config = json.loads((out / "engram_config.json").read_text())
    config["format_version"] = 99
    (out / "engram_config.json").write_text(json.dumps(config))
    with pytest.raises(ExportFormatError, match="format_version 99"):
        EngramMemory(out)
    with pytest.raises(ExportFormatError, match="no engram_config.json"):
        EngramMemory(tmp_path)
    assert issubclass(ExportError, ValueError)

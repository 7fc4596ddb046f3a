"""Every model preset and every trainer command in the README, the docs and the Makefile:

- each command's run configuration validates for its layout (the world size it launches; no
  process is started, data files under /data are not required), and its model config builds;
- every preset appears in at least one such command (its stated layout);
- each preset's model, built on the meta device, has the parameter counts of a closed-form
  count from its fields (independent of megatron's modules), and docs/presets.md states them;
- Engram-27B and its MoE-27B baseline match the paper's rounded figures and are iso-parameter.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from engram_train.config import register

from launch import REPO, run_process

CONF = REPO / "conf"
PRESETS = sorted(p.stem for p in (CONF / "model").glob("*.yaml"))
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# The tokenizer of the paper's models (DeepSeek-V3's, 129,280 entries); the other presets count
# with the configured data.tokenizer (the demo's 4,096).
PAPER_VOCAB = 129_280
VOCAB = {"engram_27b": PAPER_VOCAB, "moe_27b": PAPER_VOCAB, "deepseek_v41_flash": PAPER_VOCAB}


# -- commands ------------------------------------------------------------------------------------

def shell_blocks(path: Path) -> list[str]:
    """Commands of the ```bash blocks of a markdown file, continuation lines joined."""
    text = path.read_text()
    commands = []
    for block in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def makefile_demo() -> str:
    recipe = re.search(r"^demo:.*\n\t(.+)$", (REPO / "Makefile").read_text(), flags=re.M).group(1)
    return recipe.replace("$(VENV)/bin/", "")


def parse(command: str) -> dict | None:
    """A trainer (or param_count) command -> {world, overrides, mode}; None for other commands."""
    words = shlex.split(command.replace("$", ""))
    words = [w for w in words if not re.fullmatch(r"[A-Z_]+=\S*", w)]  # env assignments
    if not words:
        return None
    if "engram_train.train" in words:
        start, mode = words.index("engram_train.train") + 1, "train"
    elif words[0] == "engram-train":
        start, mode = 1, "train"
    elif "engram_train.training.param_count" in words:
        start, mode = words.index("engram_train.training.param_count") + 1, "count"
    else:
        return None
    options = {}
    for i, w in enumerate(words):
        if w.startswith("--") and "=" in w:
            options[w[2:].split("=")[0]] = w.split("=", 1)[1]
        elif w.startswith("--") and i + 1 < len(words):
            options[w[2:]] = words[i + 1]
    if "config-dir" in options:
        # the config folder an earlier command of the same block writes (an import's conf/):
        # tests/test_docs.py runs such blocks at tiny size instead
        return None
    if "--cfg" in words:
        mode = "print"
    world = int(options.get("nproc-per-node", 1)) * int(options.get("nnodes", 1))
    if mode == "count":
        world = int(options.get("world-size", 1))
    overrides = [w for w in words[start:] if "=" in w and not w.startswith("-")]
    return dict(command=command, world=world, overrides=overrides, mode=mode)


def all_commands() -> list[dict]:
    found = [makefile_demo()] + [c for doc in DOCS for c in shell_blocks(doc)]
    return [p for p in map(parse, found) if p is not None]


COMMANDS = all_commands()


def _cfg(overrides):
    register()  # the run config's schema (conf/train.yaml's defaults)
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(config_name="train", overrides=list(overrides))


def _model(command: dict) -> str:
    chosen = [o.split("=", 1)[1] for o in command["overrides"] if o.startswith("model=")]
    return chosen[-1] if chosen else "deepseek_v3_tiny"


def test_commands_were_found():
    worlds = {(c["mode"], c["world"]) for c in COMMANDS}
    assert ("train", 2) in worlds and ("train", 8) in worlds and ("train", 64) in worlds, worlds
    assert any(c["mode"] == "print" for c in COMMANDS)


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c["command"][:90])
def test_every_command_validates_for_its_layout(command):
    from engram_train.training.run_config import build_transformer_config, validate_run_config

    cfg = _cfg(command["overrides"])
    # /data/... lives on a cluster; outputs/... is written by a documented command before it
    # (engram-preprocess; tests/test_docs.py runs that one)
    remote_data = any(o.startswith(("data.path=/", "data.tokenizer=/", "data.path=outputs/"))
                      for o in command["overrides"])
    if command["mode"] != "print":
        validate_run_config(cfg, command["world"], check_data=not remote_data)
    build_transformer_config(cfg)


def test_every_preset_has_a_stated_layout():
    stated = {_model(c) for c in COMMANDS if c["mode"] in ("train", "count") and c["world"] > 1}
    assert set(PRESETS) <= stated, f"presets without a documented multi-process command: {set(PRESETS) - stated}"


def test_engram_27b_commands_keep_the_papers_experts():
    runs = [c for c in COMMANDS if c["mode"] == "train" and _model(c) == "engram_27b"]
    assert runs
    for command in runs:
        cfg = _cfg(command["overrides"])
        assert (cfg.model.num_moe_experts, cfg.model.moe_router_topk) == (55, 6)
        assert command["world"] >= 8 * cfg.system.pipeline_model_parallel_size


# -- parameter counts ----------------------------------------------------------------------------

def v41_engram_rows(layers: int, orders: int, heads: int, vocab: int) -> list[int]:
    """Rows of each V4.1 Engram layer's table: its heads' primes, drawn above ``vocab`` for
    every order with one ``seen`` set over all layers (the released rule)."""
    def is_prime(n: int) -> bool:
        return n > 1 and all(n % i for i in range(2, int(n ** 0.5) + 1))

    seen, rows = set(), []
    for _ in range(layers):
        total = 0
        for _ in range(orders * heads):
            current = vocab
            while not is_prime(current) or current in seen:
                current += 1
            seen.add(current)
            total += current
        rows.append(total)
    return rows


def closed_form_v41(m, vocab: int) -> dict:
    """DeepSeek-V4.1's counts from its fields (V4.1's names, docs/deepseek-v41.md)."""
    d, n, L = m.hidden_size, m.hc_mult, m.num_hidden_layers
    h, hd, ql, ol, g = m.num_attention_heads, m.head_dim, m.q_lora_rank, m.o_lora_rank, m.o_groups
    ih, ihd = m.index_n_heads, m.index_head_dim
    inter, experts = m.moe_intermediate_size, m.n_routed_experts
    attention = (d * ql + ql + ql * h * hd + d * hd + hd + g * ol * (h * hd // g) + g * ol * d
                 + h)  # wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b, sinks
    mhc = 2 * ((2 + n) * n * n * d + (2 + n) * n + 3)  # attn_hc, ffn_hc
    moe = experts * d + experts * 3 * d * inter + 3 * d * inter  # router, routed, shared
    total = 2 * vocab * d + d + L * (attention + 2 * d + mhc + moe)
    for i in range(L):
        ratio = m.compress_ratios[i]
        if i in m.kv_source_layer_ids:  # compressor (wkv, wgate above ratio 1, norm); index keys
            total += d * hd + (d * hd if ratio > 1 else 0) + hd + hd * ihd + ihd
        if i in m.index_source_layer_ids:  # indexer queries and head weights
            total += ql * ih * ihd + d * ih
    tables = dense = 0
    if m.use_engram:
        width = m.n_embed_per_ngram // m.n_head_per_ngram
        rows = v41_engram_rows(len(m.engram_layer_ids), m.max_ngram_size - 1,
                               m.n_head_per_ngram, m.engram_vocab_size[0])
        tables = sum(rows) * width
        memory = (m.max_ngram_size - 1) * m.n_embed_per_ngram
        dense = len(m.engram_layer_ids) * (memory * (n + 1) * d + 2 * n * d)  # wkv, q/k weights
    total += tables + dense
    unrouted = L * (experts - m.num_experts_per_tok) * 3 * d * inter
    return dict(total=total, activated=total - vocab * d - tables - unrouted,
                engram_tables=tables, engram_dense=dense)


def closed_form(m, vocab: int) -> dict:
    """Parameter counts from the preset's fields (MLA + RMSNorm + SwiGLU MoE, untied output)."""
    from engram_train.engram.ngram_hash import engram_head_vocab_sizes

    if m.get("model_family", "deepseek_v3") == "deepseek_v41":
        return closed_form_v41(m, vocab)

    d, h, L = m.hidden_size, m.num_attention_heads, m.num_layers
    attention = (d * m.q_lora_rank + m.q_lora_rank  # q down + its norm
                 + m.q_lora_rank * h * (m.qk_head_dim + m.qk_pos_emb_head_dim)
                 + d * (m.kv_lora_rank + m.qk_pos_emb_head_dim) + m.kv_lora_rank
                 + m.kv_lora_rank * h * (m.qk_head_dim + m.v_head_dim)
                 + h * m.v_head_dim * d)
    layer = attention + 2 * d  # input and pre-MLP norms
    dense_mlp = 3 * d * m.ffn_hidden_size
    expert = 3 * d * m.moe_ffn_hidden_size
    moe_layers = L - m.first_k_dense_replace
    moe = m.num_moe_experts * d + m.num_moe_experts * expert + 3 * d * m.moe_shared_expert_intermediate_size
    tables = dense = hyper = 0
    streams = m.num_residual_streams if m.enable_hyper_connections else 1
    if m.enable_hyper_connections:  # attn_hc and ffn_hc per layer, the head collapse
        n = streams
        hyper = L * 2 * ((2 + n) * n * n * d + (2 + n) * n + 3) + n * n * d + n + 1
    if m.use_engram:
        n, heads, width = m.max_ngram_size, m.n_head_per_ngram, m.n_embed_per_ngram
        primes = engram_head_vocab_sizes(list(m.engram_vocab_size), n, heads, list(m.engram_layer_ids))
        tables = sum(p for layer_primes in primes.values() for order in layer_primes for p in order) \
            * (width // heads)
        e = (n - 1) * width
        g = streams  # value projection, g key projections, g norm pairs, conv and its norms
        dense = len(m.engram_layer_ids) * ((1 + g) * (e * d + d) + 2 * g * d
                                           + g * d * m.engram_kernel_size + g * d)
    total = (2 * vocab * d + d + L * layer + m.first_k_dense_replace * dense_mlp
             + moe_layers * moe + tables + dense + hyper)
    unrouted = moe_layers * (m.num_moe_experts - m.moe_router_topk) * expert
    return dict(total=total, activated=total - vocab * d - tables - unrouted,
                engram_tables=tables, engram_dense=dense)


@pytest.fixture(scope="module")
def counts():
    """Every preset built on the meta device, in one process (single-rank parallel state)."""
    wanted = {name: VOCAB.get(name) for name in PRESETS}
    proc = run_process([sys.executable, "tests/dist/preset_counts.py", json.dumps(wanted)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.split("COUNTS", 1)[1])
    for name, c in result.items():
        print(f"{name}: total {c['total']:,} activated {c['activated']:,} "
              f"engram tables {c['engram_tables']:,} (vocab {c['vocab_size']:,})")
    return result


@pytest.mark.parametrize("preset", PRESETS)
def test_meta_counts_equal_the_closed_form(counts, preset):
    c = counts[preset]
    want = closed_form(_cfg([f"model={preset}"]).model, c["vocab_size"])
    for key, value in want.items():
        assert c[key] == value, (preset, key, c[key], value)


def test_paper_figures(counts):
    """Engram-27B vs MoE-27B as the paper gives them (rounded to 0.1B): 26.7B total, 3.8B
    activated; Engram-27B's Engram parameters ~5.7B; both models iso-parameter."""
    engram, moe = counts["engram_27b"], counts["moe_27b"]
    assert round(moe["total"] / 1e9, 1) == 26.7 and round(engram["total"] / 1e9, 1) == 26.7
    assert round(moe["activated"] / 1e9, 1) == 3.8
    assert abs(engram["total"] - moe["total"]) / moe["total"] < 1e-3
    assert abs(engram["engram_tables"] + engram["engram_dense"] - 5.7e9) / 5.7e9 < 0.03
    assert moe["engram_tables"] == 0


def _doc_table() -> dict[str, dict[str, int]]:
    """The counts table of docs/presets.md: | `preset` | total | activated | tables | ... |"""
    rows = {}
    for line in (REPO / "docs" / "presets.md").read_text().splitlines():
        m = re.match(r"\|\s*`(\w+)`\s*\|\s*([\d,]+)\s*\|\s*([\d,]+)\s*\|\s*([\d,]+)\s*\|\s*([\d,]+)\s*\|", line)
        if m:
            rows[m.group(1)] = dict(zip(("total", "activated", "engram_tables", "engram_dense"),
                                        (int(g.replace(",", "")) for g in m.groups()[1:])))
    return rows


def test_docs_state_the_counts(counts):
    table = _doc_table()
    assert sorted(table) == PRESETS
    for preset, row in table.items():
        for key, value in row.items():
            assert counts[preset][key] == value, (preset, key)


def test_mla_under_tp_without_sequence_parallel_is_refused_only_where_unrepaired(monkeypatch):
    """Dense MLA under TP trains with and without sequence parallelism on the local spec (its
    MLASelfAttention sums the shared RoPE key's gradient over TP and scales the q-latent norm's
    gradient for megatron's TP sum; tests/test_context_parallel.py checks every first gradient
    against DP). Transformer Engine's spec has neither repair: refused there, as MoE under TP
    without sequence parallelism is (megatron's own rule)."""
    from engram_train.models.deepseek_v3 import v3_specs as specs
    from engram_train.training.run_config import ConfigError, validate_run_config

    dense_tp2 = ["model.num_moe_experts=null", "model.moe_ffn_hidden_size=null",
                 "model.moe_shared_expert_intermediate_size=null",
                 "system.tensor_model_parallel_size=2"]
    validate_run_config(_cfg([*dense_tp2, "system.sequence_parallel=false"]), 2)
    validate_run_config(_cfg([*dense_tp2, "system.sequence_parallel=false",
                              "+model.qk_layernorm=false"]), 2)
    validate_run_config(_cfg(dense_tp2), 2)  # auto: sequence parallel on
    with pytest.raises(ConfigError, match=r"MoE with tensor_model_parallel_size > 1 needs "
                                          r"sequence parallelism"):
        validate_run_config(_cfg(["system.tensor_model_parallel_size=2",
                                  "system.sequence_parallel=false"]), 2)
    monkeypatch.setattr(specs, "use_transformer_engine", lambda: True)
    with pytest.raises(ConfigError, match=r"system.sequence_parallel: true .* Transformer "
                                          r"Engine's MLA: .* RoPE key's gradient partial"):
        validate_run_config(_cfg([*dense_tp2, "system.sequence_parallel=false"]), 2)

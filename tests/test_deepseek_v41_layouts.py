"""DeepSeek-V4.1 (``model=deepseek_v41_tiny`` with one more layer, 8: two pipeline stages split
them evenly) in the layouts the trainer runs it in, against one process: the same losses within
1e-5 over 5 steps at lr 3e-4 (the layouts that split the experts' rows within
EXPERT_LAYOUT_TOLERANCE), and TP2 x EP2, EP4 and PP2 within 1e-6 over the first 3 steps, these
on both megatron-core lanes (``every_lane``); every run loads one checkpoint that one process
saved after one step, and trains when a test first reads it (`Runs`) (docs/deepseek-v41.md
'Layouts').

The 8 layers: 0 window; 1 full (ratio 2); 2 reindex; 3 full (ratio 1), the candidate source;
4, 5 reuse; 6 reindex inside the candidates; 7 reuse; Engram on layers 1 and 5. Two pipeline
stages split them after layer 3, so every field of the CSA2 state (compressed KV, index keys,
selection, candidates) crosses the boundary, and each stage has an Engram layer.

The comparisons run with ``model.fake_quantize=false``: the released caches' FP8/FP4 rounding
turns float-order differences of 1e-7 (a micro-batch split at one process is enough) into
whole quantization steps of a few KV elements, and the losses part by about 1e-4 within 5
steps whatever the layout; without it one process with two micro-batches and one with four
agree within 1e-6.
"""

from __future__ import annotations

import json

import pytest

from launch import torchrun, trainer_metrics

EIGHT_LAYERS = ("model.num_hidden_layers=8", "model.compress_ratios=[0,2,2,1,1,1,1,1]",
                "model.kv_source_layer_ids=[1,3]", "model.index_source_layer_ids=[1,2,3,6]",
                "model.candidate_source_layer_id=3", "model.engram_layer_ids=[1,5]")
COMMON = ("model=deepseek_v41_tiny", "train.global_batch_size=4", "train.micro_batch_size=2",
          "train.seq_length=64", "train.log_interval=1", "train.eval_interval=null",
          "train.lr=3e-4", "train.min_lr=3e-4", "train.lr_warmup_iters=0",
          "train.lr_decay_style=constant", "train.lr_decay_iters=6", *EIGHT_LAYERS)
STEPS = 5
EXPERT_LAYOUT_TOLERANCE = 5e-5
"""Layouts where an expert sees another number of rows than at one process (EP: tokens of all
EP ranks; TP with sequence parallelism: each rank routes its slice), over the 5 steps.
Measured: within 9.5e-7 (one float32 ulp of the loss). Not 1e-6: a top-k near-tie, or a token
at Engram's gate floor, turns last bits into 1e-5-level steps whatever the layout. With the
routing weight before w2 (an earlier version) one query's candidate blocks at layer 3 had their
8th and 9th scores 7.5e-9 (2 ulps) apart at the third trained step; one process with
OMP_NUM_THREADS=2 instead of 1 crossed that tie as EP2 did (EP2 then bit for bit the 2-thread
run), 3.6e-5 from the 1-thread run (2e-6 after). Not the Engram tables' Adam: at equal weights
EP2's table gradients are one process's bit for bit. Without Engram every layout and that
control stayed within 9.5e-7 (docs/deepseek-v41.md 'Why layouts part with Engram')."""
SELECTIVE = ("system.recompute_granularity=selective",
             "system.recompute_modules=[core_attn,moe,mhc]")
LAYOUTS = {  # name: (processes, overrides)
    "one": (1, ()),
    "eps2": (2, ("+model.engram_embedding_parallel_size=2",)),
    "ep2": (2, ("system.expert_model_parallel_size=2",)),
    "tp2": (2, ("system.tensor_model_parallel_size=2", "system.sequence_parallel=true")),
    "tp2_ep2_eps2": (4, ("system.tensor_model_parallel_size=2", "system.sequence_parallel=true",
                         "system.expert_model_parallel_size=2",
                         "+model.engram_embedding_parallel_size=2")),
    "pp2": (2, ("system.pipeline_model_parallel_size=2", *SELECTIVE)),
    "ep4": (4, ("system.expert_model_parallel_size=4", "train.micro_batch_size=1")),
}
ACCEPTANCE_STEPS = 3
"""The first trained steps in which TP2 x EP2, EP4 and PP2 equal one process within 1e-6 on both
megatron-core lanes (docs/deepseek-v41.md 'Expert parallelism')."""
ON_ONE = 2
"""Steps one process trains from the PP2 run's last checkpoint (with full recompute): "one"
trains them too, from where the layouts stop."""


def trainer(nproc: int, exp, *overrides: str) -> dict[int, float]:
    """The trainer on `nproc` processes; its lm loss per iteration."""
    return {i: r["lm_loss"] for i, r in trainer_metrics(nproc, exp, *COMMON, *overrides).items()}


class Runs(dict):
    """Each layout's lm loss per iteration, trained on first use: a run of some of the tests
    (the second lane's ``every_lane`` subset) trains only the layouts they read. Every run
    loads the checkpoint one process saved after one step; ``root`` is the runs' folder."""

    def __init__(self, root):
        super().__init__(root=root)
        self.started = False

    def __missing__(self, name: str) -> dict[int, float]:
        root = self["root"]
        if not self.started:
            trainer(1, root / "start", "train.train_iters=1", f"checkpoint.save={root / 'ckpt'}")
            self.started = True
        resume = (f"checkpoint.load={root / 'ckpt'}", "+model.fake_quantize=false")
        if name == "pp2_on_one":  # the PP2 checkpoint on one process, full recompute
            self["pp2"]
            losses = trainer(1, root / name, f"checkpoint.load={root / 'pp2' / 'ckpt'}",
                             "+model.fake_quantize=false", f"train.train_iters={1 + STEPS + ON_ONE}",
                             "system.recompute_granularity=full", "system.recompute_num_layers=2")
        else:
            nproc, extra = LAYOUTS[name]
            losses = trainer(nproc, root / name, *resume, *extra,
                             f"train.train_iters={1 + STEPS + (ON_ONE if name == 'one' else 0)}",
                             f"checkpoint.save={root / name / 'ckpt'}")
        print(f"DeepSeek-V4.1 layout {name}, lm loss per step:", json.dumps(losses))
        self[name] = losses
        return losses


@pytest.fixture(scope="module")
def losses(tmp_path_factory):
    return Runs(tmp_path_factory.mktemp("v41_layouts"))


def max_difference(a: dict[int, float], b: dict[int, float],
                   steps=range(2, 2 + STEPS)) -> float:
    """The largest loss difference over `steps`, the iterations `b` trained."""
    assert sorted(b) == list(steps) and set(steps) <= set(a)
    return max(abs(a[i] - b[i]) for i in steps)


def test_engram_embedding_parallel_two_trains_as_one_process(losses):
    """Data-parallel 2 with the Engram tables split over eps 2 (row-sharded checkpoint
    tensors resharded on load, rows fetched by all-to-all)."""
    assert max_difference(losses["one"], losses["eps2"]) <= 1e-5
    assert losses["one"][1 + STEPS] < losses["one"][2]


def test_v41_layouts_the_run_config_accepts():
    from test_presets import _cfg

    from engram_train.training.run_config import validate_run_config

    config = validate_run_config(
        _cfg(["model=deepseek_v41_tiny", "+model.engram_embedding_parallel_size=2"]), 2)
    assert config.engram_embedding_parallel_size == 2


def test_all_to_all_expert_dispatch_against_one_process(tmp_path):
    """The EP 2 dispatch on its own (tests/dist/v41_expert_dispatch.py): outputs bit for bit
    one process's, routing-weight and expert-weight gradients too, the tokens' gradient within
    float32 rounding (one bf16 step in bf16), also when one rank receives no pair (every choice
    on rank 0's experts) or sends none (its tokens masked)."""
    results = torchrun("v41_expert_dispatch.py", 2, tmp_path)
    assert results[1]["to_rank0 float32"]["received_pairs"] == 0
    for rank in results:
        assert len(rank) == 6
        for case, r in rank.items():
            assert r["output_equal"] and r["weight_grad"] == 0 and r["expert_grad"] == 0, case
            assert r["x_grad"] <= (2e-6 if "float32" in case else 2 ** -7), case


def test_expert_parallel_two_trains_as_one_process(losses):
    """The routed experts split over EP 2 (the exact all-to-all dispatch), their
    checkpoint tensors sharded on the expert axis: the one-process checkpoint loads as two
    halves, and the EP 2 run saves two 2-expert blocks of the 4-expert tensor."""
    from torch.distributed.checkpoint import FileSystemReader

    assert max_difference(losses["one"], losses["ep2"]) <= EXPERT_LAYOUT_TOLERANCE
    folder = losses["root"] / "ep2" / "ckpt" / f"iter_{1 + STEPS:07d}"
    saved = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    expert = saved["layers.0.ffn.experts.w1"]
    assert tuple(expert.size) == (4, 32, 64)
    assert sorted(tuple(c.offsets) for c in expert.chunks) == [(0, 0, 0), (2, 0, 0)]
    assert all(tuple(c.sizes) == (2, 32, 64) for c in expert.chunks)


def test_tensor_parallel_two_with_sequence_parallelism_trains_as_one_process(losses):
    """Heads, sinks and ``wo_a`` groups split over TP 2, each rank's sequence slice gathered
    before the attention; the replicated parameters' partial gradients summed over TP. The
    checkpoint's sinks are two 2-head halves of the 4 heads."""
    from torch.distributed.checkpoint import FileSystemReader

    assert max_difference(losses["one"], losses["tp2"]) <= EXPERT_LAYOUT_TOLERANCE
    folder = losses["root"] / "tp2" / "ckpt" / f"iter_{1 + STEPS:07d}"
    saved = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    sink = saved["layers.0.attn.attn_sink"]
    assert tuple(sink.size) == (4,)
    assert sorted(tuple(c.offsets) for c in sink.chunks) == [(0,), (2,)]


@pytest.mark.every_lane
def test_expert_parallel_four_trains_as_one_process(losses):
    """EP 4 on 4 processes (data-parallel 4, micro-batches of 1): one routed expert per rank,
    each expert's rows gathered from all 4 ranks; the checkpoint's expert tensors are four
    1-expert blocks."""
    from torch.distributed.checkpoint import FileSystemReader

    assert max_difference(losses["one"], losses["ep4"]) <= EXPERT_LAYOUT_TOLERANCE
    folder = losses["root"] / "ep4" / "ckpt" / f"iter_{1 + STEPS:07d}"
    saved = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    expert = saved["layers.0.ffn.experts.w2"]
    assert tuple(expert.size) == (4, 64, 32)
    assert sorted(tuple(c.offsets) for c in expert.chunks) == [(e, 0, 0) for e in range(4)]


@pytest.mark.every_lane
@pytest.mark.parametrize("layout", ["tp2_ep2_eps2", "ep4", "pp2"])
def test_layouts_equal_one_process_over_the_first_steps(losses, layout):
    """TP2 x EP2 (with eps 2), EP4 and PP2 against one process, Engram on: the losses of the
    first `ACCEPTANCE_STEPS` trained steps within 1e-6 (a float32 ulp of the loss is 9.5e-7)."""
    steps = range(2, 2 + ACCEPTANCE_STEPS)
    assert max(abs(losses["one"][i] - losses[layout][i]) for i in steps) <= 1e-6


@pytest.mark.every_lane
def test_tensor_expert_and_engram_embedding_parallel_combined(losses):
    """TP2 x EP2 x eps 2 on 4 processes: the EP groups cross the TP groups (megatron's expert
    layout: expert-TP = TP), each expert's partial gradients summed over TP."""
    assert max_difference(losses["one"], losses["tp2_ep2_eps2"]) <= EXPERT_LAYOUT_TOLERANCE


@pytest.mark.every_lane
def test_pipeline_parallel_two_trains_as_one_process(losses):
    """Two pipeline stages (layers 0-3 and 4-7, selective recompute of core_attn, moe and mhc):
    the streams, pre and the whole CSA2 state cross the boundary (the compressed KV's gradient
    back to layer 3's compressor). The checkpoint keys carry global layer ids: stage 1 saves
    layers 4 to 7 under their own numbers."""
    from torch.distributed.checkpoint import FileSystemReader

    assert max_difference(losses["one"], losses["pp2"]) <= 1e-5
    folder = losses["root"] / "pp2" / "ckpt" / f"iter_{1 + STEPS:07d}"
    saved = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    layers = {int(k.split(".")[1]) for k in saved if k.startswith("layers.")}
    assert layers == set(range(8))
    assert "layers.5.engram.multi_head_embedding.weight" in saved


def test_pipeline_checkpoint_loads_on_one_process_with_full_recompute(losses):
    """The PP2 run's last checkpoint (model and optimizer) on one process, with full recompute
    (chunks of 2 layers): the next steps equal those of the one-process run that never left
    one process (the second step's loss reads the recomputed gradients of the first)."""
    steps = range(2 + STEPS, 2 + STEPS + ON_ONE)
    assert max_difference(losses["one"], losses["pp2_on_one"], steps) <= 1e-5


RECOMPUTE = {  # name: system fields
    "full_uniform": dict(recompute_granularity="full", recompute_method="uniform",
                         recompute_num_layers=2),
    "full_block": dict(recompute_granularity="full", recompute_method="block",
                       recompute_num_layers=3),
    "selective": dict(recompute_granularity="selective",
                      recompute_modules=["core_attn", "moe", "mhc"]),
}


def test_recompute_gives_the_same_loss_and_gradients(one_rank):
    """The tiny preset (fake quantization on) in one process: the loss and every parameter's
    gradient under each recompute equal those without, bit for bit, and the forward keeps fewer
    bytes for the backward."""
    import torch

    from test_deepseek_v41_model import tiny_model_section

    from engram_train.engram.variant import build_hash_mapping
    from engram_train.models.builder import build_gpt_model
    from engram_train.models.deepseek_v41.v41_config import deepseek_v41_config

    def build(**system):
        config = deepseek_v41_config(tiny_model_section(), dict(params_dtype=torch.float32,
                                                                **system))
        return build_gpt_model(config, 1024, 64)

    reference = build()
    weights = reference.state_dict()
    generator = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 1000, (2, 2, 64), generator=generator)
    hash_ids = torch.as_tensor(build_hash_mapping(reference.config).hash_block(ids.numpy()))

    def run(model):
        model.load_state_dict(weights)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: saved.append(t.numel() * t.element_size()) or t, lambda t: t):
            loss = model(ids, labels=labels, engram_hash_ids=hash_ids).mean()
        loss.backward()
        return loss.item(), sum(saved), {n: p.grad for n, p in model.named_parameters()
                                         if p.grad is not None}

    loss, kept, grads = run(reference)
    for name, system in RECOMPUTE.items():
        other_loss, other_kept, other_grads = run(build(**system))
        assert other_loss == loss, name
        assert other_grads.keys() == grads.keys() and len(grads) > 150
        assert all(torch.equal(other_grads[k], grads[k]) for k in grads), name
        print(f"{name}: saved {other_kept / kept:.2f} of the bytes without recompute")
        assert other_kept < kept, name


def test_v41_pipeline_config():
    """PP2 with recompute passes the run config; the stages exchange float32 tensors whose
    shapes megatron learns per message."""
    import torch
    from test_presets import _cfg

    from engram_train.training.run_config import validate_run_config

    config = validate_run_config(_cfg(["model=deepseek_v41_tiny", *EIGHT_LAYERS,
                                       "system.pipeline_model_parallel_size=2", *SELECTIVE]), 2)
    assert config.pipeline_dtype == torch.float32 and config.variable_seq_lengths
    assert config.recompute_modules == ["core_attn", "moe", "mhc"]


@pytest.mark.parametrize("overrides, match", [
    (["system.tensor_model_parallel_size=2", "system.context_parallel_size=2",
      "train.seq_length=36"], r"train.seq_length=36 with system.context_parallel_size=2: each "
     r"rank's two chunks must hold whole compressed runs; use a multiple of .* = 8"),
    (["system.pipeline_model_parallel_size=2", "system.virtual_pipeline_model_parallel_size=2"],
     r"virtual_pipeline_model_parallel_size=2 with model_family"),
    (["system.tensor_model_parallel_size=2", "system.recompute_granularity=selective",
      "system.recompute_modules=[core_attn,mlp]"],
     r"recompute_modules \['mlp'\] with model_family=deepseek_v41"),
])
def test_v41_layouts_still_refused(overrides, match):
    from test_presets import _cfg

    from engram_train.errors import ConfigError
    from engram_train.training.run_config import validate_run_config

    with pytest.raises(ConfigError, match=match):
        validate_run_config(_cfg(["model=deepseek_v41_tiny", *EIGHT_LAYERS,
                                  "train.micro_batch_size=1", "system.sequence_parallel=true",
                                  *overrides]), 4)

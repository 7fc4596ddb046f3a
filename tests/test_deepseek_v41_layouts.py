"""DeepSeek-V4.1 (``model=deepseek_v41_tiny``, Engram on layers 1 and 3) in the layouts the
trainer runs it in, against one process: the same losses within 1e-5 over 5 steps at lr 3e-4,
every run loading one checkpoint that one process saved after one step (docs/deepseek-v41.md
'Layouts').

The comparisons run with ``model.fake_quantize=false``: the released caches' FP8/FP4 rounding
turns float-order differences of 1e-7 (a micro-batch split at one process is enough) into
whole quantization steps of a few KV elements, and the losses part by about 1e-4 within 5
steps whatever the layout; without it one process with two micro-batches and one with four
agree within 1e-6.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from launch import REPO, free_port, run_process

COMMON = ("model=deepseek_v41_tiny", "train.global_batch_size=4", "train.micro_batch_size=2",
          "train.seq_length=64", "train.log_interval=1", "train.eval_interval=null",
          "train.lr=3e-4", "train.min_lr=3e-4", "train.lr_warmup_iters=0",
          "train.lr_decay_style=constant", "train.lr_decay_iters=6")
STEPS = 5
LAYOUTS = {  # name: (processes, overrides)
    "one": (1, ()),
    "eps2": (2, ("+model.engram_embedding_parallel_size=2",)),
    "ep2": (2, ("system.expert_model_parallel_size=2",)),
    "tp2": (2, ("system.tensor_model_parallel_size=2", "system.sequence_parallel=true")),
    "tp2_ep2_eps2": (4, ("system.tensor_model_parallel_size=2", "system.sequence_parallel=true",
                         "system.expert_model_parallel_size=2",
                         "+model.engram_embedding_parallel_size=2")),
}


def trainer(nproc: int, exp, *overrides: str) -> dict[int, float]:
    """The trainer on `nproc` processes; its lm loss per iteration."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={free_port()}", "-m", "engram_train.train", *COMMON,
           f"experiment.exp_dir={exp}", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = run_process(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    records = [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    return {r["iteration"]: r["lm_loss"] for r in records}


@pytest.fixture(scope="module")
def losses(tmp_path_factory):
    root = tmp_path_factory.mktemp("v41_layouts")
    trainer(1, root / "start", "train.train_iters=1", f"checkpoint.save={root / 'ckpt'}")
    resume = (f"train.train_iters={1 + STEPS}", f"checkpoint.load={root / 'ckpt'}",
              "+model.fake_quantize=false")
    runs = {name: trainer(nproc, root / name, *resume, *extra,
                          f"checkpoint.save={root / name / 'ckpt'}")
            for name, (nproc, extra) in LAYOUTS.items()}
    print("DeepSeek-V4.1 layouts, lm loss per step:", json.dumps(runs))
    runs["root"] = root
    return runs


def max_difference(a: dict[int, float], b: dict[int, float]) -> float:
    assert sorted(a) == sorted(b) == list(range(2, 2 + STEPS))
    return max(abs(a[i] - b[i]) for i in a)


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


def test_expert_parallel_two_trains_as_one_process(losses):
    """The routed experts split over EP 2 (the exact all-gather / all-reduce dispatch), their
    checkpoint tensors sharded on the expert axis: the one-process checkpoint loads as two
    halves, and the EP 2 run saves two 2-expert blocks of the 4-expert tensor."""
    from torch.distributed.checkpoint import FileSystemReader

    assert max_difference(losses["one"], losses["ep2"]) <= 1e-5
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

    assert max_difference(losses["one"], losses["tp2"]) <= 1e-5
    folder = losses["root"] / "tp2" / "ckpt" / f"iter_{1 + STEPS:07d}"
    saved = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    sink = saved["layers.0.attn.attn_sink"]
    assert tuple(sink.size) == (4,)
    assert sorted(tuple(c.offsets) for c in sink.chunks) == [(0,), (2,)]


def test_tensor_expert_and_engram_embedding_parallel_combined(losses):
    """TP2 x EP2 x eps 2 on 4 processes: the EP groups cross the TP groups (megatron's expert
    layout: expert-TP = TP), each expert's partial gradients summed over TP."""
    assert max_difference(losses["one"], losses["tp2_ep2_eps2"]) <= 1e-5


@pytest.mark.parametrize("overrides, match", [
    (["system.pipeline_model_parallel_size=2"], r"pipeline_model_parallel_size=2 with model_f"),
    (["system.context_parallel_size=2"], r"context_parallel_size=2 with model_family"),
])
def test_v41_layouts_still_refused(overrides, match):
    from test_presets import _cfg

    from engram_train.errors import ConfigError
    from engram_train.training.run_config import validate_run_config

    with pytest.raises(ConfigError, match=match):
        validate_run_config(_cfg(["model=deepseek_v41_tiny", "train.micro_batch_size=1",
                                  "system.sequence_parallel=true", *overrides]), 4)

"""Quiet logs: the known third-party warnings are filtered once (ENGRAM_SHOW_WARNINGS=1 shows
them), CPU-only ones stay on CUDA hosts; a config error comes before the heavy imports."""

from __future__ import annotations

import os
import sys

import pytest

from launch import REPO, run_process

EMIT = """
import logging, sys, warnings
logging.basicConfig(stream=sys.stdout, format="%(message)s")
from engram_train.logs import KNOWN_WARNINGS, quiet_known_warnings
quiet_known_warnings(cuda=sys.argv[1] == "cuda")
quiet_known_warnings(cuda=False)  # once: a second call changes nothing
warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.")
warnings.warn("Please use DTensor instead and we are deprecating ShardedTensor.", FutureWarning)
logging.getLogger("megatron.core.tensor_parallel.random").warning("CPU RNG state changed within GPU RNG context")
print("done", flush=True)
"""


def _emit(device: str, show: str) -> str:
    env = dict(os.environ, ENGRAM_SHOW_WARNINGS=show)
    proc = run_process([sys.executable, "-c", EMIT, device], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout + proc.stderr


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_known_warnings_are_filtered_unless_asked(device):
    quiet = _emit(device, "0")
    assert "Apex are not installed" not in quiet and "ShardedTensor" not in quiet
    # the CPU RNG check is an artifact of the CPU layer: filtered on CPU-only hosts only
    assert ("CPU RNG state changed" in quiet) == (device == "cuda")
    shown = _emit(device, "1")
    for text in ("Apex are not installed", "ShardedTensor", "CPU RNG state changed"):
        assert text in shown, shown


def test_known_warnings_are_listed_in_the_readme():
    from engram_train.logs import KNOWN_WARNINGS

    readme = " ".join((REPO / "README.md").read_text().split())
    assert "ENGRAM_SHOW_WARNINGS=1" in readme and "KNOWN_WARNINGS" in readme
    for phrase in ("Apex / Transformer Engine", "CPU RNG state changed within GPU RNG context",
                   "ShardedTensor", "CUDA_DEVICE_MAX_CONNECTIONS", "cuda_graph_scope"):
        assert phrase in readme, phrase
    assert all(k.cpu_only == ("CUDA" in k.pattern or "RNG" in k.pattern) for k in KNOWN_WARNINGS)


CHECK = """
import sys
from hydra import compose, initialize_config_dir
from engram_train.config import register
import engram_train.train as t
from engram_train.training.run_config import ConfigError
register()  # the run config's schema (conf/train.yaml's defaults)
with initialize_config_dir(config_dir=sys.argv[1], version_base=None):
    cfg = compose(config_name="train", overrides=["train.micro_batch_size=3"])
try:
    t.check(cfg)
except ConfigError as e:
    heavy = [m for m in ("engram_train.checkpoint.save", "engram_train.checkpoint.load",
                         "megatron.core.dist_checkpointing",
                         "megatron.core.datasets") if m in sys.modules]
    print("HEAVY", heavy)
"""


def test_config_errors_come_before_the_heavy_imports():
    proc = run_process([sys.executable, "-c", CHECK, str(REPO / "conf")], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert "HEAVY []" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]

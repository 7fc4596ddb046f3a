import os
import sys
from importlib import metadata
from pathlib import Path

import pytest

# Test helpers (launch.py) live next to the tests.
sys.path.insert(0, str(Path(__file__).parent))

# megatron-core wraps a few MoE helpers in torch.compile (megatron.core.jit.jit_fuser); on the
# DeepSeek-V3 CPU path that is the router's expert-bias token count, an integer sum that is
# exact compiled or not. Compiling it costs ~2 s in every process, and the suite starts over a
# hundred processes (inherited by every torchrun launch below). TORCHDYNAMO_DISABLE=0 keeps it.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

# The tests that drive megatron-core end to end (integration and parity, embedding parallelism,
# checkpoints (with adding/removing Engram and damaged files), the trainer, the patch registry). CI runs the full suite on one megatron-core
# lane and these on the other: `make test MEGATRON=0.19 PYTEST_ARGS="-m every_lane"`.
EVERY_LANE = {
    "test_engram_integration.py",
    "test_reference_parity.py",
    "test_embedding_parallel.py",
    "test_foundation.py",
    "test_offload.py",
    "test_trainer.py",
    "test_runtime.py",
    "test_patches.py",
    "test_lane_checkpoints.py",
    "test_reliability_checkpoint.py",
    "test_mhc_layouts.py",
    "test_expert_parallel_resume.py",
}


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "every_lane: run on every megatron-core lane in CI (tests/conftest.py)"
    )


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in EVERY_LANE:
            item.add_marker(pytest.mark.every_lane)


def pytest_report_header(config):
    def version(dist):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    python = ".".join(map(str, sys.version_info[:3]))
    return (
        f"engram_train lane: Python {python}, torch {version('torch')}, "
        f"megatron-core {version('megatron-core')}"
    )

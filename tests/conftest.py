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

# Under pytest-xdist (`make test` runs one worker per core and one more, tests/launch.py shares the cores
# between the ranks that workers launch) each worker computes on its own share of the cores.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))

# The tests that drive megatron-core end to end (integration and parity, embedding parallelism,
# checkpoints (with adding/removing Engram and damaged files), the trainer, the patch registry). CI runs the full suite on one megatron-core
# lane and these on the other: `make test MEGATRON=0.19 PYTEST_ARGS="-m every_lane"`.
EVERY_LANE = {
    "test_v41_context_parallel.py",
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
    config.addinivalue_line(
        "markers", "cpu_slots(n): the test holds n CPU slots throughout (tests/launch.py), for "
        "tests that start processes themselves (Popen) or whose timing matters"
    )


@pytest.fixture(scope="module")
def one_rank():
    """torch.distributed (gloo) for this one process, for in-process tests that need a process
    group (a one-rank save, the plan building its model on the meta device)."""
    from engram_train.runtime import ParallelSizes, destroy_distributed, initialize_distributed

    saved = {k: os.environ.get(k) for k in ("WORLD_SIZE", "RANK")}
    os.environ["WORLD_SIZE"], os.environ["RANK"] = "1", "0"
    initialize_distributed(ParallelSizes())
    yield
    destroy_distributed()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(autouse=True)
def _cpu_slots_of_marked_tests(request):
    marker = request.node.get_closest_marker("cpu_slots")
    if marker is None:
        yield
        return
    from launch import cpu_slots

    with cpu_slots(marker.args[0]):
        yield


# The files that take longest (measured, docs/testing.md), longest first. pytest-xdist hands
# whole files to workers in collection order; starting the long ones first keeps one long file
# from running alone at the end. Files not listed follow in their usual order.
LONGEST_FIRST = [
    "test_docs.py",
    "test_memory_plan.py",
    "test_reliability_trainer.py",
    "test_context_parallel.py",
    "test_deepseek_v41_layouts.py",
    "test_host_tables.py",
    "test_embedding_parallel.py",
    "test_deepseek_v41_hf.py",
    "test_v41_quant_acceptance.py",
    "test_save_keeps_state.py",
    "test_sweep.py",
    "test_huggingface.py",
    "test_export.py",
    "test_bf16.py",
    "test_mhc_layouts.py",
    "test_foundation.py",
    "test_reliability_schedule.py",
    "test_prefetch.py",
    "test_gpu_check.py",
    "test_expert_parallel_resume.py",
    "test_v41_engram_variant.py",
    "test_host_update_faults.py",
    "test_engram_logits.py",
    "test_engram_integration.py",
    "test_patches.py",
]


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in EVERY_LANE:
            item.add_marker(pytest.mark.every_lane)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: order kept within


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

"""A checkpoint written on either megatron-core lane loads on this one and resumes exactly.

The fixtures (tests/data/lane_checkpoints, written by tests/dist/lane_checkpoint.py on each lane)
differ in format: megatron-core 0.19 keeps the common state inside the torch_dist files,
0.16 in common.pt (docs/megatron-versions.md). Loaded here on 2 data-parallel ranks.
The fixtures are committed, written by an earlier version of the project's save path: a change
to the checkpoint code that would break checkpoints users already have fails here.
"""

import json
from pathlib import Path

import pytest

from launch import torchrun

from engram_train.runtime import TESTED_MEGATRON_CORE

FIXTURES = Path(__file__).parent / "data" / "lane_checkpoints"


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return torchrun("lane_checkpoint.py", 2, tmp_path_factory.mktemp("lane_ckpt"))


def test_a_fixture_from_every_tested_lane_in_both_formats():
    assert sorted(p.name for p in FIXTURES.iterdir()) == [f"mcore{v}" for v in TESTED_MEGATRON_CORE]
    assert (FIXTURES / "mcore0.16.1" / "iter_0000002" / "common.pt").exists()
    assert not (FIXTURES / "mcore0.19.2" / "iter_0000002" / "common.pt").exists()


@pytest.mark.parametrize("fixture", [f"mcore{v}" for v in TESTED_MEGATRON_CORE])
def test_checkpoint_from_each_lane_resumes_exactly(loaded, fixture):
    expected = json.loads((FIXTURES / fixture / "expected.json").read_text())
    assert expected["versions"]["megatron-core"] == fixture.removeprefix("mcore")
    for rank in loaded:
        got = rank[fixture]
        assert got["iteration"] == expected["iteration"]
        assert got["extra"] == {"written_by": "lane"}
        # Saved on one rank, resumed on two: only the data-parallel reduction order differs.
        assert got["next_losses"] == pytest.approx(expected["next_losses"], rel=1e-6)

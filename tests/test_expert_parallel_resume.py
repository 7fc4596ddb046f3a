"""Resume across expert-parallel sizes (EP 1 <-> 2 <-> 4), with and without the distributed
optimizer, and the clear refusal of a checkpoint keyed by position at another chain shape: one
torchrun launch of 4 processes (tests/dist/expert_parallel_resume.py)."""

import pytest

from launch import torchrun

# Resuming at another EP changes only the order of the expert reductions.
RTOL = 1e-5


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return torchrun("expert_parallel_resume.py", 4, tmp_path_factory.mktemp("ep_resume"),
                    timeout=1800)


@pytest.mark.parametrize("kind", ["distributed", "plain"])
def test_checkpoints_resume_at_every_other_ep_with_the_same_losses(ranks, kind):
    result = ranks[0][kind]
    assert result["saved"]["1"]["roles"] == ["dense", "engram"]
    assert result["saved"]["2"]["roles"] == ["dense", "expert", "engram"]
    assert result["saved"]["4"]["roles"] == ["dense", "expert", "engram"]
    assert sorted(result["resumed"]) == sorted(["1->2", "2->1", "1->4", "4->1", "2->4", "4->2"])
    for pair, got in result["resumed"].items():
        saved_ep = pair.split("->")[0]
        want = result["saved"][saved_ep]["next_losses"]
        assert got["iteration"] == 2
        assert got["next_losses"] == pytest.approx(want, rel=RTOL), pair
    for rank in ranks[1:]:  # every rank saw the same losses
        assert rank[kind]["resumed"] == result["resumed"]


def test_a_checkpoint_keyed_by_position_loads_at_its_shape_and_is_refused_elsewhere(ranks):
    got = ranks[0]["positional"]
    assert got["prefixes"] == ["chained_0", "chained_1", "chained_2"]
    assert got["role_keyed_prefixed"] == []
    assert got["same_ep_losses"] == pytest.approx(got["next_losses"], rel=1e-6)
    refusal = got["other_ep_refusal"]
    assert refusal is not None
    assert "keys its optimizer state by position" in refusal
    assert "has 3 optimizer(s); this run's chain has 2" in refusal
    assert "expert_model_parallel_size it was saved with" in refusal

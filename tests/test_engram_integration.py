"""Engram in megatron: plain toggle, pipeline/tensor/sequence-parallel layouts, full recompute."""

import pytest

from launch import torchrun

LAYOUTS = ["pp2", "tp2", "tp2sp", "tp2pp2sp"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return torchrun("engram_integration.py", 4, tmp_path_factory.mktemp("engram_integration"))


def test_use_engram_false_is_megatrons_gpt_model_bit_for_bit(results):
    for r in results:
        assert r["plain_type"] == "GPTModel"
        assert r["plain_same_names"] and r["plain_bitwise"]


@pytest.mark.parametrize("tag", ["both_stages", "second_stage"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_matches_single_stage_loss(results, tag, layout):
    reference = results[0][f"{tag}_pp1"]
    reported = [r[f"{tag}_{layout}"] for r in results if r[f"{tag}_{layout}"] is not None]
    assert reported, "no last-stage rank reported a loss"
    for loss in reported:
        assert loss == pytest.approx(reference, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("tag", ["both_stages", "second_stage"])
def test_in_model_hashing_equals_data_path_ids(results, tag):
    # Layout tests feed the data path's [L, B, S, K] blocks; plain input_ids take the same route.
    for r in results:
        assert r[f"{tag}_pp1_in_model_hashing"] == r[f"{tag}_pp1"]


def test_engram_placement_changes_the_model(results):
    assert results[0]["both_stages_pp1"] != results[0]["second_stage_pp1"]


def test_full_recompute_gives_identical_loss_and_gradients(results):
    for r in results:
        plain, recomputed = r["recompute_loss"]
        assert plain == recomputed
        assert r["recompute_grad_names_equal"]
        assert r["recompute_grads_mismatch"] == []
        assert r["recompute_num_tables"] == 1  # one Engram layer per PP stage
        assert r["recompute_table_grads_nonzero"]


def test_virtual_pipeline_matches_pipeline(results):
    """Same weights, same micro-batches: grad norm and losses agree under PP2 and PP2 x VPP2."""
    for r in results:
        pp_norm, pp_loss, pp_next = r["vpp_pp2"]
        vpp_norm, vpp_loss, vpp_next = r["vpp_vpp2"]
        assert vpp_norm == pytest.approx(pp_norm, rel=1e-5)
        if pp_loss is not None:
            assert vpp_loss == pytest.approx(pp_loss, rel=1e-5)
            assert vpp_next == pytest.approx(pp_next, rel=1e-5)

"""Checkpoint faults and adding/removing Engram under a changed layout: one 2-process launch of
``dist/reliability_checkpoint.py`` (its docstring says what each part does)."""

from __future__ import annotations

import math

import pytest

from launch import torchrun


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return torchrun("reliability_checkpoint.py", 2, tmp_path_factory.mktemp("reliability"))


def test_ranks_agree(results):
    assert results[0] == results[1]


def test_add_engram_to_a_checkpoint_without_it(results):
    """Saved without Engram under DP2, loaded into an Engram model under TP2."""
    add = results[0]["add"]
    assert add["iteration"] == 2
    assert add["backbone_params"] > 50 and add["backbone_param_diffs"] == []
    assert add["extra_params_are_engram"] and add["engram_params"] == 18
    assert add["engram_param_diffs"] == []  # as initialised, untouched by the load
    # megatron's optimizer state of every backbone parameter (fp32 master, both moments)
    assert add["backbone_state_keys"] > 100
    assert add["backbone_state_missing"] == [] and add["backbone_state_diffs"] == []
    # Engram's dense parameters sit in megatron's optimizer: fresh state for them
    assert add["engram_state_keys"] == 3 * (add["engram_params"] - 2)  # tables: own optimizer
    assert add["engram_moments_zero"] and add["engram_masters_are_weights"]
    assert add["table_num_steps"] == 0 and add["table_moment_abs_sum"] == 0.0
    assert all(math.isfinite(x) for x in add["losses_after"])


def test_remove_engram_from_a_checkpoint(results):
    """Saved with Engram under TP2, loaded into a model without Engram under DP2."""
    rm = results[0]["remove"]
    assert rm["iteration"] == 4
    assert rm["params"] > 50 and rm["missing_params"] == [] and rm["param_diffs"] == []
    assert rm["state_keys"] > 100 and rm["state_key_mismatch"] == [] and rm["state_diffs"] == []
    assert math.isfinite(rm["loss_after"])


def test_nonfinite_step_is_skipped_and_changes_nothing(results):
    nf = results[0]["nonfinite"]
    assert nf["bad_skipped"] and nf["bad_flagged"]
    assert nf["bad_grad_norm"] == "nan" and nf["bad_loss"] == "nan"
    assert nf["param_diffs"] == [] and nf["state_diffs"] == []
    assert nf["table_num_steps"] == [1, 1]  # the table optimizer did not step either
    assert not nf["good_skipped"] and math.isfinite(nf["good_loss"]) and math.isfinite(nf["good_grad_norm"])


def test_nonfinite_parameters_are_never_saved_and_leftovers_go(results):
    r = results[0]["refuse"]
    assert r["message"].startswith("refusing to save iteration 7: parameter decoder.final_layernorm.weight (rank 1)")
    assert r["listing_after_refusal"] == ["iter_0000099.tmp"]  # nothing written, tracker absent
    assert r["listing_after_save"] == ["iter_0000007", "latest_checkpointed_iteration.txt"]
    assert r["problems"] == []


def test_overwritten_parameter_bytes_are_found(results):
    d = results[0]["damaged"]
    damaged = d["file"]
    assert d["problems"] == [f"{damaged}: contents changed since the save (SHA-256 differs)"]
    assert "is damaged; nothing was loaded" in d["checked_error"] and damaged in d["checked_error"]
    tensor = d["tensor"]
    assert f"loaded NaN or inf into parameter {tensor}" in d["unchecked_error"]


def test_stop_check_gives_every_rank_the_loss(results):
    """What the divergence guard judges is the same on every rank, pipeline stages without the
    loss included."""
    assert results[0]["stop_loss"] == dict(finite="2.5", nan="nan", nan_flag=True, finite_flag=False)

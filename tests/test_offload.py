"""Engram optimizer-state offload (``engram_offload_embedding_optimizer_states``): the same
updates as without it, states in host memory apart from the tables, checkpoints either way.

One 2-process launch of ``dist/offload_training.py`` (alltoall, eps 2)."""

import pytest

from launch import torchrun


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return torchrun("offload_training.py", 2, tmp_path_factory.mktemp("offload"))


def test_offload_trains_exactly_like_no_offload(results):
    for r in results:
        assert r["eps"] == 2
        off, on = r["off"], r["on"]
        assert r["initial_max_diff"] == 0.0
        # clip_grad is far below every grad norm: the clip factor shapes every update
        assert min(off["grad_norms"]) > 5 * r["clip"]
        assert on["grad_norms"] == off["grad_norms"]
        assert on["losses"] == off["losses"]
        assert on["losses"][-1] < on["losses"][0]
        assert r["table_max_diff"] <= 1e-7 and r["moment_max_diff"] <= 1e-7
        assert on["next_loss"] == off["next_loss"]


def test_offload_with_dense_adam_trains_exactly_like_no_offload(results):
    for r in results:
        off, on = r["off_adam"], r["on_adam"]
        assert on["losses"] == off["losses"] and on["grad_norms"] == off["grad_norms"]
        assert r["adam_table_max_diff"] <= 1e-7


def test_bf16_tables_offload_equals_no_offload(results):
    for r in results:
        carrier = r["bf16_carrier"]
        # clipping sees a zero-stride float32 view shaped like the touched rows (no memory)
        assert carrier["stride"] == [0, 0] and carrier["dtype"] == "torch.float32"
        assert 0 < carrier["shape"][0] <= 24 and carrier["shape"][1] == 8
        assert carrier["main_device"] == "cpu" and not carrier["main_is_table"]
        assert carrier["table_equals_main"]
        for table_optimizer in ("sparse_adam", "adam"):
            b = r["bf16"][table_optimizer]
            assert b["norms_on"] == b["norms_off"] and min(b["norms_on"]) > 0.05
            assert b["table_bitwise"] and b["main_bitwise"] and b["exp_avg_bitwise"]
            assert b["moved"] > 0


def test_offloaded_states_live_in_host_memory_apart_from_the_tables(results):
    for r in results:
        p = r["on"]["placement"]
        assert p["offload"] and p["num_tables"] == 2 and p["table_optimizer_params"]
        assert p["tables_in_megatron_optimizer"] == 0
        assert p["tables_in_megatron_state"] == 0 and p["masters_in_megatron_state"] == 0
        for e in p["entries"]:
            assert e["main_device"] == "cpu" and e["main_dtype"] == "torch.float32"
            assert not e["main_is_table"] and not e["main_shares_storage"]
            assert e["main_pinned"] == p["cuda"]
            assert e["state_devices"] == ["cpu", "cpu"] and not e["state_shares_storage"]
            # clipping sees the synced gradient rows on the table's device, not the host
            # master: a zero-stride carrier shaped like the touched rows, far fewer than the table
            assert e["carrier_on_table_device"] and e["carrier_stride"] == [0, 0]
            assert 0 < e["carrier_grad_rows"] < e["table_rows"]
        assert r["on"]["master_max_diff"] == 0.0


@pytest.mark.parametrize("run", ["resume_on_from_on", "resume_off_from_on", "resume_on_from_off"])
def test_checkpoint_round_trip_with_and_without_offload(results, run):
    for r in results:
        entry = r[run]
        assert entry["offload"] == run.startswith("resume_on")
        assert entry["iteration"] == 5 and entry["num_steps"] == 5
        assert entry["table_max_diff"] == 0.0
        assert entry["exp_avg_max_diff"] == 0.0 and entry["exp_avg_sq_max_diff"] == 0.0
        if entry["offload"]:
            assert entry["master_max_diff"] == 0.0
        source = r["on"] if run.endswith("from_on") else r["off"]
        assert entry["next_loss"] == source["next_loss"]

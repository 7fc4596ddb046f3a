"""Next-layer lookup prefetch: bit-identical training with it on and off across layouts
(1F1B with several micro-batches in flight, interleaved PP, full recompute, eps 4, TP2 + SP,
the allreduce method), over steps whose batches change. One 4-process launch."""

import pytest

from launch import torchrun

LAYOUTS = ["pp2_eps2_long", "vpp2_eps2", "pp2_eps2_recompute", "eps4", "tp2_eps2",
           "allreduce_tp2"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return torchrun("prefetch_training.py", 4, tmp_path_factory.mktemp("prefetch"))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_prefetch_on_and_off_train_bit_identically(results, layout):
    for r in results:
        got = r[layout]
        off, on = got["off"], got["on"]
        assert len(on["losses"]) == got["steps"]
        assert on["losses"] == off["losses"]
        assert on["grad_norms"] == off["grad_norms"]
        assert got["tables_bitwise"]
        # prefetch looks up every Engram layer exactly once per forward, as without it
        assert on["times"]["lookups"] == off["times"]["lookups"]
    assert sum(r[layout]["on"]["times"]["lookups"] for r in results) > 0


def test_changing_batches_train(results):
    losses = [r["pp2_eps2_long"]["on"]["losses"] for r in results]
    reported = [l for l in losses if l[0] is not None]
    assert reported and len(set(map(tuple, reported))) == 1  # every last-stage rank agrees
    assert len(set(reported[0])) == len(reported[0])  # a new batch each step

"""Host memory at save and resume: the NaN/inf check of a save (and of a load) and the loading
of table-optimizer state never allocate a temporary that grows with the table. Every tensor an
aten op allocates is recorded (a dispatch mode) on a small table, with a small block size; the
largest must stay within a block. Single process, no megatron, no checkpoint on disk.
(benchmarks/bench_big_table.py --checkpoint-peaks measures the peaks on a 3e9-parameter table.)"""

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engram_train.checkpoint.state import all_finite, nonfinite_parameter
from engram_train.training.rowwise_adam import RowwiseAdam
from engram_train.training.row_copy import copy_rows

ROWS, D = 4096, 16  # 64k values: 128 KiB in bf16
BLOCK = 4096  # bytes per block in the checks below (1/32 of the table as float32)


class LargestAllocation(TorchDispatchMode):
    """The bytes of the largest tensor any aten op allocated (views and in-place results,
    which alias an input, allocate nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not any(r.alias_info is not None for r in func._schema.returns):
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def table(dtype=torch.bfloat16) -> torch.nn.Parameter:
    torch.manual_seed(0)
    param = torch.nn.Parameter((torch.randn(ROWS, D) * 0.02).to(dtype))
    param.engram_layer_id, param.engram_row_start = 0, 0
    return param


def test_the_mode_sees_a_whole_table_check():
    """The measure works: torch.isfinite on the whole table allocates table-sized tensors."""
    param = table()
    with LargestAllocation() as mode:
        assert bool(torch.isfinite(param.detach()).all())
    assert mode.largest >= ROWS * D  # a bool per value, at least


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_finiteness_check_allocates_a_block_at_most(dtype):
    param = table(dtype)
    model = [torch.nn.Module()]
    model[0].weight = param
    with LargestAllocation() as mode:
        assert nonfinite_parameter(model, block_bytes=BLOCK) is None
    assert 0 < mode.largest <= BLOCK
    with torch.no_grad():
        param[ROWS - 3, 5] = float("nan")
    assert nonfinite_parameter(model, block_bytes=BLOCK) == (0, "weight")
    with torch.no_grad():
        param[ROWS - 3, 5] = float("-inf")
    assert not all_finite(param, BLOCK)
    with torch.no_grad():
        param[ROWS - 3, 5] = 0.0
    assert all_finite(param, BLOCK) and all_finite(param, 1)  # one row per block
    assert all_finite(torch.tensor(1.0)) and not all_finite(torch.tensor(float("nan")))
    assert all_finite(torch.arange(5)) and all_finite(torch.empty(0, D))


def trained(state_dtype: str):
    param = table()
    opt = RowwiseAdam([param], lr=1e-3, state_dtype=state_dtype, seed=1)
    for _ in range(2):
        rows = torch.randperm(ROWS)[:100].sort().values
        (plan,) = opt.begin_step()
        opt.update_rows(param, rows, torch.randn(100, D) * 1e-2, plan)
    return param, opt


def test_loading_the_live_state_keeps_the_live_tensors_and_allocates_nothing_large():
    """A checkpoint load reads into the tensors ``state_dict`` handed out (the live ones): the
    load keeps them, copies nothing and casts nothing (bf16 first moment, float32 row moment
    of a bf16 table)."""
    param, opt = trained("bf16")
    live = {k: opt.state[param][k] for k in ("exp_avg", "exp_avg_sq_row")}
    before = {k: v.clone() for k, v in live.items()}
    state = opt.state_dict()
    state["state"] = {i: dict(s) for i, s in state["state"].items()}
    state["state"][0]["exp_avg_sq_row"] = live["exp_avg_sq_row"].view(-1, 1)  # as checkpoints
    with LargestAllocation() as mode:
        opt.load_state_dict(state)
    assert mode.largest <= 64  # the step count and such
    for key, tensor in live.items():
        assert opt.state[param][key] is tensor and torch.equal(tensor, before[key])


@pytest.mark.parametrize("saved_dtype,loaded_dtype", [("fp32", "bf16"), ("bf16", "fp32"),
                                                      ("fp32", "fp32")])
def test_loading_other_tensors_copies_into_the_live_ones_by_blocks(saved_dtype, loaded_dtype,
                                                                   monkeypatch):
    """Moments of another dtype (or other tensors of the same dtype) go into the live state by
    blocks of rows: no table-sized cast, no second table; torch's cast of float32 moments to
    the bf16 parameter's dtype never happens."""
    param, opt = trained(saved_dtype)
    saved = copy.deepcopy(opt.state_dict())
    param2 = table()
    opt2 = RowwiseAdam([param2], lr=1e-3, state_dtype=loaded_dtype, seed=1)
    live = {k: v for k, v in opt2.init_state(param2).items() if k != "step"}
    monkeypatch.setattr("engram_train.training.row_copy.COPY_BLOCK_BYTES", BLOCK)
    with LargestAllocation() as mode:
        opt2.load_state_dict(saved)
    assert mode.largest <= BLOCK
    for key, tensor in live.items():
        assert opt2.state[param2][key] is tensor
        expected = opt.state[param][key].to(tensor.dtype)
        assert torch.equal(tensor, expected), key
    assert float(opt2.state[param2]["step"]) == 2


def test_copy_rows():
    target = torch.zeros(100, 8, dtype=torch.bfloat16)
    source = torch.randn(100, 8)
    with LargestAllocation() as mode:
        copy_rows(target, source, block_bytes=256)
    assert mode.largest <= 256 and torch.equal(target, source.bfloat16())
    copy_rows(target, target)  # its own memory: nothing to do
    with pytest.raises(ValueError, match="shape"):
        copy_rows(target, source[:10])
    scalar = torch.tensor(0.0)
    copy_rows(scalar, torch.tensor(2.0, dtype=torch.float64))
    assert float(scalar) == 2.0

"""rowwise_adam against an independent float64 reference, stochastic rounding's hash and
unbiasedness, the overlapped host update against the synchronous one, and the accounting of
bytes per table parameter. Single process, no megatron."""

import math

import pytest
import torch

from engram_train.training.rowwise_adam import RowwiseAdam
from engram_train.training.stochastic_rounding import (
    rounding_bits,
    round_rows_bf16,
    stochastic_round_bf16,
)


def reference_rowwise_adam(w, grads, lr, betas, eps, wd):
    """Plain float64 loops, one row at a time: PARTIAL_ROWWISE_ADAM's formulas as written."""
    w = [list(map(float, row)) for row in w.tolist()]
    m = [[0.0] * len(w[0]) for _ in w]
    v = [0.0] * len(w)
    for t, (rows, g) in enumerate(grads, start=1):
        for row, grow in zip(rows.tolist(), g.tolist()):
            m[row] = [betas[0] * a + (1 - betas[0]) * b for a, b in zip(m[row], grow)]
            v[row] = betas[1] * v[row] + (1 - betas[1]) * sum(b * b for b in grow) / len(grow)
            m_hat = [a / (1 - betas[0] ** t) for a in m[row]]
            v_hat = v[row] / (1 - betas[1] ** t)
            w[row] = [x * (1 - lr * wd) - lr * a / (math.sqrt(v_hat) + eps)
                      for x, a in zip(w[row], m_hat)]
    return torch.tensor(w, dtype=torch.float64), torch.tensor(m), torch.tensor(v)


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_rowwise_adam_matches_the_reference_on_touched_rows(wd):
    torch.manual_seed(0)
    w0 = torch.randn(6, 8)
    grads = [(torch.tensor([0, 2, 5]), torch.randn(3, 8)),
             (torch.tensor([2, 3]), torch.randn(2, 8) * 3),
             (torch.tensor([], dtype=torch.int64), torch.empty(0, 8)),  # a step with no rows
             (torch.tensor([0, 3, 4]), torch.randn(3, 8) * 0.1)]
    param = torch.nn.Parameter(w0.clone())
    opt = RowwiseAdam([param], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=wd)
    for rows, g in grads:
        opt.step_rows([(rows, g)])
    ref_w, ref_m, ref_v = reference_rowwise_adam(w0, grads, 1e-2, (0.9, 0.99), 1e-8, wd)
    state = opt.state[param]
    torch.testing.assert_close(param.data.double(), ref_w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state["exp_avg"].double(), ref_m.double(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(state["exp_avg_sq_row"].double(), ref_v.double(), rtol=1e-5,
                               atol=1e-9)
    assert torch.equal(param.data[1], w0[1])  # never touched: never moved
    assert state["exp_avg_sq_row"].shape == (6,) and float(state["step"]) == 4


def test_rowwise_adam_rows_in_parts_are_bit_identical():
    """The property the overlapped host update relies on: any split of a step's rows gives
    the same bits (bf16 values, bf16 moments, stochastic rounding)."""
    torch.manual_seed(1)
    w0 = (torch.randn(50, 16) * 0.02).bfloat16()
    steps = [(torch.randperm(50)[:20].sort().values, torch.randn(20, 16) * 1e-2) for _ in range(3)]

    def run(parts):
        param = torch.nn.Parameter(w0.clone())
        param.engram_layer_id, param.engram_row_start = 3, 1000
        opt = RowwiseAdam([param], lr=1e-3, state_dtype="bf16", seed=7)
        for rows, g in steps:
            (plan,) = opt.begin_step()
            for idx in torch.arange(rows.numel()).chunk(parts):
                opt.update_rows(param, rows[idx], g[idx], plan)
        return param.data, opt.state[param]["exp_avg"]

    whole, parted = run(1), run(7)
    assert torch.equal(whole[0], parted[0]) and torch.equal(whole[1], parted[1])
    assert whole[0].dtype == torch.bfloat16 and whole[1].dtype == torch.bfloat16
    assert not torch.equal(whole[0], w0)


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_state_dict_round_trip_keeps_moments_exact_on_bf16_tables(state_dtype):
    """torch's load casts floating state to the parameter's dtype: on a bf16 table without a
    master that would round the float32 moments through bf16 (a resume then drifts)."""
    import copy

    torch.manual_seed(2)
    w0 = (torch.randn(30, 16) * 0.02).bfloat16()

    def make():
        param = torch.nn.Parameter(w0.clone())
        param.engram_layer_id, param.engram_row_start = 0, 0
        return param, RowwiseAdam([param], lr=1e-3, state_dtype=state_dtype, seed=1)

    param, opt = make()
    for _ in range(2):
        rows = torch.randperm(30)[:10].sort().values
        (plan,) = opt.begin_step()
        opt.update_rows(param, rows, torch.randn(10, 16) * 1e-2, plan)
    saved = copy.deepcopy(opt.state_dict())
    param2, opt2 = make()
    opt2.load_state_dict(saved)
    for key in ("exp_avg", "exp_avg_sq_row"):
        assert opt2.state[param2][key].dtype == opt.state[param][key].dtype
        assert torch.equal(opt2.state[param2][key], opt.state[param][key]), key


def test_rounding_bits_depend_on_every_key_and_only_on_them():
    rows = torch.arange(100, 140)
    base = rounding_bits(0, 1, 5, 0, rows, 16)
    assert base.dtype == torch.int32 and int(base.min()) >= 0 and int(base.max()) < 1 << 16
    # a row's bits do not depend on which other rows are rounded with it
    assert torch.equal(rounding_bits(0, 1, 5, 0, rows[7:9], 16), base[7:9])
    for other in (rounding_bits(1, 1, 5, 0, rows, 16), rounding_bits(0, 2, 5, 0, rows, 16),
                  rounding_bits(0, 1, 6, 0, rows, 16), rounding_bits(0, 1, 5, 1, rows, 16),
                  rounding_bits(0, 1, 5, 0, rows + 1, 16)):
        assert (other != base).float().mean() > 0.99
    # close to uniform over [0, 2^16)
    many = rounding_bits(3, 0, 1, 0, torch.arange(4096), 16).double() / (1 << 16)
    assert abs(float(many.mean()) - 0.5) < 0.01 and abs(float(many.var()) - 1 / 12) < 0.005


def test_stochastic_rounding_is_unbiased_and_exact_on_bf16_values():
    exact = torch.tensor([1.0, -2.5, 0.015625, 0.0]).repeat(1, 16)
    bits = rounding_bits(0, 0, 1, 0, torch.arange(1), 64)
    assert torch.equal(stochastic_round_bf16(exact, bits).float(), exact)
    # x lies 1/4 of a bf16 step above a bf16 value: rounds up a quarter of the time
    lo = torch.tensor(1.0)
    step = 2.0 ** -7  # bf16 spacing in [1, 2)
    for x, up in ((1.0 + step / 4, 0.25), (-(1.0 + 3 * step / 4), 0.75)):
        values = torch.full((2000, 64), x)
        rounded = round_rows_bf16(values, seed=5, layer=0, step=1, stream=0,
                                  global_rows=torch.arange(2000)).double()
        frac_up = float((rounded.abs() > lo.double() + 1e-9).double().mean())
        assert abs(frac_up - up) < 0.01
        assert abs(float(rounded.mean()) - x) < 2e-4 * step * 100


def test_bf16_state_tracks_fp32_state():
    """bf16 values + bf16 moment (no master) follow the float32 trajectory closely."""
    torch.manual_seed(2)
    w0 = torch.randn(64, 16) * 0.02
    exact = torch.nn.Parameter(w0.clone())
    low = torch.nn.Parameter(w0.bfloat16())
    low.engram_layer_id, low.engram_row_start = 0, 0
    opt_exact = RowwiseAdam([exact], lr=1e-3)
    opt_low = RowwiseAdam([low], lr=1e-3, state_dtype="bf16")
    for _ in range(30):
        rows = torch.randperm(64)[:32].sort().values
        g = torch.randn(32, 16) * 1e-2 + 1e-3
        opt_exact.step_rows([(rows, g)])
        opt_low.step_rows([(rows, g)])
    error = low.data.float() - exact.data
    moved = (exact.data - w0).abs()
    # a few bf16 steps of random walk at most, and no drift in one direction
    assert error.abs().max() < 0.1 * moved.max(), (error.abs().max(), moved.max())
    assert error.mean().abs() < 0.02 * moved.mean(), (error.mean(), moved.mean())


def test_bytes_per_parameter_accounting():
    from engram_train.engram.host_table import table_bytes_per_param

    assert table_bytes_per_param(4, master=False) == 12
    assert table_bytes_per_param(2, master=True) == 14
    four = table_bytes_per_param(2, master=False, optimizer="rowwise_adam", state_dtype_bytes=2,
                                 row_width=16)
    assert four == 4.25


def test_master_weights_false_is_validated():
    from engram_train.config import EngramConfig

    base = dict(use_engram=True, engram_tokenizer_name_or_path="x")
    with pytest.raises(ValueError, match="engram_master_weights=false applies to bf16 tables"):
        EngramConfig(**base, engram_master_weights=False, engram_optimizer="rowwise_adam")
    with pytest.raises(ValueError, match="needs engram_optimizer=rowwise_adam"):
        EngramConfig(**base, engram_master_weights=False, engram_table_dtype="bf16")
    with pytest.raises(ValueError, match="engram_optimizer_state_dtype='bf16' needs"):
        EngramConfig(**base, engram_optimizer_state_dtype="bf16")
    EngramConfig(**base, engram_master_weights=False, engram_table_dtype="bf16",
                 engram_optimizer="rowwise_adam", engram_optimizer_state_dtype="bf16")


def test_resume_between_optimizer_state_layouts_is_refused():
    """A sparse_adam checkpoint (two moments per element) does not resume into rowwise_adam
    and back; sparse_adam <-> adam share a layout; older manifests count as sparse_adam's."""
    from hydra import compose, initialize_config_dir
    from engram_train.config import register

    from engram_train.engram.ngram_hash import NgramHashMapping
    from engram_train.training.run_config import build_transformer_config
    from engram_train.training.run_identity import (
        ResumeMismatchError,
        check_run_identity,
        run_identity,
    )
    from launch import REPO

    def identity(*overrides):
        register()  # the run config's schema (conf/train.yaml's defaults)
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
            config = build_transformer_config(compose(config_name="train",
                                                      overrides=list(overrides)))
        return run_identity(config, 4096, NgramHashMapping(config))

    sparse = identity()
    rowwise = identity("model.engram_optimizer=rowwise_adam")
    assert (sparse["engram_optimizer_state"], rowwise["engram_optimizer_state"]) == (
        "elementwise", "rowwise")
    with pytest.raises(ResumeMismatchError, match=r"model\.engram_optimizer: .* elementwise.*"
                       r"resume with model\.engram_optimizer=sparse_adam.*load_engram=false"):
        check_run_identity(sparse, rowwise, load_engram=True, where="ckpt")
    with pytest.raises(ResumeMismatchError, match=r"engram_optimizer=rowwise_adam"):
        check_run_identity(rowwise, sparse, load_engram=True, where="ckpt")
    older = {k: v for k, v in sparse.items() if k != "engram_optimizer_state"}
    with pytest.raises(ResumeMismatchError):
        check_run_identity(older, rowwise, load_engram=True, where="ckpt")
    check_run_identity(older, sparse, load_engram=True, where="ckpt")
    check_run_identity(sparse, identity("model.engram_optimizer=adam"), load_engram=True,
                       where="ckpt")
    check_run_identity(sparse, rowwise, load_engram=False, where="ckpt")

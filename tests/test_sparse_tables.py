"""Sparse Engram tables without a process group: lazy row-wise Adam against independent
implementations, row-sparse lookup gradients against autograd's dense ones, and a step that
allocates nothing of the table's size."""

import numpy as np
import pytest
import torch

from engram_train.engram.tables import MultiHeadEmbedding
from engram_train.engram.row_grad import arm_row_sparse_grad, coalesce_rows, gather_rows
from engram_train.parallel.row_grad_sync import sparse_is_cheaper
from engram_train.training.sparse_adam import RowSparseAdam

ROWS, DIM = 50, 6


def _row_batches(steps, seed=0, rows_per_step=12):
    """Per step: distinct sorted rows and their gradient rows (float32)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        rows = torch.randperm(ROWS, generator=g)[:rows_per_step].sort().values
        out.append((rows, torch.randn(rows_per_step, DIM, generator=g) * 1e-2))
    return out


def _numpy_lazy_adam(p0, batches, lr, betas, eps, wd):
    """Lazy Adam in float64 NumPy: touched rows only, bias correction by the global step,
    decoupled weight decay on touched rows (written from the algorithm, not the code)."""
    p = p0.astype(np.float64).copy()
    m, v = np.zeros_like(p), np.zeros_like(p)
    b1, b2 = betas
    for t, (rows, grad) in enumerate(batches, start=1):
        r, gr = rows.numpy(), grad.numpy().astype(np.float64)
        m[r] = b1 * m[r] + (1 - b1) * gr
        v[r] = b2 * v[r] + (1 - b2) * gr * gr
        m_hat, v_hat = m[r] / (1 - b1**t), v[r] / (1 - b2**t)
        p[r] = p[r] * (1 - lr * wd) - lr * m_hat / (np.sqrt(v_hat) + eps)
    return p, m, v


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_row_sparse_adam_matches_numpy_lazy_adam(wd):
    p0 = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(1))
    batches = _row_batches(20)
    param = torch.nn.Parameter(p0.clone())
    opt = RowSparseAdam([param], lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd)
    for rows, grad in batches:
        opt.step_rows([(rows, grad)])
    want_p, want_m, want_v = _numpy_lazy_adam(p0.numpy(), batches, 3e-3, (0.9, 0.95), 1e-8, wd)
    np.testing.assert_allclose(param.detach().numpy(), want_p, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(opt.state[param]["exp_avg"].numpy(), want_m, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(opt.state[param]["exp_avg_sq"].numpy(), want_v, rtol=1e-5,
                               atol=1e-12)
    assert float(opt.state[param]["step"]) == len(batches)


def test_row_sparse_adam_matches_torch_sparse_adam():
    # torch SparseAdam adds eps before the second moment's bias correction; with a negligible
    # eps both are the same lazy Adam.
    p0 = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(2))
    ours = torch.nn.Parameter(p0.clone())
    theirs = torch.nn.Parameter(p0.clone())
    opt = RowSparseAdam([ours], lr=1e-2, betas=(0.9, 0.99), eps=1e-30)
    ref = torch.optim.SparseAdam([theirs], lr=1e-2, betas=(0.9, 0.99), eps=1e-30)
    for rows, grad in _row_batches(15, seed=3):
        opt.step_rows([(rows, grad)])
        theirs.grad = torch.sparse_coo_tensor(rows.unsqueeze(0), grad, (ROWS, DIM),
                                              check_invariants=True)
        ref.step()
    torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("adam_cls, wd", [(torch.optim.Adam, 0.0), (torch.optim.AdamW, 0.1)])
def test_every_row_touched_is_torch_adam_bit_for_bit(adam_cls, wd):
    p0 = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(4))
    ours, theirs = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    opt = RowSparseAdam([ours], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd)
    ref = adam_cls([theirs], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd)
    g = torch.Generator().manual_seed(5)
    for _ in range(6):
        grad = torch.randn(ROWS, DIM, generator=g)
        opt.step_rows([(torch.arange(ROWS), grad)])
        theirs.grad = grad
        ref.step()
    assert torch.equal(ours.detach(), theirs.detach())
    assert torch.equal(opt.state[ours]["exp_avg_sq"], ref.state[theirs]["exp_avg_sq"])


def test_untouched_rows_do_not_move_and_state_loads_into_torch_adam():
    p0 = torch.randn(ROWS, DIM)
    param = torch.nn.Parameter(p0.clone())
    opt = RowSparseAdam([param], lr=1e-2, weight_decay=0.5)
    rows = torch.tensor([3, 7, 11])
    opt.step_rows([(rows, torch.ones(3, DIM))])
    opt.step_rows([(torch.tensor([7]), torch.ones(1, DIM))])
    moved = (param.detach() != p0).any(dim=1).nonzero().flatten().tolist()
    assert moved == [3, 7, 11]
    untouched = torch.ones(ROWS, dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(opt.state[param]["exp_avg"][untouched], torch.zeros(ROWS - 3, DIM))
    # Same state keys as torch Adam: a checkpoint moves between the two optimizers.
    other = torch.nn.Parameter(param.detach().clone())
    adam = torch.optim.Adam([other], lr=1e-2)
    adam.load_state_dict(opt.state_dict())
    assert torch.equal(adam.state[other]["exp_avg"], opt.state[param]["exp_avg"])
    back = RowSparseAdam([torch.nn.Parameter(p0.clone())], lr=1e-2)
    back.load_state_dict(adam.state_dict())
    assert float(back.state[back.param_groups[0]["params"][0]]["step"]) == 2


def test_row_sparse_adam_refuses_a_dense_step():
    opt = RowSparseAdam([torch.nn.Parameter(torch.zeros(2, 2))])
    with pytest.raises(RuntimeError, match="step_rows"):
        opt.step()
    with pytest.raises(ValueError, match="1 parameters"):
        opt.step_rows([])


def test_coalesce_sums_repeats_in_sorted_row_order():
    rows = torch.tensor([5, 2, 5, 9, 2, 5])
    values = torch.arange(12, dtype=torch.float32).view(6, 2)
    got_rows, got = coalesce_rows(rows, values)
    assert got_rows.tolist() == [2, 5, 9]
    assert got.tolist() == [[2 + 8, 3 + 9], [0 + 4 + 10, 1 + 5 + 11], [6, 7]]
    distinct_rows, distinct = coalesce_rows(torch.tensor([4, 1]), values[:2])
    assert distinct_rows.tolist() == [1, 4] and distinct.tolist() == [[2, 3], [0, 1]]


def test_armed_table_gets_row_pairs_equal_to_the_dense_gradient():
    emb = MultiHeadEmbedding([101, 103, 107, 109], 8, layer_id=2, seed=3)
    ids = torch.stack([torch.randint(0, n, (16, 3)) for n in emb.head_sizes], dim=-1)
    weight = torch.randn(16, 3, 32)
    (emb(ids) * weight).sum().backward()
    dense = emb.weight.grad.clone()
    emb.weight.grad = None
    accumulator = arm_row_sparse_grad(emb.weight)
    for half in (slice(0, 8), slice(8, 16)):  # two micro-batches
        (emb(ids[half]) * weight[half]).sum().backward()
    assert emb.weight.grad is None  # nothing of the table's size
    assert accumulator.pending <= ids.numel()
    rows, values = accumulator.coalesce()
    assert rows.numel() == torch.unique(emb.table_rows(ids)).numel()
    rebuilt = torch.zeros_like(dense).index_copy_(0, rows, values)
    torch.testing.assert_close(rebuilt, dense, rtol=1e-6, atol=1e-6)


def test_masked_gather_gives_zeros_and_no_gradient_for_rows_held_elsewhere():
    table = torch.nn.Parameter(torch.randn(10, 4))
    accumulator = arm_row_sparse_grad(table)
    rows = torch.tensor([1, 0, 3])
    owned = torch.tensor([True, False, True])
    out = gather_rows(table, rows, owned)
    assert torch.equal(out[1], torch.zeros(4)) and torch.equal(out[0], table.detach()[1])
    out.sum().backward()
    got_rows, _ = accumulator.coalesce()
    assert got_rows.tolist() == [1, 3]


def test_sync_route_choice_follows_bytes():
    # 1M-row shard, 2 replicas: a few thousand touched rows go sparse, a dense step does not.
    assert sparse_is_cheaper(2 * 4096, 1_000_000, 16, 2)
    assert not sparse_is_cheaper(2 * 900_000, 1_000_000, 16, 2)


def _peak_allocation(fn) -> int:
    """Largest single CPU allocation (bytes) made while ``fn`` runs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    sizes = [e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0]
    return max(sizes, default=0)


@pytest.mark.parametrize("sparse", [True, False])
def test_a_sparse_step_allocates_nothing_of_the_table_size(sparse):
    """Lookup, backward and optimizer step on a 64 MiB shard: with sparse_adam no allocation
    comes near the shard's size; dense Adam's gradient does (the detector works)."""
    emb = MultiHeadEmbedding([1_048_573, 1_048_571], 8, layer_id=1)  # 2M rows x 8 x 4 B
    shard_bytes = emb.weight.numel() * 4
    accumulator = arm_row_sparse_grad(emb.weight)
    opt = RowSparseAdam([emb.weight], lr=1e-3)
    dense = torch.optim.Adam([emb.weight], lr=1e-3)
    opt.init_state(emb.weight)
    ids = torch.randint(0, 1_000_000, (256, 4, 2))

    def step():
        (emb(ids) ** 2).sum().backward()
        rows, values = accumulator.coalesce()
        if sparse:
            opt.step_rows([(rows, values)])
        else:
            emb.weight.grad = torch.zeros_like(emb.weight).index_copy_(0, rows, values)
            dense.step()
            emb.weight.grad = None

    peak = _peak_allocation(step)
    if sparse:
        assert peak < shard_bytes / 100, peak
    else:
        assert peak >= shard_bytes


def test_every_table_optimizer_the_config_accepts_has_one_implementation():
    """One registry: the names config validation accepts are exactly the implemented ones."""
    from engram_train.config import TABLE_OPTIMIZERS
    from engram_train.training.engram_optimizer import TABLE_OPTIMIZER_BUILDERS

    assert set(TABLE_OPTIMIZER_BUILDERS) == set(TABLE_OPTIMIZERS)

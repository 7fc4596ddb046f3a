"""The overlapped host table update (``training/host_update.py``) under faults and with several
tables, and the table optimizers' agreement: a failed update stops everything that would read
its tables (lookups, the optimizer's next step, a save, the trainer's last step) and nothing is
written; a save's NaN check sees the finished update; the critical-path time counts a wait
once; a lookup of one table waits only for prioritized rows, not for every row of the tables
before it, with results bit-identical to the synchronous update; host tables never take the
dense gradient-sync route; dense ``adam`` and ``sparse_adam`` decay weights the same way.

In-process (one rank, no process group) except the last test: one 2-process trainer run whose
rank 1 fails while a checkpoint is due."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch
from megatron.core import parallel_state
from megatron.core.optimizer import OptimizerConfig

from engram_train.checkpoint.checkpoint_errors import NonFiniteStateError
from engram_train.checkpoint.save import save_checkpoint
from engram_train.engram.host_table import (
    HOST_TABLE_TIMES,
    PENDING_ATTR,
    make_host_resident,
    read_host_rows,
)
from engram_train.parallel import row_grad_sync
from engram_train.training import host_update
from engram_train.training.engram_optimizer import EngramTableOptimizer, engram_table_param_group
from engram_train.training.host_update import HostUpdateError, OverlappedHostUpdate
from engram_train.training.rowwise_adam import RowwiseAdam
from engram_train.training.sparse_adam import RowSparseAdam

ROWS, DIM = 40, 8


def tables(n=1, host=True, seed=0, rows=ROWS):
    g = torch.Generator().manual_seed(seed)
    out = [torch.nn.Parameter(torch.randn(rows, DIM, generator=g)) for _ in range(n)]
    return [make_host_resident(p) for p in out] if host else out


def table_optimizer(params, name="sparse_adam", overlap=True, decoupled=True, wd=0.1, **kw):
    config = OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=wd, bf16=False,
                             adam_beta1=0.9, adam_beta2=0.95, decoupled_weight_decay=decoupled)
    group = engram_table_param_group(config, SimpleNamespace(engram_lr_multiplier=1.0,
                                                             engram_weight_decay=wd))
    return EngramTableOptimizer(config, params, group, kw.pop("sync_group", None), None,
                                table_optimizer=name, overlap_host_update=overlap, **kw)


def step(opt, grads):
    """One table-optimizer step from given (rows, gradient rows) per table."""
    opt._row_grads = grads
    opt.step_with_ready_grads()
    opt.zero_grad()


def grads_of(step_index, n, rows=ROWS, touched=12):
    g = torch.Generator().manual_seed(100 + step_index)
    out = []
    for _ in range(n):
        r = torch.randperm(rows, generator=g)[:touched].sort().values
        out.append((r, torch.randn(touched, DIM, generator=g)))
    return out


def fail_at(monkeypatch, cls, when):
    """``cls.update_rows`` raises when ``when(plan, rows)``."""
    original = cls.update_rows

    def update_rows(self, param, rows, values, plan):
        if when(plan, rows):
            raise RuntimeError("injected host update fault")
        original(self, param, rows, values, plan)

    monkeypatch.setattr(cls, "update_rows", update_rows)


# -- (a) errors of the update thread -------------------------------------------------------------


def test_a_failed_update_is_raised_by_every_lookup_finish_and_launch(monkeypatch):
    """Before: ``PendingRows.wait_for`` returned as soon as the update was marked finished
    (failed included), so the next step read half-updated rows."""
    monkeypatch.setattr(host_update, "CHUNK_ROWS", 2)
    (table,) = tables()
    before = table.detach().clone()
    update = OverlappedHostUpdate()

    def work(i, rows):
        if rows.min() >= 4:  # the first two chunks are done, then it fails
            raise RuntimeError("injected host update fault")
        table.data[rows] += 1

    update.launch([table], [torch.arange(10)], work)
    pending = getattr(table, PENDING_ATTR)
    update._thread.join()
    assert pending.progress.finished and pending.progress.error is not None
    assert torch.equal(table.detach()[:4], before[:4] + 1)  # half updated
    assert torch.equal(table.detach()[4:], before[4:])
    for rows in (torch.tensor([7]), torch.tensor([1]), torch.tensor([30])):  # hit, done, untouched
        with pytest.raises(HostUpdateError, match="injected host update fault"):
            pending.wait_for(rows)
    with pytest.raises(HostUpdateError, match=r"update failed \(RuntimeError: injected"):
        read_host_rows(table, torch.tensor([5, 6]))
    for _ in range(2):  # and it stays raised: nothing reads these tables as a whole again
        with pytest.raises(HostUpdateError):
            update.finish()
    with pytest.raises(HostUpdateError):
        update.launch([table], [torch.arange(3)], work)
    with pytest.raises(HostUpdateError):
        read_host_rows(table, torch.tensor([30]))


def test_the_optimizer_stops_before_its_next_collective(monkeypatch):
    """The next step's ``prepare_grads`` (before any gradient collective, before megatron's
    optimizers step) raises an update that has already failed; so does finishing it."""
    monkeypatch.setattr(parallel_state, "get_data_parallel_world_size", lambda **kw: 1)
    fail_at(monkeypatch, RowSparseAdam, lambda plan, rows: plan["step"] == 1)
    params = tables(2)
    opt = table_optimizer(params)
    step(opt, grads_of(0, 2))
    opt.host_update._thread.join()
    with pytest.raises(HostUpdateError, match="injected"):
        opt.prepare_grads()
    with pytest.raises(HostUpdateError):
        host_update.finish_overlapped_updates(opt)


def _fake_job(opt, train_iters):
    t = SimpleNamespace(train_iters=train_iters, exit_duration_in_mins=None, divergence_guard=False,
                        divergence_spike_factor=10.0, divergence_window=5, divergence_collapse_steps=5,
                        log_interval=1, eval_interval=None, global_batch_size=1, seq_length=1,
                        micro_batch_size=1, nonfinite_skip_budget=0, eval_iters=0)
    cfg = SimpleNamespace(train=t, checkpoint=SimpleNamespace(save=None, save_interval=None))
    metrics = SimpleNamespace(close=lambda: None, log=lambda *a, **k: {})
    return SimpleNamespace(cfg=cfg, optimizer=opt, plan=SimpleNamespace(vocab_size=16),
                           batches=lambda ds, consumed: iter(dict, None), train_ds=None,
                           valid_ds=None, hash_fn=None, num_micro=1, model=[], scheduler=None,
                           metrics=metrics, signals=None, rank=0, is_logger=False)


def test_the_trainer_finishes_the_last_steps_update(monkeypatch, capsys):
    """The trainer's loop (its step replaced by a table-optimizer step): an update that fails
    in the last step of a run without checkpoints stops it with exit status 1 and one line.
    Before: the loop returned and the error was lost."""
    from engram_train.training import loop
    from engram_train.training.resume import Progress
    from engram_train.training.step import StepResult

    monkeypatch.setattr(host_update, "CHUNK_ROWS", 4)
    fail_at(monkeypatch, RowSparseAdam,
            lambda plan, rows: plan["step"] == 3 and (time.sleep(0.3) or True))
    params = tables(2)
    opt = table_optimizer(params)
    steps = iter(range(3))

    def fake_train_step(model, optimizer, microbatches, *args, **kwargs):
        step(opt, grads_of(next(steps), 2))
        return StepResult(lm_loss=1.0, num_tokens=1, grad_norm=1.0, skipped=False)

    monkeypatch.setattr(loop, "train_step", fake_train_step)
    with pytest.raises(SystemExit) as stopped:
        loop.train(_fake_job(opt, 3), Progress())
    assert stopped.value.code == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("engram-train: the Engram host table update "
                                                   "failed (RuntimeError: injected host update fault)")


def test_a_failed_update_stops_a_save_before_anything_is_written(monkeypatch, tmp_path):
    fail_at(monkeypatch, RowSparseAdam,
            lambda plan, rows: plan["step"] == 1 and (time.sleep(0.3) or True))
    params = tables(1)
    opt = table_optimizer(params)
    step(opt, grads_of(0, 1))
    model = torch.nn.ParameterList(params)
    with pytest.raises(HostUpdateError, match="injected"):
        save_checkpoint(tmp_path, 1, [model], None, check_space=False)
    assert list(tmp_path.iterdir()) == []


# -- (b) the save's NaN check --------------------------------------------------------------------


def test_the_save_nan_check_sees_the_finished_update(monkeypatch, tmp_path):
    """A step whose (slow) host update writes NaN into a row: the save refuses it with nothing
    written. Before: the check scanned the tables while the update was in flight, passed, and
    the save went on (here: to its barrier, without a process group)."""
    original = RowSparseAdam.update_rows

    def slow(self, param, rows, values, plan):
        time.sleep(0.5)
        original(self, param, rows, values, plan)

    monkeypatch.setattr(RowSparseAdam, "update_rows", slow)
    params = tables(1)
    opt = table_optimizer(params)
    rows, values = grads_of(0, 1)[0]
    values[3, 0] = float("nan")
    step(opt, [(rows, values)])
    model = torch.nn.ParameterList(params)
    with pytest.raises(NonFiniteStateError, match="holds NaN"):
        save_checkpoint(tmp_path, 1, [model], None, check_space=False)
    assert list(tmp_path.iterdir()) == []


# -- (c) the critical-path time ------------------------------------------------------------------


def test_the_critical_path_counts_a_wait_once(monkeypatch):
    """A step that waits ~0.4 s for the previous update: ``wait_s`` is at most the time the
    step took. Before: the wait was added inside ``finish()`` and again around it (~2x)."""
    monkeypatch.setattr(parallel_state, "get_data_parallel_world_size", lambda **kw: 1)
    original = RowSparseAdam.update_rows

    def slow(self, param, rows, values, plan):
        time.sleep(0.4)
        original(self, param, rows, values, plan)

    monkeypatch.setattr(RowSparseAdam, "update_rows", slow)
    opt = table_optimizer(tables(1))
    step(opt, grads_of(0, 1))
    HOST_TABLE_TIMES.reset()
    opt._row_grads = grads_of(1, 1)
    start = time.perf_counter()
    opt.step_with_ready_grads()
    elapsed = time.perf_counter() - start
    critical = HOST_TABLE_TIMES.wait_s
    opt.finish_update()
    HOST_TABLE_TIMES.reset()
    assert elapsed > 0.3  # it did wait for the previous update
    assert 0.3 < critical <= elapsed + 0.01


# -- (d) several tables --------------------------------------------------------------------------


def test_a_lookup_of_table_1_waits_only_for_prioritized_rows(monkeypatch):
    """Two tables, the next step's rows prioritized in both; table 0's other rows are held up.
    A lookup of table 1's prioritized rows returns while they are, having waited for the
    prioritized rows of both tables only. Before: table 1's rows came after every row of
    table 0, so the lookup waited for table 0's held-up rows."""
    monkeypatch.setattr(host_update, "CHUNK_ROWS", 2)
    t0, t1 = tables(2)
    hot = [torch.tensor([1, 2]), torch.tensor([3, 4])]
    gate, done = threading.Event(), []

    def work(i, rows):
        if i == 0 and not bool(torch.isin(rows, hot[0]).all()):
            gate.wait(20)  # table 0's other rows: held up
        done.append((i, rows.tolist()))

    update = OverlappedHostUpdate()
    update.prioritize(hot)
    update.launch([t0, t1], [torch.arange(10), torch.arange(10)], work)
    waited = []
    lookup = threading.Thread(target=lambda: (getattr(t1, PENDING_ATTR).wait_for(hot[1]),
                                              waited.append(list(done))))
    lookup.start()
    lookup.join(5)
    returned = not lookup.is_alive()
    gate.set()
    lookup.join()
    update.finish()
    assert returned, f"the lookup of table 1 waited for table 0's other rows: {waited}"
    assert waited[0] == [(0, [1, 2]), (1, [3, 4])]
    assert sorted(r for i, rows in done if i == 1 for r in rows) == list(range(10))


@pytest.mark.parametrize("name", ["sparse_adam", "rowwise_adam"])
def test_overlapped_equals_synchronous_with_several_tables(monkeypatch, name):
    """Three host tables, 4 steps with the next step's rows prioritized and small chunks:
    tables and moments equal the synchronous update's bit for bit."""
    monkeypatch.setattr(host_update, "CHUNK_ROWS", 3)
    results = {}
    for overlap in (True, False):
        params = tables(3, seed=1)
        opt = table_optimizer(params, name, overlap=overlap)
        for k in range(4):
            nxt = grads_of(k + 1, 3)
            opt.prioritize_rows([rows[::2] for rows, _ in nxt])
            step(opt, grads_of(k, 3))
            if overlap:  # the next step's lookups, as a step would make them
                for p, (rows, _) in zip(params, nxt):
                    read_host_rows(p, rows)
        opt.finish_update()
        results[overlap] = ([p.detach().clone() for p in params],
                            [{k: v.clone() for k, v in opt.optimizer.state[m].items()}
                             for m in opt.main_params])
    assert all(torch.equal(a, b) for a, b in zip(results[True][0], results[False][0]))
    for a, b in zip(results[True][1], results[False][1]):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- (e) the gradient sync of host tables --------------------------------------------------------


class _TwoReplicas:
    """A group of two replicas holding the same gradient (collectives faked in-process)."""

    def size(self):
        return 2


def _fake_collectives(monkeypatch):
    def all_gather_into_tensor(out, inp, group=None):
        out.view(2, *inp.shape).copy_(inp.expand(2, *inp.shape))

    def all_reduce(t, op=None, group=None):
        if op is None or op == torch.distributed.ReduceOp.SUM:
            t.mul_(2)

    monkeypatch.setattr(row_grad_sync.dist, "all_gather_into_tensor", all_gather_into_tensor)
    monkeypatch.setattr(row_grad_sync.dist, "all_reduce", all_reduce)
    monkeypatch.setattr(parallel_state, "get_data_parallel_world_size", lambda **kw: 1)


@pytest.mark.parametrize("host", [True, False])
def test_host_tables_never_take_the_dense_sync_route(monkeypatch, host):
    """Every row touched on both replicas, where the dense all-reduce moves fewer bytes: a
    device table takes it (the detector works); a host table stays sparse (no [rows, D]
    buffer on the compute device). Before: both took the dense route."""
    _fake_collectives(monkeypatch)
    params = tables(1, host=host)
    opt = table_optimizer(params, overlap=False, sync_group=_TwoReplicas())
    values = torch.randn(ROWS, DIM)
    opt.accumulators[0].add(torch.arange(ROWS), values.clone())
    opt.prepare_grads()
    assert opt.last_sync.routes == (["sparse"] if host else ["dense"])
    rows, summed = opt.row_grads()[0]
    assert torch.equal(rows, torch.arange(ROWS)) and torch.equal(summed, 2 * values)
    opt.zero_grad()


# -- (f) weight decay ----------------------------------------------------------------------------


@pytest.mark.parametrize("decoupled", [True, False])
def test_adam_and_sparse_adam_decay_weights_the_same(decoupled):
    """First step, every row touched, the same gradient, weight decay 0.1: ``adam`` and
    ``sparse_adam`` give the same table, bit for bit, whatever megatron's
    ``decoupled_weight_decay``. Before: ``adam`` applied L2 decay when it was false."""
    out = {}
    for name in ("adam", "sparse_adam"):
        params = tables(1, host=False, seed=4)
        opt = table_optimizer(params, name, overlap=False, decoupled=decoupled)
        step(opt, [(torch.arange(ROWS), torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(9)))])
        out[name] = params[0].detach().clone()
    assert torch.equal(out["adam"], out["sparse_adam"])


# -- (a) several ranks ---------------------------------------------------------------------------


def test_a_rank_whose_update_fails_during_a_save_stops_the_job(tmp_path):
    """Trainer, 2 processes, host tables; rank 1's update of step 2 fails just before the
    checkpoint of iteration 2. Rank 1 says so in one line and exits before the save's first
    collective; torchrun stops rank 0 (waiting in it) instead of leaving it hanging; no
    checkpoint directory is written."""
    from launch import torchrun

    start = time.perf_counter()
    with pytest.raises(AssertionError) as failed:
        torchrun("host_update_faults.py", 2, tmp_path, timeout=900, forked=False)
    elapsed = time.perf_counter() - start
    log = str(failed.value)
    lines = [line for line in log.splitlines() if "host table update failed" in line]
    assert len(lines) == 1, log[-6000:]
    assert lines[0].startswith("engram-train: the Engram host table update failed on rank 1 "
                               "(RuntimeError: injected host update fault)"), log[-6000:]
    assert "HostUpdateError" not in log, log[-6000:]  # a message, not our traceback
    ckpt = tmp_path / "ckpt"
    assert not ckpt.exists() or not [p for p in ckpt.iterdir() if p.name.startswith("iter_")]
    assert elapsed < 600

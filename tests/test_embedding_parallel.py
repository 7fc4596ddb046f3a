"""Engram embedding parallelism (alltoall / allreduce) on gloo: equivalence with one rank,
no TP-fold gradient over-count, training equivalence across layouts, checkpoint resharding."""

import pytest

from launch import torchrun

from engram_train.parallel.lookup import row_range
from engram_train.runtime import ParallelSizes

ATOL = 1e-6
TP2_GRAD_ATOL = 5e-5  # TP2 vs TP1 model-level gradients: megatron's TP reduction order
MODULE_LAYOUTS = [
    "alltoall_eps1_tp1", "alltoall_eps2_tp1", "alltoall_eps4_tp1",
    "alltoall_eps1_tp2", "alltoall_eps2_tp2", "alltoall_eps4_tp2",
    "allreduce_tp1", "allreduce_tp2", "allreduce_tp4",
]
TP1_RUNS = ["alltoall_eps1", "alltoall_eps2", "alltoall_eps4", "alltoall_eps2_pp2",
            "alltoall_eps2_pp2_recompute", "allreduce_tp1"]
TP2_RUNS = ["alltoall_eps2_tp2", "alltoall_eps4_tp2", "allreduce_tp2"]
DENSE_ADAM_RUNS = ["alltoall_eps2_tp2_adam", "allreduce_tp1_adam"]


@pytest.fixture(scope="module")
def module4(tmp_path_factory):
    return torchrun("embedding_parallel_module.py", 4, tmp_path_factory.mktemp("emb_module4"))


@pytest.fixture(scope="module")
def module_small(tmp_path_factory):
    """The same checks at 1 and 2 processes (the layouts that fit)."""
    return {
        n: torchrun("embedding_parallel_module.py", n, tmp_path_factory.mktemp(f"emb_module{n}"))
        for n in (1, 2)
    }


@pytest.fixture(scope="module")
def training(tmp_path_factory):
    return torchrun("embedding_parallel_training.py", 4, tmp_path_factory.mktemp("emb_training"))


# -- no process group needed --------------------------------------------------------------


def test_row_ranges_tile_the_table_and_balance():
    for rows in (1, 7, 9098, 10_000):
        for size in (1, 2, 3, 4):
            ranges = [row_range(rows, r, size) for r in range(size)]
            assert ranges[0][0] == 0 and ranges[-1][1] == rows
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            lengths = [end - start for start, end in ranges]
            assert max(lengths) - min(lengths) <= 1


@pytest.mark.parametrize(
    "sizes, world, match",
    [
        (ParallelSizes(engram_embedding=3), 4,
         r"engram_embedding_parallel_size=3 must divide .* 4"),
        (ParallelSizes(pipeline=2, engram_embedding=4), 4,
         r"engram_embedding_parallel_size=4 must divide the number of ranks of a pipeline "
         r"stage, 2"),
        (ParallelSizes(tensor=2, pipeline=2, engram_embedding=8), 8,
         r"= tensor \(2\) x context \(1\) x data \(2\)"),
        (ParallelSizes(engram_embedding=0), 4, r"engram_embedding_parallel_size must be >= 1"),
    ],
)
def test_eps_that_does_not_fit_a_stage_is_refused(sizes, world, match):
    with pytest.raises(ValueError, match=match):
        sizes.validate(world)


def test_eps_dividing_a_stage_is_accepted():
    ParallelSizes(tensor=2, engram_embedding=4).validate(4)  # eps independent of TP
    ParallelSizes(tensor=2, pipeline=2, engram_embedding=2).validate(8)
    ParallelSizes(pipeline=2, engram_embedding=2).validate(4)


# -- module level: one rank vs sharded ------------------------------------------------------


@pytest.mark.parametrize("layout", MODULE_LAYOUTS)
def test_sharded_engram_equals_single_rank(module4, layout):
    for r in module4:
        got = r[layout]
        assert got["init_max_diff"] == 0.0  # partition-invariant init, through the method
        assert got["output_max_diff"] <= ATOL
        assert got["grad_max_diff"] <= ATOL
        assert got["optimizer_grad_norm"] == pytest.approx(got["reference_grad_norm"], rel=1e-6)


def test_same_checks_at_one_and_two_processes(module_small):
    expected = {1: {"alltoall_eps1_tp1", "allreduce_tp1"},
                2: {"alltoall_eps1_tp1", "alltoall_eps2_tp1", "alltoall_eps1_tp2",
                    "alltoall_eps2_tp2", "allreduce_tp1", "allreduce_tp2"}}
    for n, results in module_small.items():
        for r in results:
            assert set(r) - {"bf16"} == expected[n]
            for layout in expected[n]:
                assert r[layout]["init_max_diff"] == 0.0
                assert r[layout]["output_max_diff"] <= ATOL
                assert r[layout]["grad_max_diff"] <= ATOL


def test_shards_cover_the_table(module4):
    for layout, size in [("alltoall_eps4_tp2", 4), ("alltoall_eps2_tp1", 2), ("allreduce_tp4", 4)]:
        ranges = sorted({tuple(r[layout]["rows"]) for r in module4})
        assert len(ranges) == size
        assert ranges[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        num_rows = ranges[-1][1]
    assert num_rows % 4 != 0  # uneven shards: the irregular ShardedTensor path is exercised


def test_table_gradients_are_not_multiplied_by_tp(module4, training):
    # Module level: the reassembled gradient equals the single-rank one, norm ratio 1 (not TP).
    for r in module4:
        for layout in ("alltoall_eps1_tp2", "alltoall_eps2_tp2", "alltoall_eps4_tp2",
                       "allreduce_tp2", "allreduce_tp4"):
            assert r[layout]["grad_norm_ratio"] == pytest.approx(1.0, abs=1e-9)
    # Model level: TP2 table gradients equal TP1's (same weights, same global batch) up to the
    # backbone's TP reduction order (the MLA latent RMSNorms make that noise ~1e-5); a TP-fold
    # over-count would give a norm ratio of 2.
    for r in training:
        reference = r["alltoall_eps1"]["table_grad_norm"]
        for run in TP2_RUNS:
            assert r[run]["table_grad_max_diff"] <= TP2_GRAD_ATOL
            assert r[run]["table_grad_norm"] / reference == pytest.approx(1.0, abs=1e-4)


def test_engram_groups(module4):
    # TP2 x PP2, eps 2: stage 0 = ranks 0, 1; stage 1 = ranks 2, 3.
    for rank, r in enumerate(module4):
        g = r["groups_tp2pp2_eps2"]
        stage = [0, 1] if rank < 2 else [2, 3]
        assert g["pp_rank"] == rank // 2
        assert g["embedding"] == stage and g["embedding_size"] == 2
        assert g["embedding_rank"] == rank % 2
        assert g["data"] == [rank]
        assert g["model"] == [0, 1, 2, 3]
        g = r["groups_dp4_eps4"]
        assert g["embedding"] == [0, 1, 2, 3] and g["data"] == [rank] and g["model"] == [0, 1, 2, 3]
        assert "engram_embedding_parallel_size=2" in r["eps_mismatch_error"]
        assert "ParallelSizes(engram_embedding=2)" in r["eps_mismatch_error"]


def test_bf16_tables_step_float32_main_copies(module4):
    for r in module4:
        for table_optimizer in ("adam", "sparse_adam"):
            b = r["bf16"][table_optimizer]
            assert b["grad_is_none"]  # no dense gradient: rows went to the accumulator
            assert b["row_grad_dtypes"] == ["torch.float32"]
            assert b["main_dtype"] == "torch.float32" and b["success"]
            assert b["moved"] == pytest.approx(5 * 1e-2, rel=1e-3)  # first Adam step: lr x 5
            assert b["param_equals_main"]


# -- model level: training and checkpoints ------------------------------------------------------


def _losses(results, run):
    reported = [r[run]["losses"] for r in results if r[run]["losses"][0] is not None]
    assert reported, f"no last-stage rank reported losses for {run}"
    return reported


def test_training_losses_match_across_eps_and_methods(training):
    reference = _losses(training, "alltoall_eps1")[0]
    assert reference[-1] < reference[0]
    for run in TP1_RUNS:
        for losses in _losses(training, run):
            assert losses == pytest.approx(reference, abs=1e-4, rel=0)
    # TP2 changes the backbone's reduction order (megatron's TP/SP collectives), which Adam
    # amplifies a little over 5 steps: Engram methods agree exactly among TP2 runs...
    tp2 = _losses(training, "allreduce_tp2")[0]
    for run in TP2_RUNS:
        for losses in _losses(training, run):
            assert losses == pytest.approx(tp2, abs=1e-5, rel=0)
    # ...and with TP1 to float noise (Adam's normalisation amplifies noise of tiny gradient
    # entries; lazy Adam's eps is not bias-corrected, which makes that a little larger).
    assert tp2 == pytest.approx(reference, rel=1e-3)


def test_combined_grad_norm_matches_across_layouts(training):
    for r in training:
        reference = r["alltoall_eps1"]["grad_norms"]
        for run in TP1_RUNS:
            assert r[run]["grad_norms"] == pytest.approx(reference, rel=1e-4)
        # First step: same weights, only reduction order differs.
        for run in TP2_RUNS:
            assert r[run]["grad_norms"][0] == pytest.approx(reference[0], rel=5e-5)


def test_tables_live_outside_megatron_ddp_and_optimizer(training):
    for r in training:
        s = r["alltoall_eps2_pp2"]["structure"]
        assert s["num_tables"] == 1  # one Engram layer per pipeline stage
        assert s["tables_require_grad"]
        assert s["tables_in_ddp"] == 0 and s["tables_in_megatron_optimizer"] == 0
        assert s["table_optimizer_is_last"] and s["table_optimizer_params"] == 1
        table_lrs = [(lr, max_lr) for is_table, lr, max_lr in s["lrs"] if is_table]
        other_lrs = [lr for is_table, lr, _ in s["lrs"] if not is_table]
        assert table_lrs == [(pytest.approx(5 * 3e-3), pytest.approx(5 * 3e-3))]
        assert other_lrs and all(lr == pytest.approx(3e-3) for lr in other_lrs)


@pytest.mark.parametrize("resume", ["resume_eps4", "resume_eps1", "resume_eps2_adam"])
def test_checkpoint_saved_under_eps2_loads_under_other_eps(training, resume):
    for r in training:
        got = r[resume]
        assert got["iteration"] == 5 and got["num_steps"] == 5
        assert got["table_max_diff"] == 0.0
        assert got["exp_avg_max_diff"] == 0.0 and got["exp_avg_sq_max_diff"] == 0.0
        if got["next_loss"] is not None:
            assert got["next_loss"] == pytest.approx(r["alltoall_eps2"]["next_loss"], abs=1e-5)


def test_dense_adam_layouts_train_like_one_rank(training):
    # The same rows are touched every step here (a repeated batch), so dense Adam and lazy
    # Adam differ only by where eps enters the bias correction: float-noise level.
    reference = _losses(training, "alltoall_eps1")[0]
    for run in DENSE_ADAM_RUNS:
        for losses in _losses(training, run):
            assert losses == pytest.approx(reference, rel=1e-3)
    for r in training:
        for run in DENSE_ADAM_RUNS:
            assert r[run]["table_grad_max_diff"] <= TP2_GRAD_ATOL
            assert r[run]["grad_norms"][0] == pytest.approx(
                r["alltoall_eps1"]["grad_norms"][0], rel=5e-5)


def test_sparse_and_dense_adam_agree_on_two_steps_then_part(training):
    # A new batch every step: rows touched earlier keep moving under dense Adam (momentum),
    # not under sparse_adam. Step 1's loss uses the initial weights, step 2's the weights after
    # one update, which both optimizers compute alike from zero moments.
    for r in training:
        dense = r["varying_adam_auto"]["losses"]
        sparse = r["varying_sparse_adam_auto"]["losses"]
        assert dense[0] == sparse[0]
        assert dense[1] == sparse[1]  # a touched row's first update is Adam's, bit for bit
        assert max(abs(a - b) for a, b in zip(dense[3:], sparse[3:])) > 1e-4


def test_table_replicas_stay_bitwise_equal_over_many_steps(training):
    for r in training:
        for run in ("varying_adam_auto", "varying_sparse_adam_auto",
                    "varying_sparse_adam_dense", "varying_sparse_adam_sparse"):
            assert r[run]["replicas"] == 2
            assert r[run]["replica_max_diff"] == 0.0, run
        assert r["varying_sparse_adam_dense"]["routes"] == ["dense"]
        assert r["varying_sparse_adam_sparse"]["routes"] == ["sparse"]
        # Both gradient-sync routes sum the same rows: same training up to summation order.
        auto = r["varying_sparse_adam_auto"]["losses"]
        for run in ("varying_sparse_adam_dense", "varying_sparse_adam_sparse"):
            assert r[run]["losses"] == pytest.approx(auto, rel=1e-5)

"""A checkpoint save never changes the state that training continues with (a save once popped
``rowwise_adam``'s row moment out of the live optimizer state: the next step failed with
``KeyError: 'exp_avg_sq_row'``).

In-process, 2 ranks (``dist/save_keeps_state.py``): every table optimizer, table dtype,
placement and megatron's distributed optimizer; live state bit-identical across the save and the
losses equal to a run without a save. Through the trainer, 1 process: ``rowwise_adam`` with
float32 tables and the 4-byte configuration on the host, saving at iteration 4 of 8, give
exactly the losses of the same run without a save."""

from __future__ import annotations


import pytest

from launch import REPO, torchrun, run_process
from test_reliability_trainer import ENV, read_metrics, trainer_cmd


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return torchrun("save_keeps_state.py", 2, tmp_path_factory.mktemp("save_keeps_state"))


def test_ranks_agree(results):
    """Losses agree; the tensor counts may not (the distributed optimizer shards its state)."""
    def shared(result):
        return {name: {k: v for k, v in case.items() if k != "state_tensors"}
                for name, case in result.items()}
    assert shared(results[0]) == shared(results[1])


def test_every_case_keeps_its_state_and_losses(results):
    assert len(results[0]) == 10
    for name, case in results[0].items():
        assert case["saved"] == ["iter_0000002", "latest_checkpointed_iteration.txt"], name
        assert all(r[name]["state_tensors"] > 200 for r in results), name  # the walk saw the optimizers' state
        assert case["state_diffs"] == [], name
        assert case["saved_losses"] == case["plain_losses"], name
        assert len(case["saved_losses"]) == 4 and all(x is not None for x in case["saved_losses"])


FOUR_BYTE_HOST = ["model.engram_table_dtype=bf16", "model.engram_optimizer=rowwise_adam",
                  "model.engram_master_weights=false", "model.engram_optimizer_state_dtype=bf16",
                  "model.engram_table_placement=host"]


@pytest.mark.parametrize("overrides", [["model.engram_optimizer=rowwise_adam"], FOUR_BYTE_HOST],
                         ids=["rowwise_adam_fp32", "four_byte_host"])
def test_trainer_losses_with_a_save_equal_those_without(tmp_path, overrides):
    losses = {}
    for name, save in (("saved", [f"checkpoint.save={tmp_path / 'ckpt'}", "checkpoint.save_interval=4"]),
                       ("plain", [])):
        exp = tmp_path / name
        proc = run_process(
            trainer_cmd(1, f"experiment.exp_dir={exp}", "train.train_iters=8",
                        "train.eval_interval=null", "train.log_interval=1", *save, *overrides),
            cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
        losses[name] = [m["lm_loss"] for m in read_metrics(exp) if "lm_loss" in m]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("iter_")) == [
        "iter_0000004", "iter_0000008"]
    assert len(losses["plain"]) == 8
    assert losses["saved"] == losses["plain"]

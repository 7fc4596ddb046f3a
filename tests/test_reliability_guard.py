"""The divergence guard's rules and checkpoint retraction without training, and how config and
input errors end (once, without a traceback; unexpected errors keep theirs). The guard inside
real trainer runs: test_reliability_trainer.py."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from engram_train.config import register
from hydra.errors import ConfigCompositionException

from launch import REPO, free_port

CONF = str(REPO / "conf")
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
UNIFORM = math.log(4096)


def _cfg(*overrides):
    register()  # the run config's schema (conf/train.yaml's defaults)
    with initialize_config_dir(config_dir=CONF, version_base=None):
        return compose(config_name="train", overrides=list(overrides))


def _run(guard, steps):
    """[(kind, first_abnormal)] for (loss, grad norm) steps from iteration 1."""
    return [(v.kind, guard.first_abnormal) for v in (guard.observe(i, loss, norm)
                                                      for i, (loss, norm) in enumerate(steps, 1))]  # fmt: skip


# -- the rules --------------------------------------------------------------------------------


def test_spike_rule_is_relative_to_the_recent_window():
    from engram_train.training.divergence import DivergenceGuard

    # The first loss has nothing to compare with; 10x the largest recent loss is still normal.
    assert _run(DivergenceGuard(4096), [(8.3, 1.0), (83.0, 1.0), (831.0, 1.0)]) == [
        ("ok", None), ("ok", None), ("spike", 3)]
    # Only the last `window` losses count: 8.3 has left a window of 2 when the 40 arrives.
    steps = [(8.3, 1.0), (3.0, 1.0), (3.0, 1.0), (40.0, 1.0)]
    assert _run(DivergenceGuard(4096, window=2), steps)[-1] == ("spike", 4)
    assert _run(DivergenceGuard(4096, window=3), steps)[-1] == ("ok", None)
    # A factor chosen by the user.
    assert _run(DivergenceGuard(4096, spike_factor=2.0), [(5.0, 1.0), (10.5, 1.0)])[-1] == ("spike", 2)


def test_collapse_needs_consecutive_zero_gradients_at_uniform_loss():
    from engram_train.training.divergence import DivergenceGuard

    zero = (UNIFORM, 0.0)
    assert _run(DivergenceGuard(4096), [(8.4, 0.9), zero, zero]) == [
        ("ok", None), ("suspect", 2), ("collapse", 2)]
    # A normal step in between restarts the count (and the abnormal streak).
    assert _run(DivergenceGuard(4096), [zero, (7.0, 0.5), zero, (6.9, 0.5)]) == [
        ("suspect", 1), ("ok", None), ("suspect", 3), ("ok", None)]
    # A zero gradient away from ln(vocab), or ln(vocab) with a gradient, is not a collapse.
    assert _run(DivergenceGuard(4096), [(5.0, 0.0)] * 3 + [(UNIFORM, 0.3)] * 3) == [("ok", None)] * 6
    assert _run(DivergenceGuard(4096, collapse_steps=3), [zero] * 3)[-1] == ("collapse", 1)
    # ln of the vocabulary the logits span (the padded one)
    assert _run(DivergenceGuard(4224), [(UNIFORM, 0.0)])[-1] == ("ok", None)


def test_nonfinite_steps_open_a_streak_and_are_not_window_values():
    from engram_train.training.divergence import DivergenceGuard

    guard = DivergenceGuard(4096)
    assert _run(guard, [(8.0, 1.0), (math.nan, math.nan), (7.9, math.inf), (7.8, 1.0), (70.0, 1.0)]) == [
        ("ok", None), ("non-finite", 2), ("non-finite", 2), ("ok", None), ("ok", None)]
    assert max(guard.recent) == 70.0  # 8.0, 7.8, 70.0: no NaN in the window


def test_guard_keys_are_validated_and_the_guard_can_be_switched_off():
    from engram_train.training.plan import check
    from engram_train.training.divergence import guard_from_config
    from engram_train.training.run_config import ConfigError, validate_run_config

    assert guard_from_config(_cfg("train.divergence_guard=false"), 4096) is None
    guard = guard_from_config(_cfg(), 4096)
    assert (guard.spike_factor, guard.window, guard.collapse_steps) == (10.0, 100, 2)
    for override, key in [("train.divergence_spike_factor=1", "train.divergence_spike_factor=1"),
                          ("train.divergence_window=0", "train.divergence_window=0")]:  # fmt: skip
        with pytest.raises(ConfigError, match=key):  # with the run config's rules
            validate_run_config(_cfg(override), 1, check_data=False)
    with pytest.raises(ConfigCompositionException, match="train.divergence_guard=maybe"):  # typed
        _cfg("train.divergence_guard=maybe")
    with pytest.raises(ConfigError, match="train.divergence_collapse_steps=0"):  # checked at start-up
        check(_cfg("train.divergence_collapse_steps=0", "experiment.exp_dir=/tmp/engram_guard_check"))


# -- retracting checkpoints -------------------------------------------------------------------


def test_retract_sets_checkpoints_aside_and_moves_the_tracker(tmp_path):
    from engram_train.checkpoint import TRACKER, latest_iteration, list_checkpoints, remove_leftovers
    from engram_train.checkpoint import retract_checkpoints

    for i in (1, 2, 3, 4):
        (tmp_path / f"iter_{i:07d}").mkdir()
        (tmp_path / f"iter_{i:07d}" / "manifest.json").write_text(json.dumps({"files": {}}))
    (tmp_path / TRACKER).write_text("4")
    assert retract_checkpoints(tmp_path, [3, 4], below=3) == (["iter_0000003.diverged", "iter_0000004.diverged"], 2)
    assert list_checkpoints(tmp_path) == [1, 2] and latest_iteration(tmp_path) == 2
    remove_leftovers(tmp_path)  # the next save's cleanup leaves them for inspection
    assert (tmp_path / "iter_0000004.diverged").is_dir()
    # Not this run's checkpoint (a resume point below `below`... or at it): only the tracker moves.
    assert retract_checkpoints(tmp_path, [], below=2) == ([], 1)
    assert (tmp_path / "iter_0000002").is_dir() and latest_iteration(tmp_path) == 1
    # The same iteration set aside twice; nothing left below: the tracker goes.
    (tmp_path / "iter_0000004").mkdir()
    (tmp_path / "iter_0000004" / "manifest.json").write_text(json.dumps({"files": {}}))
    assert retract_checkpoints(tmp_path, [1, 4], below=1) == (["iter_0000001.diverged", "iter_0000004.diverged.1"],
                                                              None)  # fmt: skip
    assert not (tmp_path / TRACKER).exists() and list_checkpoints(tmp_path) == [2]


# -- how errors end ----------------------------------------------------------------------------


def test_input_errors_found_while_hashing_are_config_errors(tmp_path):
    from engram_train.training.plan import check
    from engram_train.training.run_config import ConfigError

    exp = f"experiment.exp_dir={tmp_path}"
    with pytest.raises(ConfigError, match=r"model: engram_pad_id=99999 is outside the tokenizer's range"):
        check(_cfg(exp, "model.engram_pad_id=99999"))
    with pytest.raises(ConfigError, match=r"model: engram_tokenizer_name_or_path: no tokenizer.json at '/nope'"):
        check(_cfg(exp, "model.engram_tokenizer_name_or_path=/nope"))


UNEXPECTED = """
import sys
import engram_train.train as t
def run(cfg):
    raise RuntimeError("an unexpected failure")
t.run = run
sys.argv = ["engram-train", "experiment.exp_dir=" + sys.argv[1]]
t.main()
"""


@pytest.mark.cpu_slots(2)
def test_config_errors_print_once_without_traceback_and_unexpected_ones_keep_it(tmp_path):
    """A config error under torchrun (2 ranks) and alone: its message once, no traceback of
    the trainer, exit 1. An unexpected exception keeps its traceback."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
                "-m", "engram_train.train", f"experiment.exp_dir={tmp_path / 'a'}", "model.engram_pad_id=99999"]
    alone = [sys.executable, "-m", "engram_train.train", f"experiment.exp_dir={tmp_path / 'b'}",
             "model.engram_tokenizer_name_or_path=/nope"]  # fmt: skip
    unexpected = [sys.executable, "-c", UNEXPECTED, str(tmp_path / "c")]
    procs = [subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd in (torchrun, alone, unexpected)]  # fmt: skip
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    codes = [p.returncode for p in procs]
    trainer_frames = f'File "{REPO / "engram_train"}'

    out = outputs[0]
    assert codes[0] != 0, out[-3000:]
    message = "engram-train: invalid configuration: model: engram_pad_id=99999 is outside the tokenizer's range"
    assert out.count(message) == 1, out[-3000:]
    assert trainer_frames not in out and "HYDRA_FULL_ERROR" not in out  # torchrun adds its own summary

    out = outputs[1]
    assert codes[1] == 1, out[-3000:]
    assert out.count("engram-train: invalid configuration: model: engram_tokenizer_name_or_path: no tokenizer.json "
                     "at '/nope'") == 1, out[-3000:]  # fmt: skip
    assert "Traceback" not in out

    out = outputs[2]
    assert codes[2] != 0 and "RuntimeError: an unexpected failure" in out, out[-3000:]
    assert "Traceback" in out and 'line 5, in run' in out

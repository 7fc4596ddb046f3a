"""Reliability without a process group: resume checks (run identity, LR schedule), layer-id
order, output directories, engram-preprocess failure modes, the exit-signal handler, writer
processes that die with their parent, and a plot that cannot fail a finished run.

The faults that need real training runs are in test_reliability_trainer.py."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import time
import types

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from engram_train.config import register

from launch import REPO

CONF = str(REPO / "conf")
DEMO_TOKENIZER = str(REPO / "examples" / "data" / "tokenizer")
OTHER_TOKENIZER = str(REPO / "tests" / "data" / "golden" / "tok_bpe4k")


def _cfg(*overrides):
    register()  # the run config's schema (conf/train.yaml's defaults)
    with initialize_config_dir(config_dir=CONF, version_base=None):
        return compose(config_name="train", overrides=list(overrides))


def _identity(*overrides):
    from engram_train.engram.ngram_hash import NgramHashMapping
    from engram_train.training.run_config import build_transformer_config
    from engram_train.training.run_identity import run_identity

    config = build_transformer_config(_cfg(*overrides))
    mapping = NgramHashMapping(config) if config.use_engram else None
    return run_identity(config, 4096, mapping)


# -- engram_layer_ids order ---------------------------------------------------------------------


def test_layer_id_order_does_not_change_the_tables():
    """[3, 1] and [1, 3] are the same model: sorted ids, the same primes and multipliers."""
    from engram_train.config import EngramConfig
    from engram_train.engram.ngram_hash import NgramHashMapping, engram_head_vocab_sizes

    assert EngramConfig(engram_layer_ids=[3, 1]).engram_layer_ids == [1, 3]
    a, b = _identity("model.engram_layer_ids=[3,1]"), _identity("model.engram_layer_ids=[1,3]")
    assert a == b
    # Independent of the config: the prime walk in increasing layer order.
    walk = engram_head_vocab_sizes([20011, 20011], 3, 4, [1, 3])
    assert a["engram"]["primes"] == {str(k): [p for o in v for p in o] for k, v in walk.items()}
    mapping = NgramHashMapping(EngramConfig(
        use_engram=True, engram_tokenizer_name_or_path=DEMO_TOKENIZER, engram_vocab_size=[50, 40],
        n_embed_per_ngram=8, n_head_per_ngram=2, engram_layer_ids=[5, 2]))  # fmt: skip
    ids = np.arange(40).reshape(2, 20)
    again = NgramHashMapping(EngramConfig(
        use_engram=True, engram_tokenizer_name_or_path=DEMO_TOKENIZER, engram_vocab_size=[50, 40],
        n_embed_per_ngram=8, n_head_per_ngram=2, engram_layer_ids=[2, 5]))  # fmt: skip
    for layer in (2, 5):
        np.testing.assert_array_equal(mapping.hash(ids)[layer], again.hash(ids)[layer])


# -- run identity --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_identity():
    return _identity()


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["model.engram_seed=7"], [r"model\.engram_seed: 0 in the checkpoint, 7 here",
                                   r"resume with model\.engram_seed=0",
                                   r"checkpoint\.load_engram=false"]),
        ([f"model.engram_tokenizer_name_or_path={OTHER_TOKENIZER}"],
         [r"model\.engram_tokenizer_name_or_path \(the compressed vocabulary\)",
          r"checkpoint\.load_engram=false"]),
        (["model.max_ngram_size=2", "model.engram_vocab_size=[20011]"],
         [r"model\.max_ngram_size: 3 in the checkpoint, 2 here"]),
        (["model.n_head_per_ngram=2"], [r"model\.n_head_per_ngram: 4 in the checkpoint, 2 here"]),
        (["model.engram_layer_ids=[1,2]"], [r"model\.engram_layer_ids: \[1, 3\] in the checkpoint, \[1, 2\] here"]),
        (["model.engram_pad_id=5"], [r"model\.engram_pad_id: 0 in the checkpoint, 5 here"]),
        (["model.hidden_size=128"], [r"model\.hidden_size: 64 in the checkpoint, 128 here",
                                     r"Parameter shapes cannot change"]),
        (["model.use_engram=false"], [r"the checkpoint has Engram, this run has use_engram=false",
                                      r"checkpoint\.load_engram=false"]),
    ],
)
def test_identity_mismatch_names_the_key_and_the_override(saved_identity, overrides, expected):
    from engram_train.training.run_identity import ResumeMismatchError, check_run_identity

    with pytest.raises(ResumeMismatchError) as e:
        check_run_identity(saved_identity, _identity(*overrides), load_engram=True, where="ckpt/iter_0000004")
    for pattern in expected:
        assert re.search(pattern, str(e.value)), str(e.value)


def test_identity_adding_engram_needs_the_switch(saved_identity):
    from engram_train.training.run_identity import ResumeMismatchError, check_run_identity

    plain = _identity("model.use_engram=false")
    with pytest.raises(ResumeMismatchError, match=r"saved without Engram.*checkpoint\.load_engram=false"):
        check_run_identity(plain, saved_identity, load_engram=True, where="x")
    # With the switch, Engram differences are accepted; shapes still are not.
    check_run_identity(plain, saved_identity, load_engram=False, where="x")
    check_run_identity(saved_identity, _identity("model.engram_seed=7"), load_engram=False, where="x")
    with pytest.raises(ResumeMismatchError, match="hidden_size"):
        check_run_identity(saved_identity, _identity("model.hidden_size=128"), load_engram=False, where="x")
    check_run_identity(None, saved_identity, load_engram=True, where="x")  # older checkpoints


# -- LR schedule on resume ----------------------------------------------------------------------


def _scheduler(cfg, samples=0):
    from engram_train.training.plan import lr_scheduler

    opt = types.SimpleNamespace(param_groups=[{"lr": 0.0}])
    scheduler = lr_scheduler(cfg, opt)
    if samples:
        scheduler.step(increment=samples)
    return scheduler, opt


def _cosine(lr, min_lr, warmup, decay, step):
    """Megatron's warmup + cosine schedule in samples, written out independently."""
    if step <= warmup:
        return lr * step / warmup
    if step > decay:
        return min_lr
    ratio = (step - warmup) / (decay - warmup)
    return min_lr + (lr - min_lr) * 0.5 * (math.cos(math.pi * ratio) + 1.0)


def test_longer_train_iters_is_refused_or_follows_the_chosen_schedule():
    from engram_train.training.run_identity import ResumeMismatchError, check_schedule

    base = ["train.train_iters=30", "train.lr_warmup_iters=5"]
    saved_sched, _ = _scheduler(_cfg(*base), samples=30 * 8)
    saved = saved_sched.state_dict()
    longer = _cfg("train.train_iters=60", "train.lr_warmup_iters=5")
    kwargs = dict(global_batch_size=8, lr_decay_iters_set=False, where="ckpt/iter_0000030")
    with pytest.raises(ResumeMismatchError) as e:
        check_schedule(saved, _scheduler(longer)[0].state_dict(), override=False, use_checkpoint=False, **kwargs)
    msg = str(e.value)
    assert "train.train_iters" in msg and "240 samples (~30 iterations of 8)" in msg and "480 (~60)" in msg
    assert "checkpoint.override_opt_param_scheduler=true" in msg
    assert "checkpoint.use_checkpoint_opt_param_scheduler=true" in msg
    with pytest.raises(ResumeMismatchError, match=r"train\.lr: 0\.003 in the checkpoint, 0\.001 here"):
        check_schedule(saved, _scheduler(_cfg(*base, "train.lr=1e-3"))[0].state_dict(),
                       override=False, use_checkpoint=False, **kwargs)  # fmt: skip

    # megatron's semantics, checked against the cosine written out above.
    lr, min_lr = 3e-3, 3e-4
    for flag, decay in (("override", 60 * 8), ("use_checkpoint", 30 * 8)):
        cfg = _cfg("train.train_iters=60", "train.lr_warmup_iters=5", f"checkpoint.{flag}_opt_param_scheduler=true")
        check_schedule(saved, _scheduler(cfg)[0].state_dict(), override=flag == "override",
                       use_checkpoint=flag == "use_checkpoint", **kwargs)  # fmt: skip
        scheduler, opt = _scheduler(cfg)
        scheduler.load_state_dict(saved)
        done = 30
        for it in (31, 45, 59):
            scheduler.step(increment=(it - done) * 8)
            done = it
            want = _cosine(lr, min_lr, 40, decay, it * 8)
            assert opt.param_groups[0]["lr"] == pytest.approx(want, rel=1e-9), (flag, it)
            # the new schedule has not decayed yet; the checkpoint's is over
            assert (want > min_lr) is (flag == "override")


def test_schedule_flags_are_exclusive():
    from engram_train.training.run_config import ConfigError, validate_run_config

    with pytest.raises(ConfigError, match="both true"):
        validate_run_config(_cfg("checkpoint.override_opt_param_scheduler=true",
                                 "checkpoint.use_checkpoint_opt_param_scheduler=true"), 1)  # fmt: skip
    with pytest.raises(ConfigError, match=r"train\.nonfinite_skip_budget=-1"):
        validate_run_config(_cfg("train.nonfinite_skip_budget=-1"), 1)
    with pytest.raises(ConfigError, match=r"train\.exit_duration_in_mins=0"):
        validate_run_config(_cfg("train.exit_duration_in_mins=0"), 1)


# -- output directories, before any process group ----------------------------------------------


def test_unwritable_directories_fail_before_training(tmp_path):
    from engram_train.training.plan import check
    from engram_train.training.run_config import ConfigError

    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match=r"checkpoint\.save=.*a_file/ckpt is not writable"):
        check(_cfg(f"experiment.exp_dir={tmp_path / 'run'}", f"checkpoint.save={blocker / 'ckpt'}"))
    with pytest.raises(ConfigError, match=r"experiment\.exp_dir=.*a_file/run is not writable"):
        check(_cfg(f"experiment.exp_dir={blocker / 'run'}"))
    if os.geteuid() != 0:  # permission bits do not stop root
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ConfigError, match="Permission denied"):
            check(_cfg(f"experiment.exp_dir={tmp_path / 'run'}", f"checkpoint.save={locked}"))


def test_fresh_start_refuses_to_overwrite_checkpoints(tmp_path):
    from engram_train.training.plan import check
    from engram_train.training.run_config import ConfigError

    save = tmp_path / "ckpt"
    (save / "iter_0000002").mkdir(parents=True)
    (save / "iter_0000002" / "manifest.json").write_text(json.dumps({"files": {}}))
    (save / "latest_checkpointed_iteration.txt").write_text("2")
    before = sorted(p.name for p in save.rglob("*"))
    with pytest.raises(ConfigError, match=r"already holds checkpoints \(iter_0000002\).*"
                                          r"checkpoint\.load=.*checkpoint\.overwrite=true"):
        check(_cfg(f"experiment.exp_dir={tmp_path / 'run'}", f"checkpoint.save={save}"))
    assert sorted(p.name for p in save.rglob("*")) == before
    check(_cfg(f"experiment.exp_dir={tmp_path / 'run'}", f"checkpoint.save={save}", "checkpoint.overwrite=true"))


# -- engram-preprocess ---------------------------------------------------------------------------


def _preprocess(*args):
    from engram_train.data.preprocess import main

    return main([*args, "--tokenizer", DEMO_TOKENIZER, "--no-progress"])


def _read(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(str(prefix))
    return [np.array(ds[i]).tolist() for i in range(len(ds))]


def test_failed_preprocess_keeps_the_existing_output(tmp_path, capsys):
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"text": f"document number {i}."}) + "\n" for i in range(5)))
    out = tmp_path / "data" / "corpus"
    assert _preprocess("--input", str(good), "--output-prefix", str(out)) == 0
    pair = {ext: (tmp_path / "data" / f"corpus_text_document.{ext}").read_bytes() for ext in ("bin", "idx")}
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "fine"}\n' * 1000 + b'{"text": "caf\xe9"}\n')
    assert _preprocess("--input", str(good), str(bad), "--output-prefix", str(out)) == 1
    err = capsys.readouterr().err
    assert f"{bad}:1001: not valid UTF-8 (byte 0xe9 at column 14)" in err and "nothing was written" in err
    assert "--skip-bad-lines" in err
    for ext, data in pair.items():  # byte for byte what the good run wrote
        assert (tmp_path / "data" / f"corpus_text_document.{ext}").read_bytes() == data
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["corpus_text_document.bin",
                                                                    "corpus_text_document.idx"]
    # a tokenizer path that holds none: one line naming the flag, the earlier output kept
    from engram_train.data.preprocess import main

    assert main(["--input", str(good), "--output-prefix", str(out), "--tokenizer", str(tmp_path / "missing"),
                 "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"engram-preprocess: --tokenizer: no tokenizer.json at '{tmp_path / 'missing'}'")
    assert err.count("\n") == 1 and "Traceback" not in err
    for ext, data in pair.items():
        assert (tmp_path / "data" / f"corpus_text_document.{ext}").read_bytes() == data
    # an output folder it cannot write in (procfs: root included): refused before tokenizing
    assert _preprocess("--input", str(good), "--output-prefix", "/proc/corpus") == 1
    err = capsys.readouterr().err
    assert err.startswith("engram-preprocess: --output-prefix /proc/corpus: cannot write in /proc (")


@pytest.mark.parametrize(
    "name, content, args, message",
    [
        ("empty.txt", b"", [], r"empty\.txt: no documents \(the file is empty"),
        ("blank.jsonl", b"\n  \n", [], r"blank\.jsonl: no documents"),
        ("key.jsonl", b'{"text": "a"}\n{"body": "b"}\n', [], r"key\.jsonl:2: no 'text' field \(set --json-key\)"),
        ("notjson.jsonl", b'{"text": "a"}\n{text\n', [], r"notjson\.jsonl:2: not valid JSON"),
        ("latin1.txt", b"para one\n\nna\xefve line\n", [], r"latin1\.txt:3: not valid UTF-8 \(byte 0xef at column 3\)"),
        ("whole.txt", b"ok\nstill ok\nbad \xff\n", ["--text-doc", "file"],
         r"whole\.txt:3: not valid UTF-8 \(byte 0xff at column 5\)"),
    ],
)
def test_bad_inputs_name_file_and_line(tmp_path, capsys, name, content, args, message):
    path = tmp_path / name
    path.write_bytes(content)
    assert _preprocess("--input", str(path), "--output-prefix", str(tmp_path / "o"), *args) == 1
    assert re.search(message, capsys.readouterr().err)
    assert list(tmp_path.iterdir()) == [path]  # no output, no temporary file


def test_skip_bad_lines_counts_them(tmp_path, capsys):
    from engram_train.data.text_tokenizer import load_tokenizer

    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b'{"text": "first good"}\n{"body": 1}\n{"text": "caf\xe9"}\nnot json\n'
                     b'{"text": 5}\n{"text": "second good"}\n')  # fmt: skip
    assert _preprocess("--input", str(path), "--output-prefix", str(tmp_path / "o"), "--skip-bad-lines") == 0
    err = capsys.readouterr().err
    assert "4 bad lines skipped" in err
    for lineno in (2, 3, 4, 5):
        assert f"mixed.jsonl:{lineno}:" in err
    tok = load_tokenizer(DEMO_TOKENIZER)
    assert _read(tmp_path / "o_text_document") == [tok.tokenize(t) + [tok.eod] for t in ("first good", "second good")]


# -- exit signal, time limit, child processes ----------------------------------------------------


def test_signal_handler_records_sigterm_and_restores():
    from engram_train.training.faults import ExitSignalHandler, StopCheck

    previous = signal.getsignal(signal.SIGTERM)
    handler = ExitSignalHandler().install()
    try:
        assert not StopCheck(handler, None)(nonfinite=False).exit
        os.kill(os.getpid(), signal.SIGTERM)  # would end the test process without the handler
        time.sleep(0.05)
        decision = StopCheck(handler, None)(nonfinite=False)
        assert handler.received == "SIGTERM" and decision.signal and decision.exit
    finally:
        handler.restore()
    assert signal.getsignal(signal.SIGTERM) is previous
    late = StopCheck(None, exit_duration_mins=0.5, start_time=time.time() - 31)(nonfinite=True)
    assert late.time_limit and late.exit and late.nonfinite and not late.signal


CHILD_SCRIPT = """
import multiprocessing as mp, sys, time
if sys.argv[1] == "on":
    from engram_train.training.faults import children_die_with_parent
    children_die_with_parent()
child = mp.get_context("fork").Process(target=time.sleep, args=(60,))
child.start()
print(child.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("mode", ["on", "off"])
def test_forked_children_die_with_their_parent(mode):
    """A rank killed with SIGKILL takes its forked children (checkpoint writers) with it; the
    control run ("off") shows the child would otherwise survive."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD_SCRIPT, mode], stdout=subprocess.PIPE,
                            text=True, cwd=REPO)  # fmt: skip
    child = int(proc.stdout.readline())
    proc.kill()
    proc.wait()
    deadline = time.time() + 5
    while time.time() < deadline and _alive(child):
        time.sleep(0.05)
    survived = _alive(child)
    if survived:
        os.kill(child, signal.SIGKILL)
    assert survived is (mode == "off")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


# -- the plot never fails a finished run --------------------------------------------------------


def test_failed_plot_is_a_warning(tmp_path, caplog):
    from engram_train.training.loop import finish

    job = types.SimpleNamespace(is_logger=True, exp_dir=tmp_path)  # no metrics.jsonl to plot
    with caplog.at_level(logging.WARNING, logger="engram_train"):
        finish(job)
    assert "loss plot skipped: MetricsNotFoundError: no metrics.jsonl at" in caplog.text

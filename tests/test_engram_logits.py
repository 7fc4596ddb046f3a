"""engram-logits: a checkpoint's logits equal an independent forward of it, at one process and
at TP2 x PP2, EP2 x Engram embedding-parallel 2 and TP2 x EP2 x eps 2; models without Engram
and with mHC at TP2 x PP2, DeepSeek-V4.1's on four data-parallel replicas; the ids and layouts
it refuses, each in one line, with nothing written."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from launch import REPO, free_port, run_process, torchrun

TOKENIZER = REPO / "examples" / "data" / "tokenizer"
DATA = REPO / "examples" / "data" / "demo_text_document"
EOD = 0  # the demo tokenizer's end-of-document id
LAYOUTS = {
    "tp2_pp2": "system.tensor_model_parallel_size=2,system.pipeline_model_parallel_size=2",
    "ep2_eps2": "system.expert_model_parallel_size=2,model.engram_embedding_parallel_size=2",
    "tp2_ep2_eps2": "system.tensor_model_parallel_size=2,system.expert_model_parallel_size=2,"
                    "model.engram_embedding_parallel_size=2",
}
# seeded models saved with their run config (as engram-import-hf saves one); V4.1 runs
# data-parallel only for now (its config refuses model parallelism)
TP2_PP2 = ["system.tensor_model_parallel_size=2", "system.pipeline_model_parallel_size=2"]
MODELS = {
    "no_engram": {"model": ["model.use_engram=false"], "layout": TP2_PP2},
    "mhc": {"model": ["model.enable_hyper_connections=true"], "layout": TP2_PP2},
    "v41": {"preset": "deepseek_v41_tiny", "layout": []},
}


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def ids_rows() -> list[list[int]]:
    """Three rows of 21 ids (odd: under sequence parallelism the command extends them), with
    end-of-document ids inside (Engram's n-grams and the positions restart after them)."""
    g = torch.Generator().manual_seed(3)
    rows = torch.randint(1, 4000, (3, 21), generator=g)
    rows[0, 7] = rows[1, 12] = rows[2, 0] = EOD
    return rows.tolist()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """deepseek_v3_tiny with Engram (resetting at EOS, positions reset too), two steps on one
    process; its checkpoint inside exp_dir, where the command finds the run config itself."""
    root = tmp_path_factory.mktemp("logits")
    exp = root / "run"
    ckpt = exp / "checkpoints"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1",
           f"--master-port={free_port()}", "-m", "engram_train.train", "model=deepseek_v3_tiny",
           "train.train_iters=2", "train.global_batch_size=2", "train.micro_batch_size=2",
           "train.seq_length=32", "train.eval_interval=null", "train.lr_warmup_iters=0",
           "model.engram_vocab_size=[1009,1009]", "model.engram_reset_at_eos=true",
           f"model.engram_eos_id={EOD}", "data.reset_position_ids=true",
           f"experiment.exp_dir={exp}", f"checkpoint.save={ckpt}", f"data.path={DATA}",
           f"data.tokenizer={TOKENIZER}"]
    proc = run_process(cmd, cwd=root, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ids = root / "ids.json"
    ids.write_text(json.dumps(ids_rows()))
    return SimpleNamespace(root=root, exp=exp, ckpt=ckpt, ids=ids)


@pytest.fixture(scope="module")
def one_process(trained):
    """The console command at one process, from another directory, given only --load."""
    out = trained.root / "one.safetensors"
    proc = run_process([sys.executable, "-m", "engram_train.inference.logits", "--load",
                        str(trained.ckpt), "--ids", str(trained.ids), "--out", str(out)],
                       cwd=trained.root, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "engram-logits: wrote" in proc.stderr
    return out


@pytest.fixture(scope="module")
def layouts(trained):
    out = trained.root / "layouts"
    results = torchrun("logits_layouts.py", 4, out, "--ckpt", str(trained.ckpt), "--config",
                       str(trained.exp / "config.yaml"), "--ids", str(trained.ids), "--layouts",
                       ";".join(f"{name}:{o}" for name, o in LAYOUTS.items()), "--models",
                       json.dumps(MODELS))
    return out, results


def _max_diff(a: Path, b: Path) -> float:
    x, y = load_file(str(a))["logits"], load_file(str(b))["logits"]
    assert x.shape == y.shape and x.dtype == y.dtype == torch.float32
    return float((x - y).abs().max())


def test_one_process_equals_an_independent_forward(one_process, layouts):
    with safe_open(str(one_process), "pt") as f:
        assert list(f.keys()) == ["logits"]
        assert f.metadata()["iteration"] == "2"
        logits = f.get_tensor("logits")
    assert logits.shape == (3, 21, 4096)  # the demo tokenizer's 4096 rows
    assert logits.abs().max() > 0.1  # a trained model, not zeros
    assert _max_diff(one_process, layouts[0] / "independent.safetensors") <= 1e-5


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layouts_equal_one_process(one_process, layouts, layout):
    out, results = layouts
    assert results[0]["shapes"][layout] == [3, 21, 4096]  # rank 0 holds them
    assert all(r["shapes"][layout] is None for r in results[1:])
    assert _max_diff(one_process, out / f"{layout}.safetensors") <= 1e-5
    assert not [p for p in out.iterdir() if ".tmp" in p.name]  # written through a rename


@pytest.mark.parametrize("model", sorted(MODELS))
def test_other_models_equal_their_forward(layouts, model):
    out, results = layouts
    assert results[0]["shapes"][model] == [3, 21, 4096]
    logits = load_file(str(out / model / "command.safetensors"))["logits"]
    assert logits.abs().max() > 0.05  # not zeros
    assert _max_diff(out / model / "independent.safetensors",
                     out / model / "command.safetensors") <= 1e-5


def _refused(capsys, tmp_path, trained, ids, *overrides) -> str:
    """The command's message (one line) when it refuses; nothing is written."""
    from engram_train.inference.logits import main

    path = tmp_path / "ids.json"
    path.write_text(ids if isinstance(ids, str) else json.dumps(ids))
    out = tmp_path / "out.safetensors"
    with pytest.raises(SystemExit) as exit_:
        main(["--load", str(trained.ckpt), "--ids", str(path), "--out", str(out), *overrides])
    assert exit_.value.code == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ids.json"]
    message = capsys.readouterr().err.strip()
    assert len(message.splitlines()) == 1, message
    return message


def test_refusals_name_the_problem_and_the_fix(capsys, tmp_path, trained):
    good = ids_rows()
    message = _refused(capsys, tmp_path, trained, [[1, 2, 3], [4, 5]])
    assert "is ragged: row 0 has 3 ids, row 1 has 2" in message and "one length" in message
    message = _refused(capsys, tmp_path, trained, [])
    assert "holds an empty list: give at least one token list" in message
    message = _refused(capsys, tmp_path, trained, [[1, 2], []])
    assert "row 1 is empty" in message
    message = _refused(capsys, tmp_path, trained, [[1, "a"]])
    assert "row 0 is not a list of integer token ids" in message
    message = _refused(capsys, tmp_path, trained, "[[1, 2]")
    assert "not JSON" in message
    message = _refused(capsys, tmp_path, trained, [[1, 2, 4096], [3, 4, 5]])
    assert ("id 4096 (row 0, position 2) is outside the vocabulary [0, 4096) of the checkpoint"
            in message and "give ids of the tokenizer" in message)
    message = _refused(capsys, tmp_path, trained, [[1, -1]])
    assert "id -1 (row 0, position 1) is outside the vocabulary" in message
    # layouts: this process alone cannot hold TP2; context parallelism; an unknown key
    message = _refused(capsys, tmp_path, trained, good, "system.tensor_model_parallel_size=2")
    assert "world size 1 is not divisible by tensor (2)" in message
    message = _refused(capsys, tmp_path, trained, good, "system.context_parallel_size=2")
    assert "system.context_parallel_size=2: engram-logits runs without context" in message
    message = _refused(capsys, tmp_path, trained, good, "system.tensor_parallel=2")
    assert "tensor_parallel" in message and "did you mean system.tensor_model_parallel_size" in message
    message = _refused(capsys, tmp_path, trained, good, "tp2")
    assert "'tp2' is not a key=value override of the run config" in message


def test_existing_out_is_kept_without_force(capsys, tmp_path, trained):
    from engram_train.inference.logits import main

    out = tmp_path / "out.safetensors"
    out.write_text("earlier")
    with pytest.raises(SystemExit):
        main(["--load", str(trained.ckpt), "--ids", str(trained.ids), "--out", str(out)])
    assert "already exists; choose another file or pass --force" in capsys.readouterr().err
    assert out.read_text() == "earlier"
    with pytest.raises(SystemExit):  # a folder it cannot write in: refused before the model loads
        main(["--load", str(trained.ckpt), "--ids", str(trained.ids), "--out", "/proc/logits.safetensors"])
    assert "--out /proc/logits.safetensors: cannot write in /proc (" in capsys.readouterr().err

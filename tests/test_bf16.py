"""bf16 end to end with Engram on CPU: module dtypes, precision validation, every parameter's
and the residual stream's dtype in the megatron model (TP2 x PP2, eps 2), bf16 tables with
float32 masters, exact checkpoint resume, and the trainer's bf16 run tracking float32."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from engram_train.config import register

from launch import REPO, free_port, torchrun, run_process

from engram_train.config import EngramConfig
from engram_train.engram.engram_module import Engram

CONF = str(REPO / "conf")
BF16, FP32 = "torch.bfloat16", "torch.float32"


def _engram_config(**overrides):
    return EngramConfig(use_engram=True, engram_tokenizer_name_or_path="unused",
                        engram_vocab_size=[300, 200], n_embed_per_ngram=16, n_head_per_ngram=2,
                        engram_layer_ids=[0, 2], **overrides)


# -- the Engram module ---------------------------------------------------------------------------

def test_engram_dense_params_in_dtype_table_in_table_dtype():
    torch.manual_seed(0)
    engram = Engram(_engram_config(), 12, 2, dtype=torch.bfloat16, table_dtype=torch.float32,
                    zero_init_conv=False)
    table = engram.multi_head_embedding.weight
    assert table.dtype == torch.float32
    dense = {n: p.dtype for n, p in engram.named_parameters() if p is not table}
    assert dense and set(dense.values()) == {torch.bfloat16}, dense

    # Same weights in float32: the bf16 branch's output is bf16 and agrees to bf16 precision.
    reference = Engram(_engram_config(), 12, 2, zero_init_conv=False)
    reference.load_state_dict({k: v.float() if v.is_floating_point() else v
                               for k, v in engram.state_dict().items()})
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(9, 2, 12, generator=g)
    ids = torch.randint(0, 199, (9, 2, engram.num_heads), generator=g)
    out = engram(hidden.bfloat16(), hash_ids=ids)
    want = reference(hidden.bfloat16().float(), hash_ids=ids)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want, rtol=0.05, atol=0.02)


def test_table_dtype_defaults():
    # One dtype for the whole module when only dtype is given (as before).
    assert Engram(_engram_config(), 12, 0, dtype=torch.bfloat16).multi_head_embedding.weight.dtype \
        == torch.bfloat16
    # Otherwise the config's engram_table_dtype.
    engram = Engram(_engram_config(engram_table_dtype="bf16"), 12, 0)
    assert engram.multi_head_embedding.weight.dtype == torch.bfloat16
    assert engram.value_proj.weight.dtype == torch.float32
    assert Engram(_engram_config(), 12, 0).multi_head_embedding.weight.dtype == torch.float32


def test_engram_table_dtype_is_validated():
    assert EngramConfig().engram_table_dtype == "fp32"
    with pytest.raises(ValueError, match="engram_table_dtype='fp16'"):
        _engram_config(engram_table_dtype="fp16")


# -- run config ----------------------------------------------------------------------------------

def _cfg(*overrides):
    register()  # the run config's schema (conf/train.yaml's defaults)
    with initialize_config_dir(config_dir=CONF, version_base=None):
        return compose(config_name="train", overrides=list(overrides))


def test_fp16_with_engram_is_rejected_early():
    from engram_train.training.run_config import ConfigError, validate_run_config

    with pytest.raises(ConfigError, match=r"system.precision=fp16\) is not supported with "
                                          r"use_engram=True.*system.precision=bf16"):
        validate_run_config(_cfg("system.precision=fp16"), 2)
    validate_run_config(_cfg("system.precision=fp16", "model.use_engram=false"), 2)  # megatron's own
    with pytest.raises(ConfigError, match=r"engram_table_dtype='fp16'"):
        validate_run_config(_cfg("model.engram_table_dtype=fp16"), 2)


def test_bf16_config_carries_megatron_precision_fields():
    from engram_train.training.run_config import validate_run_config

    cfg = _cfg("system.precision=bf16", "model.engram_table_dtype=bf16")
    config = validate_run_config(cfg, 2)
    assert config.bf16 and not config.fp16
    assert config.params_dtype == config.pipeline_dtype == torch.bfloat16
    assert config.engram_table_dtype == "bf16"


# -- the megatron model under TP2 x PP2, eps 2 (one launch) --------------------------------------

@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    return torchrun("bf16_model.py", 4, tmp_path_factory.mktemp("bf16_model"))


def test_every_parameter_dtype(bf16_model):
    for rank in bf16_model:
        fp32, bf16, bf16_tables = rank["fp32"], rank["bf16"], rank["bf16_tables"]
        assert len(rank["bf16"]["table_names"]) == 1  # one Engram layer per pipeline stage
        assert set(fp32["params"].values()) == {FP32}
        for run, table_dtype in ((bf16, FP32), (bf16_tables, BF16)):
            assert run["wrapped"] == ["Float16Module"]
            assert sorted(run["params"]) == sorted(fp32["params"])  # same parameters, by name
            for name, dtype in run["params"].items():
                want = table_dtype if name in run["table_names"] else BF16
                assert dtype == want, (name, dtype)
            # float32 main parameters for everything torch Adam steps (megatron's and the tables')
            assert run["megatron_main_dtypes"] == [FP32]
            assert run["table_main_dtypes"] == [FP32]
        assert bf16["table_mixed_precision"] is False and bf16_tables["table_mixed_precision"] is True


def test_residual_stream_is_bf16(bf16_model):
    for rank in bf16_model:
        last_stage = rank["pipeline_rank"] == 1
        assert rank["fp32"]["stream"]["layer_out"] == [FP32]
        for run in (rank["bf16"], rank["bf16_tables"]):
            s = run["stream"]
            assert s["layer_in"] == s["layer_out"] == s["engram_out"] == [BF16], s
            # Float16Module: bf16 activations to the next stage, float32 logits/loss at the end
            assert s["model_out"] == [FP32 if last_stage else BF16], s


def test_bf16_training_tracks_fp32_for_five_steps(bf16_model):
    last = [r for r in bf16_model if r["pipeline_rank"] == 1][0]
    reference = last["fp32"]["losses"]
    assert reference[-1] < reference[0] - 1.0  # it learns the fixed batches
    for run in ("bf16", "bf16_tables"):
        for got, want in zip(last[run]["losses"], reference):
            assert abs(got - want) / want < 0.01, (run, last[run]["losses"], reference)


def test_bf16_tables_equal_their_rounded_masters(bf16_model):
    for rank in bf16_model:
        assert rank["bf16_tables"]["table_is_rounded_master"] == 0.0


def test_bf16_checkpoint_resumes_exactly(bf16_model):
    for rank in bf16_model:
        resume = rank["resume"]
        assert resume["iteration"] == 5
        assert resume["table_max_diff"] == 0.0 and resume["master_max_diff"] == 0.0
        assert resume["backbone_bitwise"] and resume["backbone_dtypes"] == [BF16]
        if rank["pipeline_rank"] == 1:
            assert resume["next_loss"] == rank["bf16_tables"]["next_loss"]


# -- the trainer: 100 iterations bf16 vs fp32 on the demo's 2 processes, and a bf16 resume -------
# (bf16 under TP2 x PP2 x eps 2 is checked above, on the library, in one 4-process launch.)

LAYOUT = ["model.engram_embedding_parallel_size=2"]  # DP2, tables sharded over both ranks
# Small batches keep 3 launches affordable on 2 cores; the comparison is the same at the
# demo's batch (docs/presets.md#bf16-vs-fp32).
RUN = ["train.train_iters=100", "train.seq_length=64", "train.micro_batch_size=1",
       "train.global_batch_size=2", "train.log_interval=5", "train.eval_interval=100",
       "train.eval_iters=2"]


def run_trainer(nproc: int, *overrides: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={free_port()}", "-m", "engram_train.train", *overrides]
    proc = run_process(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def metrics(exp_dir: Path) -> dict[int, dict]:
    lines = (exp_dir / "metrics.jsonl").read_text().splitlines()
    return {r["iteration"]: r for r in map(json.loads, filter(None, lines))}


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16_trainer")
    run_trainer(2, *LAYOUT, *RUN, f"experiment.exp_dir={root / 'fp32'}")
    run_trainer(2, *LAYOUT, *RUN, "system.precision=bf16", f"experiment.exp_dir={root / 'bf16'}",
                f"checkpoint.save={root / 'ckpt'}", "checkpoint.save_interval=90")
    partial = root / "ckpt90"
    partial.mkdir()
    shutil.copytree(root / "ckpt" / "iter_0000090", partial / "iter_0000090")
    (partial / "latest_checkpointed_iteration.txt").write_text("90")
    run_trainer(2, *LAYOUT, *RUN, "system.precision=bf16", f"experiment.exp_dir={root / 'resumed'}",
                f"checkpoint.load={partial}")
    runs = {name: metrics(root / name) for name in ("fp32", "bf16", "resumed")}
    summary = {name: dict(final_lm_loss=m[100]["lm_loss"], val_loss=m[100]["val_loss"])
               for name, m in runs.items() if name != "resumed"}
    print("bf16 vs fp32, DP2 x eps 2, 100 iterations:", json.dumps(summary))
    return runs


def test_bf16_trainer_tracks_fp32_within_3_percent(trainer_runs):
    fp32, bf16 = trainer_runs["fp32"], trainer_runs["bf16"]
    assert sorted(bf16) == sorted(fp32) == list(range(5, 101, 5))
    assert fp32[100]["lm_loss"] < fp32[5]["lm_loss"] - 1.5  # both actually train
    assert bf16[100]["lm_loss"] < bf16[5]["lm_loss"] - 1.5
    assert abs(bf16[100]["val_loss"] - fp32[100]["val_loss"]) / fp32[100]["val_loss"] < 0.03
    for it in fp32:
        assert abs(bf16[it]["lm_loss"] - fp32[it]["lm_loss"]) / fp32[it]["lm_loss"] < 0.03, it


def test_bf16_trainer_resume_is_exact(trainer_runs):
    bf16, resumed = trainer_runs["bf16"], trainer_runs["resumed"]
    assert sorted(resumed) == [95, 100]
    for it in (95, 100):
        assert resumed[it]["lm_loss"] == bf16[it]["lm_loss"]
        assert resumed[it]["grad_norm"] == bf16[it]["grad_norm"]
    assert resumed[100]["val_loss"] == bf16[100]["val_loss"]

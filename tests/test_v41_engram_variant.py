"""The DeepSeek-V4.1 Engram variant (``engram_variant: deepseek_v41``) through the project's
config, hash-mapping factory, model, trainer, run identity and table layouts.

The module and hash themselves are checked against NeMo in tests/test_deepseek_v41_engram.py;
here: the config rules (each refusal one line), the field mapping onto V4.1's, the parameter
count, the token mask through the model, the trainer on the mHC backbone (falling loss, exact
resume, one process against Engram embedding parallelism 2), the resume and export refusals,
and the table options on 2 processes (tests/dist/v41_layouts.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

from engram_train.config import EngramConfig, register
from engram_train.errors import ConfigError
from launch import REPO, free_port, run_process, torchrun

TOKENIZER = str(REPO / "tests" / "data" / "golden" / "tok_bpe4k")
V41 = dict(use_engram=True, engram_tokenizer_name_or_path=TOKENIZER, engram_variant="deepseek_v41",
           engram_vocab_size=[257, 257], max_ngram_size=3, n_head_per_ngram=4,
           n_embed_per_ngram=32, engram_layer_ids=[1, 3])
# The trainer's runs: the demo model on mHC (4 streams) with V4.1 branches, documents at EOS.
TRAINER = ("model=deepseek_v3_tiny", "model.enable_hyper_connections=true",
           "model.engram_variant=deepseek_v41", "model.engram_reset_at_eos=true",
           "model.engram_eos_id=0", "train.train_iters=6", "train.log_interval=1",
           "train.eval_interval=null", "train.lr_warmup_iters=2")


def _cfg(*overrides):
    register()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return compose(config_name="train", overrides=list(overrides))


# -- config -----------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["deepseek_v3_tiny", "deepseek_v3_small", "engram_27b"])
def test_paper_variant_is_the_default(preset):
    assert EngramConfig().engram_variant == "paper"
    assert _cfg(f"model={preset}").model.engram_variant == "paper"


@pytest.mark.parametrize("fields, match", [
    (dict(engram_variant="v4"), r"engram_variant='v4' must be one of \('paper', 'deepseek_v41'\)"),
    (dict(engram_vocab_size=[257, 263]), r"engram_vocab_size=\[257, 263\] differs between"),
    (dict(engram_kernel_size=3), r"engram_kernel_size=3 has no meaning under"),
    (dict(engram_value_init="zero"), r"engram_value_init='zero' is not supported"),
    (dict(engram_one_row_per_head=True), r"engram_one_row_per_head=true is not supported"),
    (dict(engram_gate_eps=0.0), r"engram_gate_eps=0.0 must be finite and > 0"),
    (dict(engram_variant="paper", engram_gate_eps=1e-6), r"engram_gate_eps=1e-06 applies to"),
])
def test_settings_the_variant_cannot_honour_are_refused_in_one_line(fields, match):
    with pytest.raises(ConfigError, match=match) as info:
        EngramConfig(**{**V41, **fields})
    assert "\n" not in str(info.value)


def test_the_trainer_refuses_them_before_any_process_group():
    from engram_train.training.run_config import validate_run_config

    with pytest.raises(ConfigError, match="engram_kernel_size=2 has no meaning") as info:
        validate_run_config(_cfg("model.engram_variant=deepseek_v41", "model.engram_kernel_size=2"), 1)
    assert "\n" not in str(info.value)


def test_fields_map_onto_v41s():
    from engram_train.engram.variant import v41_engram_args
    from engram_train.training.run_config import build_transformer_config

    args = v41_engram_args(EngramConfig(**V41, engram_pad_id=3, engram_init_std=0.01))
    assert (args.engram_layer_ids, args.engram_max_ngram_size, args.engram_n_heads,
            args.engram_head_dim, args.engram_vocab_size, args.engram_pad_token_id, args.hc_mult,
            args.initializer_range, args.rms_norm_eps) == ((1, 3), 3, 4, 8, 257, 3, 1, 0.01, 1e-20)
    model = build_transformer_config(_cfg("model.engram_variant=deepseek_v41",
                                          "model.enable_hyper_connections=true"))
    args = v41_engram_args(model)
    assert args.hc_mult == 4 and args.rms_norm_eps == model.layernorm_epsilon
    assert args.num_hash_heads * args.engram_head_dim == 2 * model.n_embed_per_ngram
    model.engram_gate_eps = 1e-20
    assert v41_engram_args(model).rms_norm_eps == 1e-20


def test_one_factory_builds_each_variants_hash():
    from engram_train.engram.ngram_hash import NgramHashMapping
    from engram_train.engram.v41_ngram_hash import DeepseekV41NgramHashMapping, document_ids
    from engram_train.engram.variant import build_hash_mapping, v41_engram_args

    paper = build_hash_mapping(EngramConfig(**{**V41, "engram_variant": "paper"}))
    assert type(paper) is NgramHashMapping
    config = EngramConfig(**V41, engram_reset_at_eos=True, engram_eos_id=5)
    mapping = build_hash_mapping(config)
    assert isinstance(mapping, DeepseekV41NgramHashMapping)
    ids = np.random.default_rng(0).integers(0, 64, size=(2, 40))
    ids[:, ::9] = 5
    plain = DeepseekV41NgramHashMapping(v41_engram_args(config), TOKENIZER)
    expected = plain.hash_stacked(ids, sequence_ids=document_ids(ids, 5))
    np.testing.assert_array_equal(mapping.hash_block(ids), expected)
    assert not np.array_equal(plain.hash_stacked(ids), expected)  # documents matter here
    mask = np.ones(ids.shape, dtype=bool)
    mask[1, 30:] = False
    block = mapping.hash_block(torch.from_numpy(ids), torch.from_numpy(mask))
    assert block.shape == (3, 2, 40, 8)  # L = 2 layers + the mask, K = 2 orders x 4 heads
    torch.testing.assert_close(block[:2], torch.from_numpy(
        plain.hash_stacked(ids, mask, document_ids(ids, 5))), rtol=0, atol=0)
    assert torch.equal(block[2], torch.from_numpy(mask).long()[..., None].expand(2, 40, 8))


def test_parameters_are_counted(one_rank):
    """The count of engram-train's param_count (and engram-plan, which builds the same meta
    model): rows x D per table, (G+1)·d·K·D + 2·G·d per branch."""
    from engram_train.engram.variant import build_hash_mapping
    from engram_train.training.param_count import build_on_meta, count_parameters
    from engram_train.training.run_config import build_transformer_config

    config = build_transformer_config(_cfg("model.engram_variant=deepseek_v41",
                                           "model.enable_hyper_connections=true"))
    counts = count_parameters(build_on_meta(config, 4096, 64), config)
    mapping = build_hash_mapping(config)
    g, d, k = 4, config.hidden_size, mapping.num_heads
    width = config.n_embed_per_ngram // config.n_head_per_ngram
    layers = config.engram_layer_ids
    assert counts.engram_tables == sum(mapping.num_rows[i] for i in layers) * width
    assert counts.engram_dense == len(layers) * ((g + 1) * d * k * width + 2 * g * d)


def test_token_mask_reaches_the_branches(one_rank):
    """``engram_token_mask``: the branches add nothing at dead tokens (a padded tail), and the
    live positions before it see exactly what they see without the mask."""
    from engram_train.models.builder import build_gpt_model
    from engram_train.models.engram_layer import EngramTransformerLayer
    from engram_train.training.run_config import build_transformer_config

    torch.manual_seed(0)
    config = build_transformer_config(_cfg("model.engram_variant=deepseek_v41",
                                           "model.enable_hyper_connections=true"))
    model = build_gpt_model(config, 4096, 32)
    outputs = []
    for layer in (m for m in model.modules() if isinstance(m, EngramTransformerLayer)):
        layer.engram.register_forward_hook(lambda m, args, kwargs, out: outputs.append(out),
                                           with_kwargs=True)
    ids = torch.randint(0, 4096, (2, 32), generator=torch.Generator().manual_seed(1))
    position = torch.arange(32).expand(2, 32)
    mask = torch.ones(2, 32, dtype=torch.bool)
    mask[1, 24:] = False
    with torch.no_grad():
        model(ids, position, None)
        plain, outputs[:] = list(outputs), []
        model(ids, position, None, engram_token_mask=mask)
    live = mask.t()  # the branch runs sequence first
    for masked, unmasked in zip(outputs, plain):
        assert masked[~live].abs().max() == 0
        torch.testing.assert_close(masked[live], unmasked[live], rtol=0, atol=1e-6)
    assert plain[0][~live].abs().max() > 0


# -- the trainer ------------------------------------------------------------------------------


def run_trainer(nproc: int, *overrides: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={free_port()}", "-m", "engram_train.train", *TRAINER, *overrides]
    proc = run_process(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def losses(exp_dir: Path) -> dict[int, float]:
    lines = (exp_dir / "metrics.jsonl").read_text().splitlines()
    return {r["iteration"]: r["lm_loss"] for r in map(json.loads, filter(None, lines))}


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    """One process, 6 iterations, a checkpoint at 3; the same from iteration 3 (resumed); the
    same 6 iterations on 2 processes with the tables split over both (eps 2)."""
    root = tmp_path_factory.mktemp("v41_trainer")
    run_trainer(1, f"experiment.exp_dir={root / 'one'}", f"checkpoint.save={root / 'ckpt'}",
                "checkpoint.save_interval=3")
    partial = root / "ckpt3"
    partial.mkdir()
    shutil.copytree(root / "ckpt" / "iter_0000003", partial / "iter_0000003")
    (partial / "latest_checkpointed_iteration.txt").write_text("3")
    run_trainer(1, f"experiment.exp_dir={root / 'resumed'}", f"checkpoint.load={partial}")
    run_trainer(2, f"experiment.exp_dir={root / 'eps2'}", "model.engram_embedding_parallel_size=2")
    return root


def test_trainer_runs_the_variant_on_mhc_with_a_falling_loss(trainer_runs):
    one = losses(trainer_runs / "one")
    assert sorted(one) == [1, 2, 3, 4, 5, 6]
    assert one[6] < one[1] - 0.05, one
    config = (trainer_runs / "one" / "config.yaml").read_text()
    assert "engram_variant: deepseek_v41" in config and "enable_hyper_connections: true" in config


def test_trainer_resume_is_exact(trainer_runs):
    one, resumed = losses(trainer_runs / "one"), losses(trainer_runs / "resumed")
    assert sorted(resumed) == [4, 5, 6]
    assert all(resumed[i] == one[i] for i in resumed), (one, resumed)


def test_one_process_and_embedding_parallel_two_give_the_same_losses(trainer_runs):
    one, eps2 = losses(trainer_runs / "one"), losses(trainer_runs / "eps2")
    assert sorted(eps2) == sorted(one)
    assert max(abs(one[i] - eps2[i]) for i in one) <= 1e-5, (one, eps2)


def test_resume_with_another_variant_is_refused_in_one_line(trainer_runs):
    from engram_train.training.plan import check
    from engram_train.training.run_identity import ResumeMismatchError

    cfg = _cfg(*[o.replace("deepseek_v41", "paper") for o in TRAINER],
               f"experiment.exp_dir={trainer_runs / 'other'}", f"checkpoint.load={trainer_runs / 'ckpt'}")
    with pytest.raises(ResumeMismatchError) as info:
        check(cfg)
    problems = str(info.value).splitlines()[1:]
    assert len(problems) == 1 and problems[0].startswith(
        "  - model.engram_variant: deepseek_v41 in the checkpoint, paper here."), problems
    assert info.value.overrides == ("checkpoint.load_engram=false",)


def test_a_checkpoint_without_a_recorded_variant_is_the_paper_variants():
    from engram_train.training.run_identity import check_run_identity

    from engram_train.training.run_identity import ResumeMismatchError

    model = {"enable_hyper_connections": False, "num_residual_streams": None}
    old = {"model": model, "use_engram": True, "engram": {"engram_seed": 0}}
    current = dict(old, engram={"engram_variant": "paper", "engram_seed": 0})
    check_run_identity(old, current, load_engram=True, where="old")  # no error
    current["engram"]["engram_variant"] = "deepseek_v41"
    with pytest.raises(ResumeMismatchError, match="model.engram_variant: paper in the checkpoint"):
        check_run_identity(old, current, load_engram=True, where="old")


def test_export_refuses_the_variant_in_one_line(trainer_runs):
    from engram_train.export.export_errors import ExportError
    from engram_train.export.exporter import plan_export

    with pytest.raises(ExportError, match=r"model.engram_variant='deepseek_v41': the export") as info:
        plan_export(trainer_runs / "ckpt", config=trainer_runs / "one" / "config.yaml", verify=False)
    assert "\n" not in str(info.value)


# -- table layouts and options, 2 processes ---------------------------------------------------


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    return torchrun("v41_layouts.py", 2, tmp_path_factory.mktemp("v41_layouts"))[0]


def test_embedding_parallel_two_equals_replicated_tables(layouts):
    ref, eps2 = layouts["eps1"], layouts["eps2"]
    assert ref["branches"] == ["DeepseekV41EngramBranch"]
    assert max(abs(a - b) for a, b in zip(ref["losses"], eps2["losses"])) <= 1e-5
    assert layouts["eps1~eps2"] <= 1e-4  # 3 Adam steps of the tables, clip factors 1e-6 apart


@pytest.mark.parametrize("device, host", [("eps2", "eps2_host"), ("eps2_rowwise", "eps2_rowwise_host"),
                                          ("eps2_4byte", "eps2_4byte_host")])
def test_host_placement_trains_as_the_device(layouts, device, host):
    assert layouts[host]["host_resident"] == [True, True] and layouts[host]["host_rows"] > 0
    assert not any(layouts[device]["host_resident"])
    assert layouts[host]["losses"] == layouts[device]["losses"]
    assert layouts[f"{device}~{host}"] == 0


def test_table_options_train(layouts):
    for name in ("eps2", "eps2_rowwise", "eps2_4byte"):
        loss = layouts[name]["losses"]
        assert all(np.isfinite(loss)) and loss[-1] < loss[0], (name, loss)


def test_prefetch_is_exact(layouts):
    assert layouts["eps2_no_prefetch"]["losses"] == layouts["eps2"]["losses"]
    assert layouts["eps2~eps2_no_prefetch"] == 0


def test_tensor_parallel_two_with_sequence_parallelism_and_allreduce_tables(layouts):
    """TP2 + SP (the branch's wkv and gate weights take megatron's TP gradient sum) with the
    tables vocab-parallel over TP: the replicated run's losses and grad norms; the tables agree
    to Adam's amplification of reduction-order noise in tiny gradient entries."""
    ref, tp2 = layouts["eps1"], layouts["tp2_allreduce"]
    assert max(abs(a - b) for a, b in zip(ref["losses"], tp2["losses"])) <= 1e-5
    assert tp2["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-5)
    assert layouts["eps1~tp2_allreduce"] <= 2e-3

"""The mHC backbone in megatron (tests/dist/hyper_connections.py, one 4-process launch): the
spec's invariance, layouts, reshard, the golden Engram layer on 4 streams, refusals; and the
run identity that refuses a resume across backbones."""

import pytest

from launch import torchrun, run_process

# Every layout follows the one-rank run (DP4) over 6 steps at a learning rate where the tiny
# model is stable: TP2 with sequence parallelism sums in another order (split GEMMs, gloo
# reductions), within 1e-5; without the mapping recompute the numbers are the same to 1e-6.
TOLERANCE = {"dp4_no_mhc_recompute": 1e-6}
TP_LAYOUTS = ["tp2pp2sp_eps2", "allreduce_tp2sp"]
LAYOUTS = ["pp2vpp2", "pp2_full_recompute", "dp4_selective_recompute", "ep2_eps4_host_distopt",
           "dp4_no_mhc_recompute", *TP_LAYOUTS]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return torchrun("hyper_connections.py", 4, tmp_path_factory.mktemp("hyper_connections"),
                    timeout=1800)


def last_stage(results, key):
    reported = [r[key] for r in results if r[key] is not None]
    assert reported, f"no rank reported {key}"
    return reported


def test_gating_factor_zero_computes_the_single_stream_model(results):
    """The spec's invariance: identical streams, constant mappings -> the plain residual. Only
    eps_hc (1e-6 per collapse) separates the two models."""
    for r in results:
        single, multi = r["invariance_loss"]
        assert multi == pytest.approx(single, rel=1e-4)
        assert r["invariance_unexpected"] == []
        assert len(r["invariance_missing"]) == 4 * 2 * 3 + 3  # attn_hc, ffn_hc per layer; head
        assert max(r["invariance_grad_rel"].values()) < 1e-4, r["invariance_grad_rel"]
        assert r["invariance_mapping_grads_nonzero"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_trains_like_one_rank(results, layout):
    reference = results[0]["dp4"]["losses"]
    assert all(loss is not None for loss in reference)
    rel = TOLERANCE.get(layout, 1e-5)
    for r in results:
        losses = r[layout]["losses"]
        if losses[0] is None:  # not a last pipeline stage
            continue
        assert losses == pytest.approx(reference, rel=rel), layout
    first_norm = results[0]["dp4"]["grad_norms"][0]  # later ones move with routing near-ties
    norm_rel = rel
    for r in results:
        assert r[layout]["grad_norms"][0] == pytest.approx(first_norm, rel=norm_rel)


@pytest.mark.parametrize("layout", TP_LAYOUTS)
def test_tp_replicated_parameters_stay_bitwise_equal(results, layout):
    """After 3 steps under sequence parallelism every parameter TP does not split (the mHC
    mappings, Engram's dense parameters, the norms, the router) is the same on every TP rank,
    to the bit: their gradients are summed over TP (``sequence_parallel``), not left partial."""
    everywhere = []
    for r in results:
        replicated = r[f"{layout}_replicated"]
        assert replicated["different"] == [], replicated["different"]
        names = replicated["checked"]
        everywhere += names
        for part in ("attn_hc.fn", "ffn_hc.base", "layernorm.weight", "router.weight",
                     "engram.value_proj.weight", "engram.key_projs.0.weight"):
            assert any(part in n for n in names), (part, names)
    assert any("hc_head.hc_fn" in n for n in everywhere)  # the last stage's


def test_bf16_mappings_are_float32(results):
    """bf16: the mapping parameters, their gradients, megatron's distributed optimizer and the
    checkpoint keep them float32 (the rest of the backbone is bf16); a checkpoint written with
    bf16 mappings loads into them, upcast."""
    for r in results:
        assert r["bf16_mapping_dtypes"] == ["torch.float32"]
        assert r["bf16_other_dtypes"] == ["torch.bfloat16"]
        assert r["bf16_mapping_grad_dtypes"] == ["torch.float32"]
        assert r["bf16_mappings_fp32_in_optimizer"]
        assert not r["bf16_others_fp32_in_optimizer"]
        assert r["bf16_stored_mapping_dtypes"] == ["torch.float32"]
        assert r["bf16_stored_mapping_count"] >= 4 * 2 * 3 + 3
        assert r["old_bf16_mappings_load"]
        # megatron numbers group members in grad-buffer order: float32 mappings beside bf16
        # parameters in one group mapped to other parameters' shards before the fix
        assert r["bf16_optimizer_state_maps_to_own_shard"]


def test_losses_move(results):
    losses = results[0]["dp4"]["losses"]
    assert len(set(losses)) == len(losses)


def test_reshard_tp2pp2_to_one_rank_continues_the_same_losses(results):
    """TP2 x PP2 x eps 2 saves model + optimizer after 3 steps; TP1 x PP1 loads them and its
    next 3 losses are the TP2 x PP2 run's (to the TP-vs-one-rank summation order, which the
    first of them does not yet show)."""
    source = last_stage([r["tp2pp2sp_eps2"] for r in results], "losses")
    source = [losses for losses in source if losses[0] is not None][0]
    for r in results:
        assert r["reshard_iteration"] == 3
        assert r["reshard_losses"][0] == pytest.approx(source[3], rel=1e-6)
        assert r["reshard_losses"] == pytest.approx(source[3:], rel=1e-4)


def test_bf16_follows_fp32(results):
    fp32 = results[0]["dp4"]["losses"]
    for r in results:
        assert r["bf16_losses"] == pytest.approx(fp32, rel=1e-2)
        assert r["bf16_losses"] != fp32


@pytest.mark.parametrize("case", ["mhc_into_plain", "plain_into_mhc"])
def test_checkpoint_refuses_the_other_backbone(results, case):
    for r in results:
        assert r[case] != "loaded"
        assert "attn_hc" in r[case] or "hc_head" in r[case], r[case][:500]


def test_engram_layer_on_four_streams_matches_the_reference(results):
    for r in results:
        assert r["golden_output_max_diff"] <= 1e-5 * max(1.0, r["golden_output_scale"])
        assert r["golden_grad_rel"] <= 1e-5


def _model_identity(**model):
    from hydra import compose, initialize_config_dir
    from engram_train.config import register

    from engram_train.models.presets import CONF_DIR
    from engram_train.training.run_config import build_transformer_config
    from engram_train.training.run_identity import model_identity

    register()  # the run config's schema (conf/train.yaml's defaults)
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose(config_name="train",
                      overrides=[f"model.{k}={v}" for k, v in model.items()])
    return {"model": model_identity(build_transformer_config(cfg), 4096), "use_engram": True,
            "engram": None}


def test_run_identity_refuses_a_resume_across_backbones():
    from engram_train.training.run_identity import ResumeMismatchError, check_run_identity

    plain, mhc = _model_identity(), _model_identity(enable_hyper_connections="true")
    three = _model_identity(enable_hyper_connections="true", num_residual_streams=3)
    for saved, current, words in (
        (mhc, plain, "has n residual streams and their mapping parameters, this run's has not"),
        (plain, mhc, "has one residual stream, this run's has"),
        (mhc, three, "model.num_residual_streams: 4 in the checkpoint, 3 here"),
    ):
        saved, current = dict(saved, engram=None), dict(current, engram=None)
        with pytest.raises(ResumeMismatchError, match="enable_hyper_connections|num_residual"
                           ) as info:
            check_run_identity(saved, current, load_engram=False, where="ckpt")
        assert words in str(info.value)
    # A checkpoint written before the mHC fields existed is a single-stream one.
    old = dict(plain, model={k: v for k, v in plain["model"].items()
                             if k not in ("enable_hyper_connections", "num_residual_streams")})
    check_run_identity(old, plain, load_engram=False, where="ckpt")
    with pytest.raises(ResumeMismatchError, match="enable_hyper_connections"):
        check_run_identity(old, mhc, load_engram=False, where="ckpt")


def test_export_round_trip_with_four_streams(tmp_path):
    """Train the mHC demo preset 2 iterations, export it: the backbone carries the mapping
    parameters under megatron's keys, the Engram layers have hc_mult = 4, and EngramMemory
    serves them as the reference module (transcribed in test_export) loaded with the export."""
    import json
    import os
    import sys

    import torch
    from launch import REPO, free_port
    from safetensors.torch import load_file
    from test_export import DATA, TOKENIZER, RefEngram, ref_hash, ref_multipliers, ref_primes

    from engram_train.export import export_checkpoint
    from engram_train.inference import EngramMemory, megatron_state_dict

    exp = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           f"--master-port={free_port()}", "-m", "engram_train.train",
           "model=deepseek_v3_tiny_mhc", "train.train_iters=2", "train.seq_length=64",
           "train.eval_interval=null", "train.lr_warmup_iters=0", f"experiment.exp_dir={exp}",
           f"checkpoint.save={exp / 'checkpoints'}", f"data.path={DATA}",
           f"data.tokenizer={TOKENIZER}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = run_process(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    out = tmp_path / "export"
    export_checkpoint(exp / "checkpoints", out, log=lambda _: None)

    doc = json.loads((out / "engram_config.json").read_text())
    assert doc["engram"]["hc_mult"] == 4
    backbone = megatron_state_dict(out)
    for layer in range(4):
        for sub in ("attn_hc", "ffn_hc"):
            assert backbone[f"decoder.layers.{layer}.{sub}.fn"].shape == (24, 256)  # (2+n)n, nh
            assert backbone[f"decoder.layers.{layer}.{sub}.base"].shape == (24,)
            assert backbone[f"decoder.layers.{layer}.{sub}.scale"].shape == (3,)
    assert backbone["decoder.hc_head.hc_fn"].shape == (4, 256)
    assert backbone["decoder.layers.0.attn_hc.scale"].tolist() != [0.01] * 3  # trained

    memory = EngramMemory(out)
    lookup = load_file(str(out / "engram_hash.safetensors"))["compressed_lookup"].numpy()
    multipliers = ref_multipliers([1, 3], 3, int(lookup.max()) + 1, seed=0)
    primes = ref_primes([20011, 20011], 3, 4, [1, 3])
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 4096, (2, 12), generator=g)
    hidden = torch.randn(2, 12, 4, 64, generator=g)
    for layer in (1, 3):
        ref = RefEngram(64, 4, [p for o in primes[layer] for p in o], 16, 3, 4)
        ref.load_state_dict(load_file(str(out / f"engram_layer{layer}.safetensors")))  # strict
        hash_ids = ref_hash(ids.numpy(), lookup, int(lookup[0]), multipliers[layer],
                            primes[layer])
        with torch.no_grad():
            want = ref(hidden, torch.from_numpy(hash_ids))
        state = memory.new_state(2)
        got = memory.forward(layer, hidden, memory.prefetch(state, ids)[layer], state)
        assert got.shape == (2, 12, 4, 64)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)

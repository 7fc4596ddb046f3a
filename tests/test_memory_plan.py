"""engram-plan: the plan's parts against analytic values, the CLI, and the calibration: the
trainer's measured peak RSS per rank on 7 configurations within 20% of the plan."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from launch import REPO, run_process
from memory_calibration_cases import CASES, RUN, torchrun_calibration

TOLERANCE = 0.20
GIB = 1 << 30


def plan_cli(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = run_process([sys.executable, "-m", "engram_train.memory_plan", *argv], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def plan_of(overrides, world=1, **kw):
    from engram_train.memory_plan.plan_cli import make_plan
    from engram_train.training.param_count import compose_config

    return make_plan(compose_config(list(overrides)), world, world, **kw)


def item(rank, name):
    return sum(b for n, _, _, b in rank.items if n == name)


# -- parts against analytic values ------------------------------------------------------------


def test_stage_params_add_up_to_the_model(one_rank):
    """Every parameter lands on exactly one stage; TP/EP/table shards divide what they split."""
    from engram_train.memory_plan.plan_layout import layout_of
    from engram_train.memory_plan.model_bytes import stage_params
    from engram_train.training.param_count import build_on_meta, compose_config, run_config_counts
    from engram_train.training.run_config import build_transformer_config

    total = run_config_counts(compose_config([]), None)["total"]
    cfg = compose_config(["system.pipeline_model_parallel_size=2", "train.global_batch_size=8"])
    config = build_transformer_config(cfg)
    model = build_on_meta(config, 4096, 128)
    one = stage_params(model, config, layout_of(compose_config([]), build_transformer_config(compose_config([])), 1, 1))
    pp2 = stage_params(model, config, layout_of(cfg, config, 2, 2))
    assert sum(sum(s.params.values()) for s in one) == total
    assert sum(sum(s.params.values()) for s in pp2) == total
    assert pp2[0].params["embedding"] and not pp2[1].params.get("embedding")
    assert pp2[1].params["output_layer"] and not pp2[0].params.get("output_layer")
    # layers 1 and 3 carry Engram: one table per stage (its heads' primes differ by layer)
    assert pp2[0].params["engram_tables"] + pp2[1].params["engram_tables"] == one[0].params["engram_tables"]
    assert pp2[0].params["engram_tables"] == pytest.approx(pp2[1].params["engram_tables"], rel=0.01)
    tp2 = compose_config(["system.tensor_model_parallel_size=2", "model.engram_embedding_parallel_size=2",
                          "train.global_batch_size=2"])
    split = stage_params(model, config, layout_of(tp2, build_transformer_config(tp2), 2, 2))[0]
    assert split.params["output_layer"] * 2 == one[0].params["output_layer"]
    assert split.params["routed_experts"] * 2 == one[0].params["routed_experts"]  # expert TP
    assert split.params["router"] == one[0].params["router"]  # replicated
    assert abs(split.params["engram_tables"] * 2 - one[0].params["engram_tables"]) <= 2 * 16 * 2


def test_engram_table_bytes_by_option(one_rank):
    """Table, master and moments per element: fp32 4+0+8, bf16 2+4+8, the 4-byte configuration
    2+0+(2+4/16), offload adds a float32 master to fp32 tables; host placement puts all of it in
    host memory."""
    fp32 = plan_of([]).ranks[0]
    elements = item(fp32, "engram_tables_fp32") // 4
    assert elements > 0
    assert item(fp32, "engram_table_moments") == 8 * elements and item(fp32, "engram_table_master") == 0
    bf16 = plan_of(["model.engram_table_dtype=bf16"]).ranks[0]
    assert item(bf16, "engram_tables_bf16") == 2 * elements and item(bf16, "engram_table_master") == 4 * elements
    off = plan_of(["model.engram_offload_embedding_optimizer_states=true"], device="cuda",
                  device_memory=GIB).ranks[0]
    where = {n: m for n, m, _, _ in off.items}
    assert where["engram_tables_fp32"] == "device" and where["engram_table_moments"] == "host"
    assert item(off, "engram_table_master") == 4 * elements
    host = plan_of(["model.engram_table_placement=host"], device="cuda", device_memory=GIB).ranks[0]
    assert {m for n, m, _, _ in host.items if n.startswith("engram_table")} == {"host"}
    dense = plan_of(["model.engram_optimizer=adam"]).ranks[0]
    # a dense float32 gradient + AdamW's measured temporaries
    assert item(dense, "engram_table_step") == int(12.5 * elements)
    # the 4-byte configuration: bf16 value, no master, bf16 first moment, one float32 per row
    # of 16 (the demo's row width): 2 + 0 + 2 + 4/16 bytes per element
    four = plan_of(["model.engram_table_dtype=bf16", "model.engram_optimizer=rowwise_adam",
                    "model.engram_master_weights=false",
                    "model.engram_optimizer_state_dtype=bf16"]).ranks[0]
    per_element = sum(b for n, _, _, b in four.items
                      if n.startswith("engram_table") and n != "engram_table_step") / elements
    assert per_element == pytest.approx(2 + 2 + 4 / 16, abs=1e-6)
    assert all(n != "engram_table_master" for n, _, _, _ in four.items)
    rowwise = plan_of(["model.engram_optimizer=rowwise_adam"]).ranks[0]
    assert item(rowwise, "engram_table_moments") == int(elements * (4 + 4 / 16))


def test_optimizer_state_is_sharded_by_the_distributed_optimizer(one_rank):
    one = plan_of(["system.precision=bf16"]).ranks[0]
    dp2 = plan_of(["system.precision=bf16", "train.global_batch_size=8"], world=2).ranks[0]
    full = plan_of(["system.precision=bf16", "system.use_distributed_optimizer=false",
                    "train.global_batch_size=8"], world=2).ranks[0]
    weights = item(one, "weights_bf16") // 2
    assert item(one, "adam_moments") == 8 * weights and item(one, "fp32_main_params") == 4 * weights
    assert item(full, "adam_moments") == item(one, "adam_moments")
    assert abs(item(dp2, "adam_moments") * 2 - item(one, "adam_moments")) <= 16
    assert item(one, "grad_buffer_fp32") == 4 * weights


def test_recompute_and_pipeline_in_flight(one_rank):
    """Full recompute keeps one hidden state per layer; 1F1B's first stage holds PP micro-batches."""
    plain = plan_of([]).ranks[0]
    full = plan_of(["system.recompute_granularity=full"]).ranks[0]
    assert item(full, "layer_inputs (full recompute)") == 4 * 2 * 128 * 64 * 4  # layers x b x s x h x fp32
    assert item(full, "attention") == 0 and item(plain, "attention") > 0
    pp = plan_of(["system.pipeline_model_parallel_size=2", "train.global_batch_size=8"], world=2)
    first, last = pp.ranks
    from engram_train.memory_plan.activations import in_flight_chunks

    assert in_flight_chunks(0, pp.layout)[0] == 2 and in_flight_chunks(1, pp.layout)[0] == 1
    assert item(first, "logits_and_loss") == 0 and item(last, "logits_and_loss") > 0


def test_fits_keeps_the_measured_margin(one_rank):
    """yes only with the margin; tight between the prediction and the prediction plus margin."""
    from engram_train.memory_plan.plan_report import FIT_MARGIN

    plan = plan_of([])
    need = plan.host_bytes_per_node
    for memory, verdict in ((need - 1, "no"), (need, "tight"),
                            (int(need * (1 + FIT_MARGIN)) + 1, "yes")):
        plan.host_memory = memory
        assert plan.verdict == verdict and plan.fits == (verdict == "yes")
    assert "fits: yes" in plan.to_text() and plan.to_json()["fits_verdict"] == "yes"
    plan.host_memory = need
    assert "fits: tight" in plan.to_text() and plan.to_json()["fits"] is False


def test_cpu_attention_scores_are_float32(one_rank):
    """The SDPA math path keeps float32 scores in bf16 too, plus one layer's transients."""
    from engram_train.memory_plan.activations import SCORE_TRANSIENTS

    fp32, bf16 = (plan_of([f"system.precision={p}"]).ranks[0] for p in ("fp32", "bf16"))
    per_layer = 2 * 4 * 128 * 128 * 4  # b x heads x s x s float32
    for r in (fp32, bf16):
        assert item(r, "attention_scores (unfused)") == 4 * per_layer
        assert item(r, "attention_score_transients") == int(SCORE_TRANSIENTS * per_layer)


def test_cpu_backend_items(one_rank):
    """The CPU backend's own bytes: oneDNN's kernel caches only for bf16 with MoE layers,
    1 - exp(-n / 200) of their asymptote after the run's n expert batches; none on the GPU."""
    import math

    from engram_train.memory_plan.fixed import CPU_BF16_MOE_KERNEL_CACHE_BYTES, CPU_KERNEL_CACHE_FILL_EXPERT_BATCHES

    assert CPU_KERNEL_CACHE_FILL_EXPERT_BATCHES == 200
    fp32, bf16, bf16_dense, short, gpu = (plan_of(o, device=d).ranks[0] for o, d in (
        ([], "cpu"), (["system.precision=bf16", "train.train_iters=1000"], "cpu"),
        (["system.precision=bf16", *DENSE], "cpu"),
        (["system.precision=bf16", "train.train_iters=2"], "cpu"),
        (["system.precision=bf16"], "cuda")))
    assert item(fp32, "cpu_bf16_moe_kernel_cache") == 0 == item(bf16_dense, "cpu_bf16_moe_kernel_cache")
    # steps x 4 micro-batches x 4 experts x 3 MoE layers; 2 x 128 tokens per micro-batch draw
    # fewer distinct expert token counts than 512 or more: (256 / 512) ** 0.25 of the asymptote
    long_tokens = plan_of(["system.precision=bf16", "train.train_iters=1000", "train.seq_length=256"]).ranks[0]
    for run, steps, tokens in ((bf16, 1000, 256), (short, 2, 256), (long_tokens, 1000, 512)):
        share = (1 - math.exp(-steps * 4 * 4 * 3 / 200)) * min(1.0, tokens / 512) ** 0.25
        assert item(run, "cpu_bf16_moe_kernel_cache") == pytest.approx(CPU_BF16_MOE_KERNEL_CACHE_BYTES * share, abs=1)
    assert item(short, "cpu_bf16_moe_kernel_cache") < 0.4 * CPU_BF16_MOE_KERNEL_CACHE_BYTES
    assert not any(n.startswith("cpu_") for n, _, _, _ in gpu.items)


DENSE = ["model.num_moe_experts=null", "model.moe_ffn_hidden_size=null",
         "model.moe_shared_expert_intermediate_size=null"]


def step_items(rank):
    return {n: b for n, _, phase, b in rank.items if phase == "step"}


def test_cpu_heap_holes_follow_the_heap_placed_activations(one_rank):
    """glibc's heap holes: 0.4 of the step's activation bytes, less the items whose single
    tensors are mmapped (32 MiB or more): the CPU attention's float32 scores [b, heads, s, s]
    reach 2 x 4 x 1024 x 1024 x 4 = 32 MiB at sequence 1024, the float32 logits (vocabulary
    4096 padded) at 2048 tokens x 4096 x 4 = 32 MiB; reached over the first passes, 1 -
    exp(-n / 4) after n forward-backward passes. None on the GPU."""
    import math

    from engram_train.memory_plan.cpu_heap import CPU_HEAP_FILL_PASSES, CPU_HEAP_HOLE_FRACTION

    assert (CPU_HEAP_HOLE_FRACTION, CPU_HEAP_FILL_PASSES) == (0.4, 4)
    one_step = plan_of(["train.seq_length=512", "train.train_iters=1"]).ranks[0]
    steps = step_items(one_step)  # 4 micro-batches
    assert item(one_step, "cpu_heap_holes") == int(0.4 * (1 - math.exp(-1)) * sum(steps.values()))

    short, long, gpu = (plan_of(o, device=d).ranks[0] for o, d in (
        (["train.seq_length=512"], "cpu"), (["train.seq_length=1024"], "cpu"),
        (["train.seq_length=512"], "cuda")))
    steps = step_items(short)
    assert steps["attention_scores (unfused)"] == 4 * 2 * 4 * 512 * 512 * 4  # 4 layers
    assert item(short, "cpu_heap_holes") == int(0.4 * sum(steps.values()))
    steps = step_items(long)
    mmapped = ("attention_scores (unfused)", "attention_score_transients", "logits_and_loss")
    assert steps["logits_and_loss"] == 2048 * 4096 * 12
    assert item(long, "cpu_heap_holes") == int(0.4 * sum(b for n, b in steps.items() if n not in mmapped))
    assert item(gpu, "cpu_heap_holes") == 0


def test_parse_bytes():
    from engram_train.memory_plan.plan_cli import PlanError, parse_bytes

    assert parse_bytes("141GiB", "--device-memory") == 141 * GIB
    assert parse_bytes("2TiB", "--host-memory") == 2 << 40
    assert parse_bytes("80GB", "--device-memory") == 80 * 10**9
    with pytest.raises(PlanError, match="--device-memory"):
        parse_bytes("lots", "--device-memory")


# -- the command ---------------------------------------------------------------------------------


def test_engram_27b_on_64_h200_from_the_meta_device():
    proc = plan_cli("model=engram_27b", "system.precision=bf16", "system.tensor_model_parallel_size=2",
                    "system.pipeline_model_parallel_size=2", "train.micro_batch_size=1",
                    "train.global_batch_size=1024", "train.seq_length=4096", "--vocab-size", "129280",
                    "--nproc-per-node", "8", "--nnodes", "8", "--device-memory", "141GiB",
                    "--host-memory", "2TiB", "--json")
    plan = json.loads(proc.stdout)
    assert {"device_bytes_per_rank", "host_bytes_per_rank", "host_bytes_per_node", "fits",
            "breakdown"} <= set(plan)
    assert isinstance(plan["fits"], bool) and set(plan["breakdown"]) == {"stage0", "stage1"}
    assert plan["layout"]["world"] == 64 and plan["layout"]["dp"] == 16
    s0, s1 = plan["breakdown"]["stage0"]["items"], plan["breakdown"]["stage1"]["items"]
    assert "embedding_output" in s0 and "logits_and_loss" in s1 and "logits_and_loss" not in s0
    # 5.8B table parameters over 8 shards, fp32: 2 layers of 2.9B on 2 stages -> 362M per rank
    assert s0["engram_tables_fp32"]["bytes"] == pytest.approx(4 * 5_792_771_520 / 2 / 8, rel=1e-3)
    assert plan["device_bytes_per_rank"] == max(plan["breakdown"][s]["device_bytes"] for s in ("stage0", "stage1"))


def test_a_plan_that_does_not_fit_names_its_largest_items_and_fields():
    proc = plan_cli("model=engram_27b", "system.precision=bf16", "train.global_batch_size=8",
                    "train.micro_batch_size=1",
                    "model.engram_embedding_parallel_size=8", "--vocab-size", "129280",
                    "--nproc-per-node", "8", "--device-memory", "141GiB", "--host-memory", "2TiB")
    assert "fits: NO" in proc.stdout
    assert "model.engram_embedding_parallel_size" in proc.stdout or "system.expert_model_parallel_size" in proc.stdout
    as_json = json.loads(plan_cli("model=engram_27b", "system.precision=bf16", "train.global_batch_size=8",
                                  "train.micro_batch_size=1",
                                  "model.engram_embedding_parallel_size=8", "--vocab-size", "129280",
                                  "--nproc-per-node", "8", "--device-memory", "141GiB", "--json").stdout)
    assert as_json["fits"] is False and as_json["largest"][0]["change"]
    assert as_json["largest"][0]["bytes"] == max(x["bytes"] for x in as_json["largest"])


def test_bad_arguments_exit_1_with_the_field():
    proc = plan_cli("--device-memory", "lots", check=False)
    assert proc.returncode == 1 and "--device-memory='lots'" in proc.stderr and "Traceback" not in proc.stderr
    proc = plan_cli("system.tensor_model_parallel_size=3", "--nproc-per-node", "4", check=False)
    assert proc.returncode == 1 and "tensor" in proc.stderr and "Traceback" not in proc.stderr
    proc = plan_cli("--vocab-size", "0", check=False)
    assert proc.returncode == 1 and "--vocab-size=0 must be >= 1" in proc.stderr and "Traceback" not in proc.stderr


# -- calibration: predicted vs measured peak RSS per rank ----------------------------------------


@pytest.fixture(scope="module")
def calibration(tmp_path_factory):
    """The fixed baseline (measured on 2 ranks) and every case's measured peak RSS per rank."""
    root = tmp_path_factory.mktemp("memory")
    baseline = max(r["peak_rss"] for r in torchrun_calibration(2, root / "baseline", list(RUN), baseline=True))
    measured = {c.name: torchrun_calibration(c.nproc, root / c.name, c.all_overrides()) for c in CASES}
    return baseline, measured


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_predicted_peak_rss_within_20_percent(calibration, case, one_rank):
    baseline, measured = calibration
    plan = plan_of(case.all_overrides(), world=case.nproc, cpu_baseline=baseline)
    for rank in measured[case.name]:
        stage = plan.ranks[rank["pipeline_rank"]]
        predicted = stage.peak("device") + stage.peak("host")
        ratio = predicted / rank["peak_rss"]
        print(f"{case.name} stage {stage.stage}: predicted "
              f"{predicted / 2**20:.0f} MiB, measured {rank['peak_rss'] / 2**20:.0f} MiB, "
              f"ratio {ratio:.2f}")  # the figures of docs/memory.md (pytest -rP)
        assert abs(ratio - 1) <= TOLERANCE, (
            f"{case.name} stage {stage.stage}: predicted {predicted / 2**20:.0f} MiB, measured "
            f"{rank['peak_rss'] / 2**20:.0f} MiB (baseline {baseline / 2**20:.0f} MiB)")

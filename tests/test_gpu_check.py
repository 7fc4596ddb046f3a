"""benchmarks/gpu_check.py on CPU: the plan (--dry-run), every section that can run without CUDA
(gloo, 2 processes, small sizes), the spec comparison against itself (exact), the time limit."""

from __future__ import annotations

import json
import os
import sys

import pytest

from launch import REPO, free_port, run_process

SCRIPT = REPO / "benchmarks" / "gpu_check.py"
SECTIONS = ["environment", "te_spec", "nccl_embedding", "bf16_training", "prefetch", "offload",
            "context_parallel", "mhc", "throughput", "v41_long"]


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def test_dry_run_plan_fits_nine_minutes():
    proc = run_process([sys.executable, str(SCRIPT), "--dry-run"], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads(proc.stdout)
    assert [s["section"] for s in plan["sections"]] == SECTIONS
    assert plan["gpu_budget_s"] <= 9 * 60
    skipped = {s["section"]: s["skip_reason"] for s in plan["sections"] if not s["runs"]}
    assert skipped["te_spec"] == "needs CUDA" and "CUDA" in skipped["offload"]


def test_unknown_section_is_an_error():
    proc = run_process([sys.executable, str(SCRIPT), "--dry-run", "--only", "tee_spec"],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "unknown sections ['tee_spec']" in proc.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a machine without CUDA")
def test_without_cuda_it_checks_nothing_and_says_so(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = run_process([sys.executable, str(SCRIPT), "--out", str(out)], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "gpu_check: skipped: no CUDA device" in proc.stderr
    report = json.loads(out.read_text())
    assert report["ok"] is False and report["skipped"] == "no CUDA device"
    assert {s["status"] for s in report["sections"].values()} == {"skipped"}


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check") / "gpu_check.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           f"--master-port={free_port()}", str(SCRIPT), "--allow-cpu", "--quick", "--out", str(out)]
    proc = run_process(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_cpu_sections_pass(cpu_run):
    status = {name: s["status"] for name, s in cpu_run["sections"].items()}
    assert status == {"environment": "ok", "te_spec": "skipped", "context_parallel": "skipped",
                      "nccl_embedding": "ok",
                      "bf16_training": "ok", "prefetch": "ok", "offload": "ok",
                      "mhc": "ok", "throughput": "ok", "v41_long": "ok"}, cpu_run
    assert cpu_run["ok"] is True


def test_cpu_section_results(cpu_run):
    s = cpu_run["sections"]
    v41 = s["v41_long"]  # the sparse core vs the dense oracle; CP 2 over gloo vs one process
    assert v41["core_float32_max_rel_error"] <= 1e-5
    assert v41["cp"]["loss"] == pytest.approx(v41["cp"]["reference"], abs=1e-5)
    assert v41["cp"]["worst_gradient"] <= 1e-4 and v41["flash_layer"]["seq"] == 1024
    for method in ("alltoall", "allreduce"):  # sharded over 2 gloo ranks vs a full table
        assert s["nccl_embedding"][method]["output_max_diff"] <= 1e-6
        assert s["nccl_embedding"][method]["grad_max_diff"] <= 1e-6
    assert s["nccl_embedding"]["backend"] == "gloo"
    bf16 = s["bf16_training"]
    assert bf16["bf16"]["stream"]["layer_out"] == ["torch.bfloat16"]
    assert bf16["bf16_tables"]["final_rel_diff_vs_fp32"] < 0.03
    assert s["prefetch"]["bitwise"] is True  # CPU: deterministic, so exactly equal
    offload = s["offload"]["sparse_adam"]  # host states vs none: the same numbers on CPU
    assert offload["losses_on"] == offload["losses_off"] and offload["table_max_diff"] == 0.0
    assert offload["host_state_mib"] > 0
    t = s["throughput"]
    assert t["engram"]["tokens_per_s"] > 0 and t["no_engram"]["tokens_per_s"] > 0


def test_spec_comparison_of_a_spec_with_itself_is_exact():
    """The TE-vs-local comparison (name mapping, weight copy, bf16 wrapping, gradients), run
    local-vs-local: everything must agree bit for bit."""
    proc = run_process([sys.executable, "tests/dist/spec_self_comparison.py"], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.split("RESULT", 1)[1])
    for precision in ("fp32", "bf16"):
        r = result[precision]
        assert r["loss_rel_diff"] == 0.0 and r["grad_global_rel_err"] == 0.0, r
        assert r["params"] > 50 and r["te_modules"] == []
    assert result["bf16"]["loss_local"] != result["fp32"]["loss_local"]  # bf16 really ran


def test_te_name_mapping():
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_check

    assert gpu_check.local_name("decoder.layers.0.mlp.linear_fc1.layer_norm_weight") == \
        "decoder.layers.0.pre_mlp_layernorm.weight"
    assert gpu_check.local_name("decoder.layers.2.self_attention.linear_q_up_proj.layer_norm_weight") \
        == "decoder.layers.2.self_attention.q_layernorm.weight"
    assert gpu_check.local_name("decoder.layers.1.mlp.shared_experts.linear_fc1.weight") == \
        "decoder.layers.1.mlp.shared_experts.linear_fc1.weight"


def test_time_limit_keeps_the_partial_report(tmp_path):
    out = tmp_path / "partial.json"
    proc = run_process([sys.executable, str(SCRIPT), "--allow-cpu", "--quick", "--only",
                           "environment,bf16_training", "--time-limit", "1", "--out", str(out)],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["ok"] is False and report["timed_out_in"] in ("environment", "bf16_training")

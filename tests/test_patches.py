"""The patch registry: version rules, the active list, and that each range matches upstream."""

import ast
import re
import sys
from pathlib import Path

import pytest
from launch import REPO, run_process

from engram_train.runtime import patches
from engram_train.runtime.patches import (
    ALLOW_UNTESTED_ENV,
    DISABLE_ENV,
    TESTED_MEGATRON_CORE,
    Patch,
    UntestedMegatronCoreError,
    apply_patches,
    check_megatron_core_version,
    megatron_core_version,
    patch_report,
    revert_patches,
)

# What each tested release needs, from the probes and the tests named in each patch's `verify`.
# (The CPU patches are exercised in subprocesses below: they would change this process's torch.)
EXPECTED_FIXES = {
    "0.16.1": [
        "moe_te_general_gemm_unbound",
        "mla_have_te_flag",
        "distopt_torch_adam_step_on_load",
        "distopt_load_into_fresh_torch_adam",
        "distopt_shared_torch_adam_step",
        "distopt_mixed_dtype_group_order",
        "blended_dataset_without_process_group",
        "mhc_pipeline_shapes",
        "chained_optimizer_by_role",
        "embedded_common_state",
    ],
    "0.19.2": [
        "distopt_torch_adam_step_on_load",
        "distopt_load_into_fresh_torch_adam",
        "distopt_shared_torch_adam_step",
        "distopt_mixed_dtype_group_order",
        "mhc_pipeline_shapes",
        "chained_optimizer_by_role",
    ],
}
NON_CPU = [p.name for p in patches.PATCHES if p.name not in patches.CPU_PATCHES]


@pytest.fixture
def clean_registry(monkeypatch):
    """Run with none of the non-CPU patches active; restore what was active afterwards."""
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    before = [n for n in patches.active_patches() if n in NON_CPU]
    revert_patches(NON_CPU)
    yield
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    revert_patches(NON_CPU)
    apply_patches(before)


def test_installed_release_is_a_tested_lane():
    assert set(EXPECTED_FIXES) == set(TESTED_MEGATRON_CORE)
    assert megatron_core_version() in TESTED_MEGATRON_CORE


def test_makefile_lanes_pin_the_tested_releases():
    makefile = Path(__file__).resolve().parents[1] / "Makefile"
    pins = re.findall(r"^MEGATRON_CORE := (\S+)$", makefile.read_text(), re.M)
    assert tuple(pins) == TESTED_MEGATRON_CORE


def test_active_fixes_on_this_release_are_the_expected_ones(clean_registry):
    version = megatron_core_version()
    active = apply_patches(NON_CPU)
    assert active == EXPECTED_FIXES[version]
    assert [n for n in patches.active_patches() if n in NON_CPU] == EXPECTED_FIXES[version]
    report = dict(patch_report())
    for name in NON_CPU:
        if name in active:
            assert report[name] == "active"
        else:
            assert report[name] == f"megatron-core {version} is outside {patches.describe(name).versions}"


def test_patches_outside_their_range_are_fixed_upstream(clean_registry):
    """Each probe says whether the upstream behaviour is still there: it must agree with the
    declared range on this release, or the range is wrong."""
    version = megatron_core_version()
    probed = [p for p in patches.PATCHES if p.needed is not None]
    assert {p.name for p in probed} >= {"moe_te_general_gemm_unbound", "mla_have_te_flag"}
    for patch in probed:
        assert patch.needed() == patch.covers(version), patch.name


def test_unknown_release_is_refused_with_the_tested_ones_and_the_override(clean_registry):
    with pytest.raises(UntestedMegatronCoreError) as err:
        apply_patches(["distopt_shared_torch_adam_step"], version="0.20.0")
    message = str(err.value)
    assert "megatron-core 0.20.0 is not tested" in message
    for tested in TESTED_MEGATRON_CORE:
        assert tested in message
    assert f"{ALLOW_UNTESTED_ENV}=1" in message
    assert patches.active_patches() == [n for n in patches.active_patches() if n in patches.CPU_PATCHES]
    with pytest.raises(UntestedMegatronCoreError):
        check_megatron_core_version("0.18.2")
    assert check_megatron_core_version("0.19.2") == "0.19.2"


def test_override_applies_by_range_and_warns(clean_registry, monkeypatch):
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
    with pytest.warns(UserWarning, match="not tested"):
        active = apply_patches(["distopt_shared_torch_adam_step"], version="0.20.0")
    assert active == []
    assert dict(patch_report())["distopt_shared_torch_adam_step"] == (
        "megatron-core 0.20.0 is outside >=0.16.1,<0.20"
    )


def test_version_independent_patch_needs_no_tested_release(clean_registry, monkeypatch):
    calls = []
    free = Patch("free", None, "nothing upstream", "n/a", apply=lambda ctx: calls.append(1))
    monkeypatch.setitem(patches._BY_NAME, "free", free)
    assert apply_patches(["free"], version="9.9.9") == ["free"]
    assert apply_patches(["free"], version="9.9.9") == ["free"]  # idempotent
    assert calls == [1]
    revert_patches(["free"])


def test_in_range_patch_whose_bug_is_gone_fails_loudly(clean_registry, monkeypatch):
    stale = Patch(
        "stale", ">=0.16.1,<0.20", "x.py: f", "n/a", apply=lambda ctx: None, needed=lambda: False
    )
    monkeypatch.setitem(patches._BY_NAME, "stale", stale)
    with pytest.raises(RuntimeError, match="stale declares megatron-core >=0.16.1,<0.20.*narrow"):
        apply_patches(["stale"])
    assert "stale" not in patches.active_patches()


def test_disabled_patches_are_reported_and_unknown_names_refused(clean_registry, monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, "distopt_shared_torch_adam_step")
    assert apply_patches(["distopt_shared_torch_adam_step"]) == []
    assert dict(patch_report())["distopt_shared_torch_adam_step"] == f"disabled by {DISABLE_ENV}"
    monkeypatch.setenv(DISABLE_ENV, "no_such_patch")
    with pytest.raises(ValueError, match="unknown patches .*no_such_patch"):
        apply_patches(["distopt_shared_torch_adam_step"])
    with pytest.raises(KeyError, match="no patch named"):
        apply_patches(["no_such_patch"])


def test_revert_restores_the_originals(clean_registry):
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.transformer.moe import moe_utils

    originals = {n: DistributedOptimizer.__dict__[n] for n in ("load_state_dict", "sharded_state_dict")}
    had_gemm = hasattr(moe_utils, "te_general_gemm")
    apply_patches(NON_CPU)
    assert DistributedOptimizer.__dict__["load_state_dict"] is not originals["load_state_dict"]
    assert hasattr(moe_utils, "te_general_gemm")
    revert_patches(NON_CPU)
    for name, original in originals.items():
        assert DistributedOptimizer.__dict__[name] is original
    assert hasattr(moe_utils, "te_general_gemm") == had_gemm


def test_every_patch_names_its_upstream_behaviour_and_a_check():
    for patch in patches.PATCHES:
        assert patch.upstream and patch.verify, patch.name
        if patch.versions is not None:
            assert any(patch.covers(v) for v in TESTED_MEGATRON_CORE), patch.name
            assert not patch.covers("99.0"), f"{patch.name}: open-ended range"


PATCH_MODULES = {"patches.py", "cpu_compat.py", "megatron_fixes.py"}


def _module_attribute_assignments(path: Path) -> list[str]:
    """`x.attr = ...` / `setattr(x, ...)` where x names an imported module (megatron or torch)."""
    tree = ast.parse(path.read_text())
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in (
            "megatron", "torch"
        ):
            modules |= {a.asname or a.name for a in node.names}
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else []
        for target in targets:
            base = target
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(target, ast.Attribute) and isinstance(base, ast.Name) and base.id in modules:
                found.append(f"{path.name}:{node.lineno}")
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr":
            first = node.args[0] if node.args else None
            if isinstance(first, ast.Name) and first.id in modules:
                found.append(f"{path.name}:{node.lineno}")
    return found


def test_no_megatron_or_torch_attribute_is_replaced_outside_the_registry():
    root = Path(patches.__file__).resolve().parents[1]
    offenders = []
    for path in sorted(root.rglob("*.py")):
        if path.parent.name == "runtime" and path.name in PATCH_MODULES:
            continue
        offenders += _module_attribute_assignments(path)
    assert offenders == [], f"module attributes assigned outside runtime/patches.py: {offenders}"


LOG_ACTIVE = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(message)s")
from engram_train.runtime import active_patches, destroy_distributed, initialize_distributed
for _ in range(2):
    initialize_distributed()
    destroy_distributed()
print("ACTIVE", ",".join(active_patches()))
"""


def test_initialize_distributed_applies_and_logs_the_active_patches_once():
    proc = run_process(
        [sys.executable, "-c", LOG_ACTIVE], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    version = megatron_core_version()
    expected = list(patches.CPU_PATCHES) + [  # in the order they are applied
        n for n in patches.MEGATRON_FIXES if n in EXPECTED_FIXES[version]
    ]
    lines = proc.stdout.splitlines()
    assert f"ACTIVE {','.join(expected)}" in lines
    logged = [line for line in lines if "patches active" in line]
    assert logged == [
        f"engram_train.runtime.distributed megatron-core {version}; patches active: "
        + ", ".join(expected)
    ]


def _script_output(script: str) -> str:
    """Run one of tests/dist's scripts as ``python SCRIPT`` (the test zygote forks it); its
    standard output, after checking it ended well."""
    import os

    proc = run_process([sys.executable, script], capture_output=True, text=True, timeout=120,
                       cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_forked_checkpoint_queue_ends_with_its_parent():
    """The forked manager of ``cpu_forked_checkpoint_queue`` holds its parent's open files; it
    must not outlive a parent that ends without its exit handlers (an orphan kept a pipe of the
    test worker open, and the reader at its other end waited for ever).
    ``tests/dist/writer_queue_orphan.py`` prints its pid and its manager's, then ``os._exit``s."""
    import time

    parent, manager = _script_output("tests/dist/writer_queue_orphan.py").split()[-2:]
    assert parent != manager

    def alive(pid: str) -> bool:  # an orphan that ended may stay a zombie until it is reaped
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return False
        return "\nState:\tZ" not in status

    deadline = time.monotonic() + 10
    while alive(manager) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(manager)


def test_forked_checkpoint_queue_started_early_shares_no_table_pages_and_survives_sigterm():
    """``start_writer_queue_early`` (the trainer calls it before building a model it will save):
    the manager then holds none of a table built later, where one forked as at a first save
    ends up with a private copy of every page the process writes afterwards (a resume's load,
    updates); and a SIGTERM to the rank's process group (torchrun stopping the rank) leaves it
    serving, because the rank's SIGTERM save still needs it."""
    import json

    got = json.loads(_script_output("tests/dist/writer_queue_pages.py").strip().splitlines()[-1])
    assert got["started_early"] and got["early_managers"] == 1
    assert got["early_private_mib"] < 32, got  # interpreter pages it dirtied itself, no table
    assert got["late_private_mib"] > 0.9 * got["table_mib"], got  # the copying the test would see
    assert got["queue_answers"] and got["signal_recorded"] == "SIGTERM", got


def test_eager_jit_fuser_runs_megatrons_fused_functions_as_written():
    """``cpu_eager_jit_fuser``: megatron's torch.compile'd functions (decorated at import, and
    those decorated later) run eagerly on a host without CUDA, with their own results, and the
    patch reverts to torch.compile."""
    import json

    assert json.loads(_script_output("tests/dist/eager_jit_fuser.py").strip().splitlines()[-1]) == dict(
        dynamo_disabled=True, later_decorator_is_noop=True, frames_compiled=0,
        squared_relu_exact=True, bias_swiglu_exact=True, reverted=True)

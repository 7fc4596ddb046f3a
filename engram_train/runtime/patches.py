"""Every change engram_train makes to megatron-core's behaviour at run time, in one table.

A repair of an upstream bug has to stop when upstream fixes the bug, or it is applied twice
unnoticed; a redirect for CPU hosts has to name what it redirects. Each `Patch` therefore says

- ``versions``: the megatron-core releases whose behaviour it works around (a PEP 440
  specifier such as ``">=0.16.1,<0.17"``), or ``None`` for a version-independent patch (the
  CPU layer's redirects of torch's CUDA API, which every release relies on);
- ``upstream``: the megatron file and function, and the behaviour worked around;
- ``verify``: how to see that it is still needed (disable it with ``ENGRAM_DISABLE_PATCHES``
  and watch the named failure), and ``needed``, where cheap, a probe of the installed
  megatron-core that answers the same question at run time;
- ``when``: the host condition it is for (no CUDA, no Transformer Engine, torch Adam).

`apply_patches` decides, per patch and in this order:

1. named in ``ENGRAM_DISABLE_PATCHES`` (comma-separated): not applied;
2. version-dependent and the installed megatron-core is not one of `TESTED_MEGATRON_CORE`:
   `UntestedMegatronCoreError`, unless ``ENGRAM_ALLOW_UNTESTED_MEGATRON=1`` (then the
   ranges decide, with a warning);
3. outside its version range: skipped (upstream behaves there);
4. its host condition is false: not applied;
5. in range but the probe finds the upstream behaviour already fixed: `RuntimeError` (the
   range is wrong; narrow it);
6. applied. Every attribute it sets goes through `PatchContext.set`, which records the
   original for `revert_patches`.

No other module of engram_train assigns attributes of megatron (or torch) modules.
`active_patches()` lists what is in force; `initialize_distributed` logs it once at start-up.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from collections.abc import Callable, Iterable
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from engram_train.errors import EngramError
from engram_train.runtime import cpu_compat, megatron_fixes

logger = logging.getLogger(__name__)

TESTED_MEGATRON_CORE = ("0.16.1", "0.19.2")
"""The megatron-core releases the test suite runs against (the Makefile's lanes)."""

ALLOW_UNTESTED_ENV = "ENGRAM_ALLOW_UNTESTED_MEGATRON"
DISABLE_ENV = "ENGRAM_DISABLE_PATCHES"


class UntestedMegatronCoreError(EngramError, RuntimeError):
    """The installed megatron-core is not one the version-dependent patches were tested on."""


@dataclasses.dataclass(frozen=True)
class Patch:
    name: str
    versions: str | None
    upstream: str
    verify: str
    apply: Callable[[PatchContext], None]
    when: Callable[[], bool] = lambda: True
    condition: str = "always"
    needed: Callable[[], bool] | None = None

    def covers(self, version: str) -> bool:
        return self.versions is None or Version(version) in SpecifierSet(self.versions)


class PatchContext:
    """What a patch body may do: set attributes, each recorded so it can be reverted."""

    def __init__(self) -> None:
        self.changes: list[tuple[Any, str, bool, Any]] = []  # owner, name, existed, original

    def set(self, owner: Any, name: str, value: Any) -> None:
        self.changes.append((owner, name, hasattr(owner, name), getattr(owner, name, None)))
        setattr(owner, name, value)

    def revert(self) -> None:
        while self.changes:
            owner, name, existed, original = self.changes.pop()
            if existed:
                setattr(owner, name, original)
            else:
                delattr(owner, name)


def _no_cuda() -> bool:
    import torch

    return not torch.cuda.is_available()


def _no_te() -> bool:
    return not megatron_fixes.transformer_engine_available()


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="cpu_cuda_redirects",
        versions=None,
        upstream="megatron-core assumes CUDA throughout: torch.cuda.current_device() as a "
        "device, device='cuda' and pin_memory=True factories (pin_memory: "
        "rope_utils.get_pos_emb_on_this_cp_rank under context parallelism), "
        "torch.cuda.Stream/Event, CUDA RNG seeding, and "
        "param.type() == 'torch.cuda.FloatTensor' in optimizer/distrib_optimizer.py and "
        "optimizer/clip_grads.py. Redirected to the CPU (torch attributes; see docs/cpu.md).",
        verify="on a host without CUDA, ENGRAM_DISABLE_PATCHES=cpu_cuda_redirects: "
        "tests/test_lane_checkpoints.py fails at the first CUDA call ('Found no NVIDIA "
        "driver' / 'Torch not compiled with CUDA enabled')",
        apply=cpu_compat.redirect_cuda_to_cpu,
        when=_no_cuda,
        condition="no CUDA",
    ),
    Patch(
        name="cpu_rng_tracker",
        versions=">=0.16.1,<0.20",
        upstream="tensor_parallel/random.py: _get_cuda_rng_state / _set_cuda_rng_state read "
        "and write the CUDA generator for the model-parallel RNG tracker; use the CPU one.",
        verify="ENGRAM_DISABLE_PATCHES=cpu_rng_tracker on a host without CUDA: "
        "megatron.core.tensor_parallel.random._get_cuda_rng_state() raises (no CUDA), so the "
        "RNG tracker's fork() and full recompute (tests/test_engram_integration.py) fail",
        apply=cpu_compat.rng_tracker_on_cpu,
        when=_no_cuda,
        condition="no CUDA",
        needed=megatron_fixes.has_cuda_rng_state_helpers,
    ),
    Patch(
        name="cpu_forked_checkpoint_queue",
        versions=">=0.16.1,<0.20",
        upstream="dist_checkpointing/strategies/filesystem_async.py: _get_write_results_queue "
        "(0.16) / get_write_results_queue (0.19) start a multiprocessing Manager with 'spawn' "
        "at each rank's first save: a fresh interpreter importing torch and megatron-core "
        "again (~2 s of CPU per saving rank). On CPU hosts it is started with 'fork', as the "
        "writer's own worker processes are.",
        verify="a start-up cost, not a failure: with ENGRAM_DISABLE_PATCHES="
        "cpu_forked_checkpoint_queue each saving rank's first save starts a spawned "
        "interpreter again (~2 s); every test that saves runs with the patch",
        apply=cpu_compat.writer_queue_forked,
        when=_no_cuda,
        condition="no CUDA",
    ),
    Patch(
        name="cpu_eager_jit_fuser",
        versions=">=0.16.1,<0.20",
        upstream="jit.py: jit_fuser is torch.compile (torch >= 2.2); on the CPU each decorated "
        "function (TopKRouter._apply_expert_bias once per MoE layer, the bias/activation "
        "fusions) is traced by TorchDynamo and compiled to C++ by Inductor at its first call in "
        "every rank: ~1.5 s of CPU and ~20 MiB per rank, no gain at CPU sizes. On CPU hosts the "
        "decorated functions run as written.",
        verify="a start-up cost, not a failure: with ENGRAM_DISABLE_PATCHES=cpu_eager_jit_fuser a "
        "2-rank MoE run of 100 steps spends ~4.7 s more CPU (~40 MiB more RSS per rank) with the "
        "same losses; tests/test_patches.py checks that no TorchDynamo frame is compiled and "
        "the fused functions' results are their own",
        apply=cpu_compat.jit_fuser_eager,
        when=_no_cuda,
        condition="no CUDA",
    ),
    Patch(
        name="moe_te_general_gemm_unbound",
        versions=">=0.16.1,<0.17",
        upstream="transformer/moe/moe_utils.py: router_gating_linear reads te_general_gemm, "
        "bound only when the Transformer Engine import succeeds (NameError without TE; "
        "0.17 binds it to None).",
        verify="probe: moe_utils has no attribute te_general_gemm",
        apply=megatron_fixes.bind_te_general_gemm,
        when=_no_te,
        condition="no Transformer Engine",
        needed=megatron_fixes.te_general_gemm_unbound,
    ),
    Patch(
        name="mla_have_te_flag",
        versions=">=0.16.1,<0.17",
        upstream="transformer/multi_latent_attention.py sets HAVE_TE = True when its TE "
        "import resolves to MagicMock stand-ins, then isinstance(x, TELinear) raises TypeError "
        "(0.17 takes HAVE_TE from extensions/transformer_engine.py).",
        verify="probe: multi_latent_attention.HAVE_TE is True without Transformer Engine",
        apply=megatron_fixes.clear_mla_have_te,
        when=_no_te,
        condition="no Transformer Engine",
        needed=megatron_fixes.mla_have_te_wrong,
    ),
    Patch(
        name="distopt_torch_adam_step_on_load",
        versions=">=0.16.1,<0.20",
        upstream="optimizer/distrib_optimizer.py: DistributedOptimizer."
        "_set_main_param_and_optimizer_states copies every destination state key from the "
        "loaded tensors, but the reshardable loaders drop torch Adam's per-parameter 'step' "
        "(KeyError: 'step' on every load).",
        verify="ENGRAM_DISABLE_PATCHES=distopt_torch_adam_step_on_load: "
        "tests/test_lane_checkpoints.py fails with KeyError: 'step'",
        apply=megatron_fixes.keep_torch_adam_step_on_load,
        when=megatron_fixes.uses_torch_adam,
        condition="torch Adam (no TE/Apex fused Adam)",
    ),
    Patch(
        name="distopt_load_into_fresh_torch_adam",
        versions=">=0.16.1,<0.20",
        upstream="optimizer/distrib_optimizer.py: DistributedOptimizer.sharded_state_dict("
        "is_loading=True) calls state_dict(), which asserts on torch Adam's missing 'step' in "
        "a freshly built optimizer (every resume).",
        verify="ENGRAM_DISABLE_PATCHES=distopt_load_into_fresh_torch_adam: "
        "tests/test_lane_checkpoints.py fails with AssertionError in "
        "DistributedOptimizer.state_dict (assert len(steps) == 1)",
        apply=megatron_fixes.init_states_before_load,
        when=megatron_fixes.uses_torch_adam,
        condition="torch Adam (no TE/Apex fused Adam)",
    ),
    Patch(
        name="distopt_shared_torch_adam_step",
        versions=">=0.16.1,<0.20",
        upstream="optimizer/distrib_optimizer.py: DistributedOptimizer.load_state_dict gives "
        "every parameter's torch Adam state the same 'step' tensor; Adam increments it once "
        "per parameter, so bias correction is wrong after a resume.",
        verify="ENGRAM_DISABLE_PATCHES=distopt_shared_torch_adam_step: "
        "tests/test_lane_checkpoints.py sees the second step after the resume part from the "
        "uninterrupted run (loss 4.3647 instead of 4.3588)",
        apply=megatron_fixes.unshare_torch_adam_step,
        when=megatron_fixes.uses_torch_adam,
        condition="torch Adam (no TE/Apex fused Adam)",
    ),
    Patch(
        name="distopt_mixed_dtype_group_order",
        versions=">=0.16.1,<0.20",
        upstream="optimizer/distrib_optimizer.py: DistributedOptimizer.__init__ numbers a "
        "parameter's place in its optimizer group in grad-buffer order, but the group lists the "
        "float32 parameters' shards first; with float32 and bf16 parameters in one group "
        "(float32 mHC mappings under bf16) the checkpoint's parameter state maps to the wrong "
        "shards.",
        verify="ENGRAM_DISABLE_PATCHES=distopt_mixed_dtype_group_order: "
        "tests/test_mhc_layouts.py fails in get_parameter_state_dp_zero with 'The size of "
        "tensor a (128) must match the size of tensor b (288)'",
        apply=megatron_fixes.mixed_dtype_group_order,
    ),
    Patch(
        name="blended_dataset_without_process_group",
        versions=">=0.16.1,<0.18",
        upstream="datasets/blended_dataset.py: BlendedDataset._build_indices calls "
        "torch.distributed.get_rank() on a cache miss without checking is_initialized() "
        "(a weighted blend cannot be built in one process; 0.18 checks).",
        verify="ENGRAM_DISABLE_PATCHES=blended_dataset_without_process_group: "
        "tests/test_data.py::test_gpt_dataset_attention_mask_and_blend fails with 'Default "
        "process group has not been initialized'",
        apply=megatron_fixes.blended_dataset_rank_zero_alone,
    ),
    Patch(
        name="mhc_pipeline_shapes",
        versions=">=0.16.1,<0.20",
        upstream="pipeline_parallel/schedules.py: the pipelined schedules allocate P2P buffers "
        "of [seq_length, micro_batch_size, config.hidden_size]; with mHC a stage sends n "
        "residual streams ([s, b, n*h], as upstream megatron-core's mHC after 0.19 does). The "
        "schedules are given seq_length x n when the model enables hyper connections "
        "(models/hyper_connection_model.py reads the buffers as [s, b, n*h]).",
        verify="ENGRAM_DISABLE_PATCHES=mhc_pipeline_shapes: tests/test_mhc_layouts.py's "
        "pipeline layouts fail with 'is not a [n*s, b, h] mHC buffer'",
        apply=megatron_fixes.pipeline_shapes_for_hyper_connections,
        needed=megatron_fixes.no_upstream_hyper_connections,
    ),
    Patch(
        name="chained_optimizer_by_role",
        versions=">=0.16.1,<0.20",
        upstream="optimizer/optimizer.py: ChainedOptimizer.sharded_state_dict and load_state_dict "
        "key each optimizer's state by its position in the chain (chained_<i>. prefixes, "
        "integer keys); the chain has an expert optimizer only with expert_model_parallel_size "
        "> 1, so a checkpoint does not load across EP 1 and EP > 1. With the metadata flag "
        "megatron_fixes.CHAIN_BY_ROLE the state is keyed by role (dense, expert, engram).",
        verify="ENGRAM_DISABLE_PATCHES=chained_optimizer_by_role: tests/test_expert_parallel_resume.py "
        "fails (a checkpoint saved at EP 2 does not load at EP 1: missing optimizer keys)",
        apply=megatron_fixes.key_chain_by_role,
        needed=megatron_fixes.chain_keyed_by_position,
    ),
    Patch(
        name="embedded_common_state",
        versions=">=0.16.1,<0.19",
        upstream="dist_checkpointing/serialization.py: load() and load_common_state_dict() "
        "read a checkpoint's common state from common.pt only; megatron-core 0.19 embeds it "
        "in the torch_dist files (a ShardedObject 'common_state') and writes no common.pt. "
        "A checkpoint without common.pt is read through the embedded object.",
        verify="ENGRAM_DISABLE_PATCHES=embedded_common_state on the 0.16 lane: "
        "tests/test_lane_checkpoints.py fails to load the fixture written on 0.19 "
        "(common.pt: No such file or directory)",
        apply=megatron_fixes.load_embedded_common_state,
    ),
)

CPU_PATCHES = ("cpu_cuda_redirects", "cpu_rng_tracker", "cpu_forked_checkpoint_queue", "cpu_eager_jit_fuser")
MEGATRON_FIXES = (
    "moe_te_general_gemm_unbound",
    "mla_have_te_flag",
    "distopt_torch_adam_step_on_load",
    "distopt_load_into_fresh_torch_adam",
    "distopt_shared_torch_adam_step",
    "distopt_mixed_dtype_group_order",  # float32 mHC mappings beside bf16 parameters
    "chained_optimizer_by_role",  # checkpoints that load when the chain changes shape with EP
    "mhc_pipeline_shapes",  # a missing feature rather than a bug: mHC stages exchange n streams
    "embedded_common_state",  # a newer release's checkpoint format, read by an older one
)
DATASET_PATCHES = ("blended_dataset_without_process_group",)

_BY_NAME = {p.name: p for p in PATCHES}
_ACTIVE: dict[str, PatchContext] = {}
_DECIDED: dict[str, str] = {}  # name -> why it is not active (for patch_report)


def megatron_core_version() -> str:
    """The installed megatron-core release (its distribution metadata, else package_info)."""
    from importlib import metadata

    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        from megatron.core import package_info

        return package_info.__version__


def _untested_allowed() -> bool:
    return os.environ.get(ALLOW_UNTESTED_ENV, "").strip().lower() in ("1", "true", "yes")


def check_megatron_core_version(version: str | None = None) -> str:
    """Return the installed megatron-core version if it is tested (or explicitly allowed);
    raise `UntestedMegatronCoreError` otherwise."""
    version = version or megatron_core_version()
    if Version(version).public in TESTED_MEGATRON_CORE:
        return version
    message = (
        f"megatron-core {version} is not tested with engram_train (tested: "
        f"{', '.join(TESTED_MEGATRON_CORE)}). Its repairs of megatron-core bugs "
        f"(engram_train/runtime/patches.py) are declared per release and may be missing or "
        f"wrong on this one. Install a tested release, e.g. pip install "
        f"'megatron-core=={TESTED_MEGATRON_CORE[-1]}', or set {ALLOW_UNTESTED_ENV}=1 to run "
        f"anyway (each patch then applies only inside its declared version range)."
    )
    if not _untested_allowed():
        raise UntestedMegatronCoreError(message)
    warnings.warn(message, stacklevel=3)
    return version


def _disabled() -> set[str]:
    names = {n.strip() for n in os.environ.get(DISABLE_ENV, "").split(",") if n.strip()}
    unknown = names - set(_BY_NAME)
    if unknown:
        raise ValueError(
            f"{DISABLE_ENV} names unknown patches {sorted(unknown)}; known: {sorted(_BY_NAME)}"
        )
    return names


def apply_patches(names: Iterable[str], version: str | None = None) -> list[str]:
    """Apply the named patches by the rules of the module docstring (idempotent); return the
    names among them that are active afterwards. ``version`` overrides the detected
    megatron-core version (tests)."""
    selected = []
    for name in names:
        if name not in _BY_NAME:
            raise KeyError(f"no patch named {name!r}; known: {sorted(_BY_NAME)}")
        selected.append(_BY_NAME[name])
    disabled = _disabled()
    pending = [p for p in selected if p.name not in _ACTIVE and p.name not in disabled]
    for p in selected:
        if p.name in disabled:
            _DECIDED[p.name] = f"disabled by {DISABLE_ENV}"
    if any(p.versions is not None for p in pending):
        version = check_megatron_core_version(version)
    for patch in pending:
        if not patch.covers(version or "0"):
            _DECIDED[patch.name] = f"megatron-core {version} is outside {patch.versions}"
            continue
        if not patch.when():
            _DECIDED[patch.name] = f"not for this host (applies with: {patch.condition})"
            continue
        if patch.needed is not None and not patch.needed():
            raise RuntimeError(
                f"patch {patch.name} declares megatron-core {patch.versions}, but the installed "
                f"megatron-core {version} already behaves ({patch.upstream}); narrow its range "
                f"in engram_train/runtime/patches.py"
            )
        ctx = PatchContext()
        try:
            patch.apply(ctx)
        except BaseException:
            ctx.revert()
            raise
        _ACTIVE[patch.name] = ctx
        _DECIDED.pop(patch.name, None)
    return [p.name for p in selected if p.name in _ACTIVE]


def revert_patches(names: Iterable[str] | None = None) -> None:
    """Undo the named (default: all) active patches, newest first (tests)."""
    targets = set(_BY_NAME if names is None else names)
    for name in reversed(list(_ACTIVE)):
        if name in targets:
            _ACTIVE.pop(name).revert()
            _DECIDED.pop(name, None)


def active_patches() -> list[str]:
    """Names of the patches in force in this process, in the order they were applied."""
    return list(_ACTIVE)


def patch_report() -> list[tuple[str, str]]:
    """``(name, status)`` for every registered patch: "active", why not, or "not requested"."""
    return [
        (p.name, "active" if p.name in _ACTIVE else _DECIDED.get(p.name, "not requested"))
        for p in PATCHES
    ]


def describe(name: str) -> Patch:
    return _BY_NAME[name]


# ---------------------------------------------------------------------------- entry points


def install_cpu_compat() -> bool:
    """Apply the CPU layer (`CPU_PATCHES`) if CUDA is absent. True when it is in force."""
    applied = apply_patches(CPU_PATCHES)
    return "cpu_cuda_redirects" in applied


def uninstall_cpu_compat() -> None:
    """Restore every attribute the CPU layer replaced (tests)."""
    revert_patches(CPU_PATCHES)


def is_installed() -> bool:
    """Whether the CPU layer is in force."""
    return "cpu_cuda_redirects" in _ACTIVE


def apply_megatron_fixes() -> list[str]:
    """Apply the repairs of megatron-core bugs (`MEGATRON_FIXES`); return the active ones."""
    return apply_patches(MEGATRON_FIXES)

"""Process start-up: distributed init, megatron parallel state, the megatron-core patches."""

from engram_train.logs import quiet_known_warnings as _quiet_known_warnings

# Third-party warnings that say nothing actionable (megatron's optional GPU packages, its use of
# deprecated torch APIs, the CPU RNG check): filtered once, listed in engram_train/logs.py;
# ENGRAM_SHOW_WARNINGS=1 keeps them.
_quiet_known_warnings()

from engram_train.runtime.distributed import (
    ParallelSizes,
    destroy_distributed,
    device,
    initialize_distributed,
    set_seed,
)
from engram_train.runtime.megatron_fixes import transformer_engine_available
from engram_train.runtime.patches import (
    TESTED_MEGATRON_CORE,
    UntestedMegatronCoreError,
    active_patches,
    apply_megatron_fixes,
    install_cpu_compat,
    is_installed,
    megatron_core_version,
    patch_report,
    uninstall_cpu_compat,
)

__all__ = [
    "TESTED_MEGATRON_CORE",
    "ParallelSizes",
    "UntestedMegatronCoreError",
    "active_patches",
    "apply_megatron_fixes",
    "destroy_distributed",
    "device",
    "initialize_distributed",
    "install_cpu_compat",
    "is_installed",
    "megatron_core_version",
    "patch_report",
    "set_seed",
    "transformer_engine_available",
    "uninstall_cpu_compat",
]

"""Process start-up: distributed init, megatron parallel state, the megatron-core patches."""

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

import warnings as _warnings

# megatron-core warns at import time about optional GPU packages on every CPU rank, and about
# its own use of deprecated torch APIs on every step; neither is actionable for a user.
_warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).* not installed.*")
_warnings.filterwarnings("ignore", message=r".*full scope is deprecated.*")
_warnings.filterwarnings("ignore", message=r".*is deprecated. Please use `torch.distributed.*")
_warnings.filterwarnings("ignore", message=r".*\.grad attribute of a Tensor that is not a leaf.*")

"""Process start-up: distributed init, megatron parallel state, CPU compatibility."""

from engram_train.runtime.cpu_compat import install_cpu_compat, is_installed, uninstall_cpu_compat
from engram_train.runtime.distributed import (
    ParallelSizes,
    destroy_distributed,
    device,
    initialize_distributed,
    set_seed,
)
from engram_train.runtime.megatron_fixes import apply_megatron_fixes, transformer_engine_available

__all__ = [
    "ParallelSizes",
    "apply_megatron_fixes",
    "destroy_distributed",
    "device",
    "initialize_distributed",
    "install_cpu_compat",
    "is_installed",
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

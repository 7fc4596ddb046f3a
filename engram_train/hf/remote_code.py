"""The modeling code an Engram/mHC export carries, so that it loads without this project.

transformers' convention for an architecture it does not ship: ``configuration_*.py`` and
``modeling_*.py`` in the folder, named by ``auto_map`` in ``config.json`` and loaded with
``trust_remote_code=True``. The files are the package's own modules, copied with their
package imports made relative (``from engram_train.engram.engram_module import Engram`` ->
``from .engram_module import Engram``): one source of truth. Each copied module may import
only the standard library, torch, numpy, transformers and the other copied modules; anything
else is refused when the folder is written (a test loads the folder with the package blocked).
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
from pathlib import Path

from engram_train.errors import EngramError

# package module -> file in the folder
MODULES = {
    "engram_train.hf.configuration": "configuration_engram_deepseek_v3.py",
    "engram_train.hf.modeling": "modeling_engram_deepseek_v3.py",
    "engram_train.engram.engram_module": "engram_module.py",
    "engram_train.models.hyper_connection": "hyper_connection.py",
    "engram_train.models.hyper_connection_ops": "hyper_connection_ops.py",
    "engram_train.engram.incremental_hash": "incremental_hash.py",
    "engram_train.errors": "engram_errors.py",
}
AUTO_MAP = {
    "AutoConfig": "configuration_engram_deepseek_v3.EngramDeepseekV3Config",
    "AutoModelForCausalLM": "modeling_engram_deepseek_v3.EngramDeepseekV3ForCausalLM",
}
ALLOWED = {"torch", "numpy", "transformers"} | set(sys.stdlib_module_names)
_IMPORT = re.compile(r"^from (engram_train(?:\.\w+)+) import ", re.MULTILINE)


class RemoteCodeError(EngramError, ValueError):
    """A copied module imports something the folder cannot provide (names the module)."""


def module_source(module: str) -> str:
    """`module`'s text with its imports of the other copied modules made relative."""
    path = Path(importlib.import_module(module).__file__)
    text = path.read_text()

    def relative(match: re.Match) -> str:
        name = match.group(1)
        if name not in MODULES:
            raise RemoteCodeError(f"{path}: imports {name}, which the export does not copy; "
                                  f"add it to MODULES (torch/numpy only) or drop the import")
        return f"from .{MODULES[name].removesuffix('.py')} import "

    text = _IMPORT.sub(relative, text)
    for node in ast.walk(ast.parse(text)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
        for name in names:
            if name.split(".")[0] not in ALLOWED and node.col_offset == 0:
                raise RemoteCodeError(f"{path}: imports {name} at module level; the exported "
                                      "code may import only torch, numpy, transformers and "
                                      "the standard library")
    return text


def write_remote_code(folder: Path) -> dict[str, str]:
    """Write the modeling files into `folder`; returns config.json's ``auto_map``."""
    for module, name in MODULES.items():
        (folder / name).write_text(module_source(module))
    return dict(AUTO_MAP)

"""The package order of docs/architecture.md holds: read every import of engram_train (module
level and function-local, with ast) and refuse an arrow to a package listed later. Also the
one error root: every exception class the project defines derives from `EngramError`; and the
size rules: no module over 450 lines, no function over 80, no file name used twice."""

from __future__ import annotations

import ast
import builtins
import re
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "engram_train"


def package_order(doc: str) -> dict[str, int]:
    """unit (``config/``, ``logs.py``) -> its row in the "Packages, in dependency order" table."""
    section = doc.split("## Packages, in dependency order", 1)[1].split("\n## ", 1)[0]
    order: dict[str, int] = {}
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    for rank, row in enumerate(rows):
        for name in re.findall(r"`([\w.]+/?)`", row.split("|")[1]):
            order[name] = rank
    return order


def unit_of(module: str) -> str | None:
    """``engram_train.training.loop`` -> ``training/``; ``engram_train.logs`` -> ``logs.py``."""
    parts = module.split(".")
    if parts[0] != "engram_train" or len(parts) < 2:
        return None
    head = parts[1]
    return f"{head}/" if (PACKAGE / head).is_dir() else f"{head}.py"


def imported_modules(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, module) for every import in ``source`` (relative ones resolved), at any depth."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join(anchor + ([base] if base else []))
            # `from engram_train import config` names a subpackage: the arrow goes to it
            found += [(node.lineno, f"{base}.{a.name}" if base == "engram_train" else base)
                      for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            # a ``module:function`` entry point, imported later by name (a registry)
            entry = ENTRY_POINT.fullmatch(node.value)
            if entry:
                found.append((node.lineno, entry.group(1)))
    return found


ENTRY_POINT = re.compile(r"(engram_train(?:\.\w+)+):\w+")


def arrows_against_order(sources: dict[str, str], order: dict[str, int]) -> list[str]:
    """Imports from a unit to a unit listed after it; ``sources``: module name -> text."""
    bad = []
    for module, text in sources.items():
        is_package = module.endswith(".__init__")
        name = module.removesuffix(".__init__")
        here = unit_of(name)
        if here is None:  # engram_train/__init__.py
            continue
        for line, target in imported_modules(text, name, is_package):
            there = unit_of(target)
            if there is None or there == here:
                continue
            if order[there] > order[here]:
                bad.append(f"{module}:{line} imports {target} ({here} -> {there}, listed later)")
    return bad


def project_sources() -> dict[str, str]:
    return {".".join(path.relative_to(REPO).with_suffix("").parts): path.read_text()
            for path in sorted(PACKAGE.rglob("*.py"))}


ORDER = package_order((REPO / "docs" / "architecture.md").read_text())


def test_every_package_and_top_level_module_is_in_the_order():
    units = {unit_of(m.removesuffix(".__init__")) for m in project_sources()} - {None}
    assert units - set(ORDER) == set(), "add them to docs/architecture.md's package table"
    assert set(ORDER) - units == set(), "the table lists units that do not exist"


# Arrows still to remove by moving code (each names importer -> imported); the list may only
# shrink: a new arrow against the order fails the test.
KNOWN_ARROWS: set[tuple[str, str]] = set()


def test_no_import_points_to_a_later_package():
    found = {(line.split(":")[0], line.split(" imports ")[1].split(" ")[0])
             for line in arrows_against_order(project_sources(), ORDER)}
    assert found - KNOWN_ARROWS == set()
    assert KNOWN_ARROWS - found == set(), "an arrow was removed: drop it from KNOWN_ARROWS"


def test_an_arrow_to_a_later_package_fails_the_check():
    """The check sees function-local, relative and ``from engram_train import`` imports, and
    ``module:function`` entry points named in strings."""
    sources = project_sources()
    sources["engram_train.runtime.synthetic"] = (
        "def later():\n    from engram_train.training.loop import train\n")
    sources["engram_train.engram.synthetic"] = "from ..models import builder\n"
    sources["engram_train.config.synthetic"] = "from engram_train import checkpoint\n"
    sources["engram_train.data.synthetic"] = 'WRITER = "engram_train.training.loop:train"\n'
    assert [a for a in arrows_against_order(sources, ORDER) if "synthetic" in a] == [
        "engram_train.runtime.synthetic:2 imports engram_train.training.loop "
        "(runtime/ -> training/, listed later)",
        "engram_train.engram.synthetic:1 imports engram_train.models "
        "(engram/ -> models/, listed later)",
        "engram_train.config.synthetic:1 imports engram_train.checkpoint "
        "(config/ -> checkpoint/, listed later)",
        "engram_train.data.synthetic:1 imports engram_train.training.loop "
        "(data/ -> training/, listed later)",
    ]


def _exception_classes() -> dict[str, list[str]]:
    """Every class defined in engram_train that derives from an exception: name -> bases, as
    written. (Read with ast: no module is imported.)"""
    classes: dict[str, list[str]] = {}
    for module, text in project_sources().items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases]
                classes[f"{module}.{node.name}"] = bases
    by_name = {qual.rsplit(".", 1)[-1]: bases for qual, bases in classes.items()}

    def is_exception(name: str, seen=()) -> bool:
        builtin = getattr(builtins, name, None)
        if isinstance(builtin, type) and issubclass(builtin, BaseException):
            return True
        return name not in seen and any(is_exception(b, (*seen, name)) for b in by_name.get(name, []))

    return {q: b for q, b in classes.items() if any(is_exception(x) for x in b)}


def test_every_project_exception_derives_from_the_root():
    from engram_train.errors import EngramError

    classes = _exception_classes()
    assert len(classes) >= 20, sorted(classes)  # the scan finds them
    for qual in classes:
        module, name = qual.rsplit(".", 1)
        cls = getattr(__import__(module.removesuffix(".__init__"), fromlist=[name]), name)
        assert issubclass(cls, EngramError), f"{qual} does not derive from EngramError"


def family_arrows(sources: dict[str, str]) -> list[str]:
    """In ``models/``: a shared block (a module directly in ``models/``) importing a family
    folder other than through the registry, or a family folder importing another family."""
    bad = []
    for module, text in sources.items():
        parts = module.removesuffix(".__init__").split(".")
        if parts[:2] != ["engram_train", "models"] or len(parts) < 3:
            continue
        here = parts[2] if len(parts) > 3 or (PACKAGE / "models" / parts[2]).is_dir() else None
        if here is None and parts[2] in {"families", "__init__"}:
            continue  # the registry names the built-in families
        for line, target in imported_modules(text, module.removesuffix(".__init__"),
                                             module.endswith(".__init__")):
            tparts = target.split(".")
            if (tparts[:2] != ["engram_train", "models"] or len(tparts) < 3
                    or not (PACKAGE / "models" / tparts[2]).is_dir()):
                continue
            there = tparts[2]
            if there != here:
                bad.append(f"{module}:{line} imports {target} "
                           f"({here or 'shared block'} -> family {there})")
    return bad


def test_shared_blocks_and_families_keep_apart():
    """docs/architecture.md's `models/` rules: shared blocks never import a family folder
    (they ask the registry, ``models/families.py``, for the family), no family imports
    another."""
    sources = project_sources()
    assert (PACKAGE / "models" / "deepseek_v3").is_dir()
    assert family_arrows(sources) == []
    sources["engram_train.models.synthetic_shared"] = (
        "from engram_train.models.deepseek_v3.v3_specs import deepseek_v3_block_spec\n")
    sources["engram_train.models.other_family.blocks"] = (
        "from engram_train.models.deepseek_v3 import v3_config\n"
        "from engram_train.models.engram_layer import EngramTransformerLayer\n")
    assert family_arrows(sources) == [
        "engram_train.models.synthetic_shared:1 imports engram_train.models.deepseek_v3.v3_specs "
        "(shared block -> family deepseek_v3)",
        "engram_train.models.other_family.blocks:1 imports engram_train.models.deepseek_v3 "
        "(other_family -> family deepseek_v3)",
    ]


def bare_builtin_raises(sources: dict[str, str]) -> list[str]:
    """``raise ValueError(...)``/``raise TypeError(...)``: errors that do not derive from
    `EngramError` (errors.py: a class of the project keeps the built-in base)."""
    found = []
    for module, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
                    and ast.unparse(node.exc.func) in ("ValueError", "TypeError")):
                found.append(f"{module}:{node.lineno}")
    return found


def test_deliberate_errors_derive_from_the_root_where_raised():
    """No bare ValueError/TypeError in config/ (a user of `EngramConfig` catches what the
    trainer catches); a few elsewhere (internal invariants, modules kept byte-identical)."""
    sources = project_sources()
    bare = bare_builtin_raises(sources)
    assert [b for b in bare if b.startswith("engram_train.config.")] == []
    assert len(bare) <= 40, bare
    sources["engram_train.config.synthetic"] = "def f(x):\n    raise TypeError(f'{x}')\n"
    assert "engram_train.config.synthetic:2" in bare_builtin_raises(sources)


def test_importing_the_package_loads_neither_hydra_nor_torch():
    """``import engram_train`` defines names only: Hydra's ConfigStore is filled where Hydra
    composes (`engram_train.config.register`), torch and megatron load on first use."""
    import subprocess
    import sys

    code = "import sys, engram_train; print('hydra' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout
    assert out.split() == ["False", "False"]


MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80
# File names a package may repeat: Python's own (``__init__``, ``__main__``).
ROLE_FILE_NAMES = {"__init__", "__main__"}


def size_violations(sources: dict[str, str]) -> list[str]:
    """Modules over `MAX_MODULE_LINES`, functions over `MAX_FUNCTION_LINES` (``def`` line to
    last line), and file names (other than `ROLE_FILE_NAMES`) in more than one package."""
    bad = []
    by_name = defaultdict(list)
    for module, text in sources.items():
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            bad.append(f"{module}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    bad.append(f"{module}:{node.lineno} {node.name}: {length} lines")
        name = module.rsplit(".", 1)[-1]
        if name not in ROLE_FILE_NAMES:
            by_name[name].append(module)
    bad += [f"{name}.py in {', '.join(modules)}" for name, modules in sorted(by_name.items())
            if len(modules) > 1]
    return bad


def test_size_rules_hold():
    """docs/architecture.md's size rules: split a module before it passes 450 lines, a function
    before 80; a family's or a tool's modules carry its name (``v3_specs.py``, ``plan_report.py``)."""
    sources = project_sources()
    assert size_violations(sources) == []
    body = "".join(f"    x{i} = {i}\n" for i in range(80))
    sources["engram_train.sweep.synthetic_long"] = "def long():\n" + body
    sources["engram_train.data.synthetic_big"] = "X = 1\n" * (MAX_MODULE_LINES + 1)
    sources["engram_train.sweep.plan_layout"] = "X = 1\n"
    sources["engram_train.sweep.cli_synthetic"] = "X = 1\n"
    sources["engram_train.inference.errors"] = "X = 1\n"
    sources["engram_train.inference.__main__"] = "X = 1\n"  # Python's own name may repeat
    assert size_violations(sources) == [
        "engram_train.sweep.synthetic_long:1 long: 81 lines",
        f"engram_train.data.synthetic_big: {MAX_MODULE_LINES + 1} lines",
        "errors.py in engram_train.errors, engram_train.inference.errors",
        "plan_layout.py in engram_train.memory_plan.plan_layout, engram_train.sweep.plan_layout",
    ]


def test_the_readme_layout_names_every_package_folder():
    layout = (REPO / "README.md").read_text().split("## Layout", 1)[1].split("\n## ", 1)[0]
    folders = {p.parent.relative_to(PACKAGE).parts[0] for p in PACKAGE.rglob("*.py")
               if p.parent != PACKAGE}
    assert folders, "the scan finds the packages"
    assert [f for f in sorted(folders) if f"  {f}/" not in layout] == []


def test_every_lazily_exported_name_resolves():
    """A package's ``_EXPORTS`` (name -> module, imported on first use) names real modules: a
    renamed module fails here, not in the first script that reaches for the name."""
    import importlib

    packages = sorted({p.parent for p in PACKAGE.rglob("__init__.py")})
    checked = 0
    for folder in packages:
        name = ".".join(folder.relative_to(REPO).parts)
        exports = getattr(importlib.import_module(name), "_EXPORTS", {})
        for export in exports:
            assert getattr(importlib.import_module(name), export) is not None, f"{name}.{export}"
            checked += 1
    assert checked >= 40  # the scan finds them

"""The import graph of engram_train, beside the package order (tests/test_architecture.py):
every import statement, at module level or inside a function, read with ast.

- no circle: no module reaches itself through imports (a package's ``__init__`` importing its
  own modules is an arrow like any other);
- a model family's modules (``v3_*``, ``v41_*``) live in its folder under ``models/`` (or, for
  the Engram variants, under ``engram/``);
- the shared packages (hf/, export/, memory_plan/, training/, inference/, checkpoint/) never
  import a family folder, nor name one as a ``module:function`` entry point: they ask
  ``models/families.py`` for the family (docs/architecture.md "Adding a model family").
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "engram_train"
SHARED = ("hf", "export", "memory_plan", "training", "inference", "checkpoint")
FAMILY_MODULE = re.compile(r"^v(3|41)_")
ENTRY_POINT = re.compile(r"(engram_train(?:\.\w+)+):\w+")


def sources() -> dict[str, str]:
    """module name (``engram_train.hf.importer``, ``engram_train.models.__init__``) -> text."""
    return {".".join(p.relative_to(REPO).with_suffix("").parts): p.read_text()
            for p in sorted(PACKAGE.rglob("*.py"))}


def _module_of(name: str, known: set[str]) -> str | None:
    """The project module an import names (a package: its ``__init__``), else None."""
    if name in known:
        return name
    if f"{name}.__init__" in known:
        return f"{name}.__init__"
    return None


def imports(text: str, module: str, known: set[str], entry_points: bool = False) -> set[str]:
    """The project modules `module`'s text imports (``from a import b``: ``a.b`` when it is a
    module, else ``a``), at any depth; with `entry_points`, ``module:function`` strings too."""
    is_package = module.endswith(".__init__")
    name = module.removesuffix(".__init__")
    found = set()
    for node in ast.walk(ast.parse(text)):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")
                anchor = parts[: len(parts) - node.level + is_package]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.append(sub if _module_of(sub, known) else base)
        elif entry_points and isinstance(node, ast.Constant) and isinstance(node.value, str):
            match = ENTRY_POINT.fullmatch(node.value)
            targets = [match.group(1)] if match else []
        for target in targets:
            resolved = _module_of(target, known)
            if resolved is not None and resolved != module:
                found.add(resolved)
    return found


def graph(texts: dict[str, str], entry_points: bool = False) -> dict[str, set[str]]:
    known = set(texts)
    return {m: imports(t, m, known, entry_points) for m, t in texts.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_circle():
    assert circles(graph(sources())) == []


def test_a_circle_through_a_function_level_import_is_found():
    texts = sources()
    texts["engram_train.sweep.synthetic_a"] = "from engram_train.sweep import synthetic_b\n"
    texts["engram_train.sweep.synthetic_b"] = (
        "def late():\n    from .synthetic_a import X\n")
    assert circles(graph(texts)) == [["engram_train.sweep.synthetic_a",
                                      "engram_train.sweep.synthetic_b"]]


def family_folders() -> set[str]:
    return {p.name for p in (PACKAGE / "models").iterdir()
            if p.is_dir() and (p / "__init__.py").is_file()}


def strays(texts: dict[str, str]) -> set[str]:
    """Family modules (``v3_*``, ``v41_*``) outside ``models/`` and ``engram/``."""
    return {m for m in texts if FAMILY_MODULE.match(m.rsplit(".", 1)[-1])
            and m.split(".")[1] not in ("models", "engram")}


def test_family_modules_live_in_their_folders():
    texts = sources()
    assert strays(texts) == set()
    texts["engram_train.export.v41_synthetic"] = "X = 1\n"
    assert "engram_train.export.v41_synthetic" in strays(texts)


def family_imports(texts: dict[str, str]) -> set[tuple[str, str]]:
    """(module of a shared package, family module it imports or names as an entry point)."""
    folders = family_folders()
    bad = set()
    for module, targets in graph(texts, entry_points=True).items():
        if module.split(".")[1] not in SHARED:
            continue
        for target in targets:
            parts = target.split(".")
            if parts[1] == "models" and len(parts) > 3 and parts[2] in folders:
                bad.add((module, target))
    return bad


def test_shared_packages_never_import_a_family_folder():
    texts = sources()
    found = family_imports(texts)
    assert found == set()
    texts["engram_train.training.synthetic"] = (
        "def f():\n    from engram_train.models.deepseek_v41 import v41_config\n")
    texts["engram_train.hf.synthetic"] = (
        'HOOK = "engram_train.models.deepseek_v3.v3_family:FAMILY"\n')
    assert {m for m, _ in family_imports(texts) - found} == {
        "engram_train.training.synthetic", "engram_train.hf.synthetic"}

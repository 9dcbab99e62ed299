"""The package's structure, as docs/ARCHITECTURE.md draws it: no import cycle between modules, no
import from a lower layer into a higher one, and a CLI that starts without torch or DeepSpeed.

Imports are read as text (ast), those inside functions included, so a cycle hidden in a function
counts too.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "pipectl"
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"


def layer_order() -> list[set[str]]:
    """The `layers:` line of docs/ARCHITECTURE.md, top first: `cli > report > ... > {a, b} > errors`."""
    match = re.search(r"^layers: (.+)$", ARCHITECTURE.read_text(), flags=re.MULTILINE)
    assert match, "docs/ARCHITECTURE.md has no 'layers: top > ... > bottom' line"
    return [{name.strip() for name in part.strip(" {}").split(",")} for part in match.group(1).split(">")]


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def imports() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (anywhere in its body)."""
    known = modules()
    edges: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            edges[name].update(t for t in targets if t in known and t != name)
    return edges


def unit(module: str) -> str:
    """The layer unit a module belongs to: its sub-package, or its own name at the top level."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "pipectl"


def test_every_module_belongs_to_a_layer():
    named = set().union(*layer_order())
    missing = sorted({unit(m) for m in modules()} - named)
    assert not missing, f"not placed in docs/ARCHITECTURE.md's layers line: {missing}"


def test_imports_point_down_only():
    rank = {name: index for index, names in enumerate(layer_order()) for name in names}
    upward = [
        f"{importer} -> {imported}"
        for importer, targets in sorted(imports().items())
        for imported in sorted(targets)
        if rank[unit(imported)] < rank[unit(importer)]
    ]
    assert not upward, "imports from a lower layer into a higher one:\n" + "\n".join(upward)


def test_no_import_cycles():
    edges = imports()
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(edges[module]):
            if state.get(target) == 1:
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_cli_starts_without_torch_deepspeed_or_matplotlib():
    code = (
        "import sys, pipectl.cli.main\n"
        "print(sorted(m for m in ('torch', 'deepspeed', 'matplotlib') if m in sys.modules))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert loaded.stdout.strip() == "[]"


def test_the_run_directory_formats_import_without_torch():
    """`pipectl.rundir` is what the user's process reads of a run (status, resize, launch): every
    module of it imports without torch or DeepSpeed."""
    names = sorted(m for m in modules() if m == "pipectl.rundir" or m.startswith("pipectl.rundir."))
    assert len(names) > 5, names
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}: importlib.import_module(name)\n"
        "print(sorted(m for m in ('torch', 'deepspeed') if m in sys.modules))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert loaded.stdout.strip() == "[]"


def test_the_checker_sees_a_cycle_and_an_upward_import(tmp_path, monkeypatch):
    """The tests above can fail: a fake package with one cycle and one upward import is caught."""
    fake = tmp_path / "src" / "pipectl"
    for name, text in {
        "__init__.py": "",
        "cli/__init__.py": "",
        "cli/main.py": "from pipectl.plan import search\n",
        "plan/__init__.py": "",
        "plan/search.py": "def f():\n    from pipectl.plan import morph\n",
        "plan/morph.py": "from pipectl.plan.search import f\nfrom pipectl.cli import main\n",
    }.items():
        (fake / name).parent.mkdir(parents=True, exist_ok=True)
        (fake / name).write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    edges = imports()
    assert edges["pipectl.plan.search"] == {"pipectl.plan", "pipectl.plan.morph"}
    assert "pipectl.cli.main" in edges["pipectl.plan.morph"]
    with pytest.raises(AssertionError, match="pipectl.plan.search -> pipectl.plan.morph -> pipectl.plan.search"):
        test_no_import_cycles()
    with pytest.raises(AssertionError, match="pipectl.plan.morph -> pipectl.cli.main"):
        test_imports_point_down_only()

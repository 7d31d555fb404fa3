"""Names left behind by a refactor, found on any machine: every global name a function reads is defined in its
module (or is a builtin), and every ``from cpkv... import name`` names a module that binds it, in the package,
the benchmarks, the tests and the examples. Much of the package runs only on a GPU (kernels, launch paths,
platform checks, imports done inside functions), where such a name would fail only there; these checks read
symbol tables and syntax trees and import nothing.

Bound at run time and counted as defined: ``globals()["name"] = ...``, and the names of ``__all__`` in a package
that resolves them lazily with a module ``__getattr__``."""
from __future__ import annotations

import ast
import builtins
import re
import symtable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted((ROOT / "src" / "cpkv").rglob("*.py")) + sorted((ROOT / "benchmarks").glob("*.py")) \
    + sorted((ROOT / "tests").rglob("*.py")) + sorted((ROOT / "examples").glob("*.py"))
MODULE_DUNDERS = {"__file__", "__name__", "__doc__", "__spec__", "__path__", "__package__", "__builtins__",
                  "__loader__", "__annotations__", "__dict__", "__module__", "__qualname__", "__class__"}
KNOWN = set(dir(builtins)) | MODULE_DUNDERS


def bound_names(source: str, filename: str) -> set[str]:
    """The names a module binds at its top level (see the module docstring for the run-time forms)."""
    top = symtable.symtable(source, filename, "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    bound |= set(re.findall(r"globals\(\)\[['\"](\w+)['\"]\]\s*=", source))
    if "__getattr__" in bound:
        for node in ast.parse(source).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
                bound |= set(ast.literal_eval(node.value))
    return bound


def undefined_globals(source: str, filename: str) -> list[str]:
    """``line function: name`` for each global name read in a function or class body (or at module level)
    that the module never binds."""
    top = symtable.symtable(source, filename, "exec")
    bound = bound_names(source, filename)
    missing = [f"module: {s.get_name()}" for s in top.get_symbols()
               if s.is_referenced() and s.get_name() not in bound | KNOWN and not s.is_assigned()]

    def walk(table: symtable.SymbolTable) -> None:
        for child in table.get_children():
            missing.extend(f"{child.get_lineno()} {child.get_name()}: {s.get_name()}" for s in child.get_symbols()
                           if s.is_global() and s.is_referenced() and s.get_name() not in bound | KNOWN)
            walk(child)

    walk(top)
    return missing


def _module_file(module: str) -> Path | None:
    base = ROOT.joinpath("src", *module.split("."))
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.exists()), None)


def missing_imports(source: str) -> list[str]:
    """``line module: name`` for each ``import cpkv.x`` / ``from cpkv.x import name`` (anywhere, inside
    functions too) whose module does not exist or binds no such name (nor has such a submodule)."""
    missing = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            missing += [f"{node.lineno} {a.name}" for a in node.names
                        if a.name.split(".")[0] == "cpkv" and _module_file(a.name) is None]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "cpkv":
            target = _module_file(node.module)
            if target is None:
                missing.append(f"{node.lineno} {node.module}")
                continue
            names = bound_names(target.read_text(), str(target))
            missing += [f"{node.lineno} {node.module}: {a.name}" for a in node.names
                        if a.name != "*" and a.name not in names and _module_file(f"{node.module}.{a.name}") is None]
    return missing


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(ROOT)) for p in FILES])
def test_every_global_a_module_reads_is_defined(path: Path) -> None:
    assert undefined_globals(path.read_text(), str(path)) == []


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(ROOT)) for p in FILES])
def test_every_cpkv_import_names_what_its_module_binds(path: Path) -> None:
    assert missing_imports(path.read_text()) == []


def test_the_check_finds_a_name_left_by_a_refactor() -> None:
    src = "import torch\n\ndef f(x):\n    return _device(x) + torch.ones(1) + len(x)\n\ndef g():\n    return f\n"
    assert undefined_globals(src, "m.py") == ["3 f: _device"]
    assert undefined_globals("globals()['h'] = 1\ndef k():\n    return h\n", "m.py") == []


def test_the_check_finds_an_import_of_a_moved_name() -> None:
    src = ("def f():\n    from cpkv.kernels.platform import capability, _device\n    import cpkv.kernels.nowhere\n"
           "from cpkv.kernels import grid, page_gather\nfrom cpkv.model import DSAModel\n")
    assert missing_imports(src) == ["2 cpkv.kernels.platform: _device", "3 cpkv.kernels.nowhere"]

"""The package's shape: no import cycle, the core never imports the harness, scheduling stays torch-free, the
kernels import nothing above them.

Imports are read from the source (every ``import`` statement, including those inside functions and under
``TYPE_CHECKING``), so a lazy import that would close a cycle counts as much as a top-level one.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import cpkv

ROOT = Path(cpkv.__file__).parent
HARNESS = ("cpkv.cli", "cpkv.bench", "cpkv.serve", "cpkv.__main__")
TORCH_FREE = ("cpkv.layout", "cpkv.config", "cpkv.envs", "cpkv.errors", "cpkv.files", "cpkv.scheduler",
              "cpkv.engine.protocol", "cpkv.serve.protocol",
              "cpkv.kvcache.allocator", "cpkv.kvcache.prefix_cache", "cpkv.kvcache.manager", "cpkv.memplan",
              "cpkv.model.config", "cpkv.model.checkpoint")


def _name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imports(name: str) -> set[str]:
    """Modules of cpkv that ``name``'s source imports (a submodule when ``from pkg import sub`` names one)."""
    tree = ast.parse(MODULES[name].read_text())
    is_pkg = MODULES[name].name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join(pkg + ([base] if base else []))
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
            out.update(subs or [base])
            if len(subs) < len(node.names):
                out.add(base)
    return {m for m in out if m in MODULES and m != name}


GRAPH = {name: _imports(name) for name in MODULES}


def _is(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_walk_sees_the_packages():
    assert {"cpkv.layout", "cpkv.compose.runtime", "cpkv.kvcache.manager", "cpkv.cli", "cpkv.bench.compose"} <= set(MODULES)
    assert "cpkv.compose.plan" in GRAPH["cpkv.compose.runtime"]


def test_no_import_cycle():
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(GRAPH[m]):
            if state.get(n) == 1:
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(n):] + [n]))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)


@pytest.mark.parametrize("name", sorted(m for m in MODULES if not _is(m, HARNESS)))
def test_core_never_imports_the_harness(name):
    bad = sorted(m for m in GRAPH[name] if _is(m, HARNESS))
    assert not bad, f"{name} (core) imports the harness: {bad}"


@pytest.mark.parametrize("name", sorted(m for m in MODULES if _is(m, TORCH_FREE)))
def test_scheduling_and_layout_never_import_torch(name):
    tree = ast.parse(MODULES[name].read_text())
    mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(m == "torch" or m.startswith("torch.") for m in mods), f"{name} imports torch"
    closure, todo = set(), [name]
    while todo:
        for n in GRAPH[todo.pop()] - closure:
            closure.add(n)
            todo.append(n)
    assert all(_is(m, TORCH_FREE) for m in closure), (
        f"{name} reaches torch-using modules: {sorted(m for m in closure if not _is(m, TORCH_FREE))}")


KERNEL_LEAVES = ("cpkv.envs", "cpkv.errors", "cpkv.config")  # torch-free leaf modules the kernels may read


@pytest.mark.parametrize("name", sorted(m for m in MODULES if _is(m, ("cpkv.kernels",))))
def test_kernels_import_nothing_above_them(name):
    """A kernel, its reference and the platform facts sit at the bottom of the house: attention, indexer, model,
    compose and engine import them, never the other way round."""
    above = sorted(m for m in GRAPH[name] if not _is(m, ("cpkv.kernels",) + KERNEL_LEAVES))
    assert not above, f"{name} imports {above} (above cpkv.kernels)"


def test_kernel_leaves_are_leaves():
    """The modules the kernels may read import only each other."""
    for name in KERNEL_LEAVES:
        assert GRAPH[name] <= set(KERNEL_LEAVES), f"{name} imports {sorted(GRAPH[name] - set(KERNEL_LEAVES))}"


def test_benchmarks_use_public_names_only():
    """benchmarks/ experiments import no underscore name from cpkv."""
    bench_dir = ROOT.parent.parent / "benchmarks"
    if not bench_dir.is_dir():
        pytest.skip("no benchmarks/ folder beside src/ (installed package)")
    for path in sorted(bench_dir.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("cpkv"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{path.name} imports private names {private} from {node.module}"


ENGINE = sorted(n for n in MODULES if n == "cpkv.engine" or n.startswith("cpkv.engine."))
MAX_METHODS = 25  # public and private methods of one class (the harness's commands and benchmarks aside)


def _classes(name: str) -> list[ast.ClassDef]:
    tree = ast.parse(MODULES[name].read_text(), filename=str(MODULES[name]))
    return [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]


def test_engine_classes_compose_rather_than_inherit():
    """No class of ``cpkv.engine`` inherits another engine class: the drivers are composed around the executor."""
    mine = {c.name for n in ENGINE for c in _classes(n)}
    bad = [f"{n}.{c.name}({ast.unparse(b)})" for n in ENGINE for c in _classes(n) for b in c.bases
           if ast.unparse(b).split(".")[-1] in mine]
    assert not bad, bad


@pytest.mark.parametrize("name", ENGINE)
def test_engine_classes_stay_small(name):
    """Each ``cpkv.engine`` class has at most MAX_METHODS methods (scoped to the engine: other core packages still
    hold larger classes)."""
    big = {c.name: n for c in _classes(name)
           if (n := sum(isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) for f in c.body)) > MAX_METHODS}
    assert not big, big

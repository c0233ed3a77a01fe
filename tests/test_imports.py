"""The project's import graph has no cycle, and no test imports a benchmark script.

Every module of ling_jax, pallas_kernels, conversion and experiments is parsed (not imported); each import
statement, at module or function level, adds an edge to the project module it loads. Benchmark scripts import
each other as top-level names (`from common import ...`, run with experiments/ on sys.path), so those count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ling_jax", "pallas_kernels", "conversion")


def module_files() -> dict[str, Path]:
    """Module name -> file: packages by dotted path (a package is its __init__), experiments scripts by stem."""
    mods = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            parts = f.relative_to(ROOT).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    for f in sorted((ROOT / "experiments").glob("*.py")):
        mods[f.stem] = f
    return mods


def targets(node: ast.AST, module: str, is_package: bool, mods) -> list[str]:
    """The project modules an import statement loads: `import a.b` -> a.b; `from a import b` -> the submodule a.b
    when there is one, else a (b is an attribute of it); relative imports from the module's package."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in mods]
    src = node.module
    if node.level:  # a package's own __init__ is its package; each level above that goes one package up
        base = module.split(".")[:len(module.split(".")) - (not is_package) - (node.level - 1)]
        src = ".".join(base + ([node.module] if node.module else []))
    return [f"{src}.{a.name}" if f"{src}.{a.name}" in mods else src for a in node.names
            if f"{src}.{a.name}" in mods or src in mods]


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere in its body (functions included)."""
    graph = {}
    for name, path in mods.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges.update(targets(node, name, path.name == "__init__.py", mods))
        graph[name] = edges - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first search, iterative)."""
    state = {}  # 1: on the current path, 2: done
    for root in sorted(graph):
        if state.get(root):
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_find_cycle_on_small_graphs():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"b2"}, "b2": {"b"}}) == ["b", "b2", "b"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_targets_resolve_import_forms():
    mods = {"p", "p.q", "p.q.m", "p.q.b", "p.d", "common"}
    code = ("import p.q.b\nimport numpy\nfrom p.q import b, attr\nfrom . import b\nfrom .b import x\n"
            "from .. import d\nfrom common import f\n")
    got = [targets(n, "p.q.m", False, mods) for n in ast.parse(code).body]
    assert got == [["p.q.b"], [], ["p.q.b", "p.q"], ["p.q.b"], ["p.q.b"], ["p.d"], ["common"]]
    assert targets(ast.parse("from . import b").body[0], "p.q", True, mods) == ["p.q.b"]  # in p/q/__init__.py


def test_import_graph_of_the_project():
    graph = import_graph(module_files())
    assert "common" in graph["bench_moe"]  # experiments scripts import each other as top-level names
    assert {"ling_jax.profiling", "pallas_kernels.kda", "pallas_kernels.mla.decode"} <= graph["profile_ops"]
    assert "pallas_kernels.kda.dispatch" in graph["pallas_kernels.kda"]
    assert "ling_jax.profiling" in graph["ling_jax.bench"]  # imported inside profile_step only


def test_no_import_cycle():
    cycle = find_cycle(import_graph(module_files()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_tests_import_no_experiments_script():
    """Tests import the library, never a benchmark script (scripts import tests' helpers nowhere either)."""
    scripts = {f.stem for f in (ROOT / "experiments").glob("*.py")}
    bad = []
    for f in sorted((ROOT / "tests").rglob("*.py")):
        tree = ast.parse(f.read_text(), str(f))
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bad += [f"{f.name}: import {n}" for n in names if n.split(".")[0] in scripts | {"experiments"}]
            if isinstance(node, ast.Call) and ast.unparse(node.func).startswith("sys.path.") \
                    and "experiments" in ast.unparse(node):
                bad.append(f"{f.name}: {ast.unparse(node)}")
    assert not bad, bad

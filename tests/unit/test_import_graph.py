"""No import cycles in the serving packages, function-level imports counted, and function-level
imports only where a dependency is optional or heavy.

grimp (the graph import-linter builds its contracts on) reads every import statement, those in
functions and under `if TYPE_CHECKING:` too: a cycle hidden in a function is still a cycle. A
shared name belongs below both modules that need it (an errors module, the module that owns a
constant, a protocol), never in an import moved into a function.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("cluster", "prefill", "decode", "router", "proto", "kernels")

# The function-level imports left, by module, and why each is lazy. Each is a dependency that is
# optional (not installed everywhere) or heavy to import where the module must stay light: the
# command line's start-up and the router's modules import neither torch nor Ray.
LAZY_IMPORTS = {
    "cluster/config.py": "converting a GGUF file imports torch and gguf: only when one is served",
    "cluster/kv/disk_io.py": "nixl is optional (the nixl extra)",
    "cluster/transfer/nixl_transport.py": "nixl is optional (the nixl extra)",
    "cluster/transfer/ucx_transport.py": "ucxx is optional (the ucx extra)",
    "cluster/launch/worker_actors.py": "Ray reads its RAY_* settings at import: imported after ray_environment sets them",
    "cluster/worker_base.py": "Ray reads its settings at import: the driver imports the workers before it sets them",
    "cluster/metrics.py": "Ray: the router's modules import none (only the driver sums actor frontends' series)",
    "router/health.py": "Ray: the router's modules import none",
    "router/structured.py": "xgrammar (cluster/engine/grammar.py) imports torch: the router checks grammars only when asked",
    "cluster/launch/cli.py": "the commands import torch, Ray or gRPC: not for --help or a refused setting",
    "cluster/launch/preflight.py": "torch: only to check --device cuda (the command line starts without it)",
    "cluster/types.py": "torch: the router imports these types without it",
    "cluster/engine/grammar.py": "xgrammar imports transformers (seconds of every worker's start): on the first grammar",
    "cluster/model/kernel_plan.py": "torch: cluster.config and the router hold kernel plans without it",
    "cluster/model/gguf_import.py": "transformers is heavy: only when a GGUF file is converted",
    "cluster/model/attention.py": "Triton is optional (the kernels extra)",
    "cluster/model/linear.py": "Triton is optional (the kernels extra): CUDA only",
    "cluster/model/ops.py": "Triton is optional (the kernels extra): CUDA only",
    "cluster/model/quant_linear.py": "Triton is optional (the kernels extra): CUDA only",
    "cluster/model/moe.py": "Triton is optional (the kernels extra): CUDA only",
}
MAX_LAZY_IMPORTS = 22
# What stays out of a module's import: the command line starts (parse, check, --help) without
# torch, Ray or gRPC; the frontend without torch or Ray; and the driver, which imports every role,
# imports Ray only once ray_environment has set its settings (Ray reads them at import).
LIGHT_MODULES = {"cluster.launch.cli": ("torch", "ray", "grpc", "numpy", "transformers"),
                 "router.frontend": ("torch", "ray", "xgrammar"),
                 "cluster.launch.app": ("ray",)}


def _cycles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
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
    return sorted(found)


def _edges(graph, component: list[str]) -> list[str]:
    members = set(component)
    out = []
    for importer in component:
        for imported in sorted(graph.find_modules_directly_imported_by(importer) & members):
            lines = sorted({d["line_number"] for d in graph.get_import_details(importer=importer, imported=imported)})
            out.append(f"    {importer} -> {imported} (line {', '.join(map(str, lines))})")
    return out


def function_level_imports(root: Path = ROOT) -> list[tuple[str, int, str]]:
    """(file, line, module) of every import statement inside a function of the serving packages."""
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for inner in node.body:
                    for stmt in ast.walk(inner):
                        if isinstance(stmt, ast.Import):
                            found += [(path.relative_to(root).as_posix(), stmt.lineno, a.name) for a in stmt.names]
                        elif isinstance(stmt, ast.ImportFrom):
                            found.append((path.relative_to(root).as_posix(), stmt.lineno, stmt.module or "."))
    return sorted(set(found))


def test_no_import_cycles():
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    cycles = _cycles(graph)
    report = [f"{len(c)} modules: {', '.join(c)}\n" + "\n".join(_edges(graph, c)) for c in cycles]
    assert not cycles, f"{len(cycles)} import cycles (move the shared names below both):\n" + "\n".join(report)


def test_function_level_imports_only_for_optional_or_heavy_dependencies():
    found = function_level_imports()
    unlisted = [f"{f}:{line} {module}" for f, line, module in found if f not in LAZY_IMPORTS]
    assert not unlisted, ("function-level imports outside LAZY_IMPORTS (import at module level; where that makes "
                          "a cycle, move the shared names down):\n" + "\n".join(unlisted))
    assert len(found) <= MAX_LAZY_IMPORTS, (f"{len(found)} function-level imports, at most {MAX_LAZY_IMPORTS}:\n"
                                            + "\n".join(f"{f}:{line} {module}" for f, line, module in found))
    stale = sorted(set(LAZY_IMPORTS) - {f for f, _, _ in found})
    assert not stale, f"LAZY_IMPORTS names modules without a function-level import: {stale}"


def test_light_modules_stay_light():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    for module, heavy in LIGHT_MODULES.items():
        code = f"import sys, {module}; print(' '.join(m for m in {heavy!r} if m in sys.modules))"
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split() == [], f"importing {module} imports {out.stdout.strip()}"

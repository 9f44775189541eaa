"""What the wheel ships serves: its packages import no training code.

The packages are pyproject's (`[tool.setuptools.packages.find]`); bench/ (the offline trainers
and their data) stays out of the wheel, and no module of the wheel imports it, function-level
imports included. The served block drafter and the heads' modules reach nothing of online
adaptation either (its trainer and what it trains with live in decode/spec/online/).
"""
from __future__ import annotations

import tomllib
from pathlib import Path

import grimp
from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[2]
SERVED_MODELS = ("decode.spec.block", "decode.spec.heads")
TRAINING = ("bench", "decode.spec.online")


def _wheel_patterns() -> list[str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]


def _serving_packages() -> list[str]:
    return sorted({pattern.rstrip("*").rstrip(".") for pattern in _wheel_patterns()})


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_wheel_leaves_bench_and_tests_out():
    packages = find_packages(where=str(ROOT), include=_wheel_patterns())
    assert "decode.spec.heads" in packages and "router" in packages
    assert not [p for p in packages if _within(p, "bench") or _within(p, "tests")], packages


def test_no_serving_module_imports_bench():
    serving = _serving_packages()
    graph = grimp.build_graph(*serving, "bench", cache_dir=None)
    wrong = sorted(f"{module} imports {imported}"
                   for module in graph.modules if module.split(".")[0] in serving
                   for imported in graph.find_modules_directly_imported_by(module) if _within(imported, "bench"))
    assert not wrong, wrong


def test_the_served_drafter_and_the_heads_reach_no_training_module():
    graph = grimp.build_graph(*_serving_packages(), "bench", cache_dir=None)
    for served in SERVED_MODELS:
        modules = {m for m in graph.modules if _within(m, served)}
        reached = set().union(*(graph.find_upstream_modules(m) for m in modules))
        wrong = sorted(m for m in reached if any(_within(m, t) for t in TRAINING))
        assert not wrong, f"{served} imports training code: {wrong}"

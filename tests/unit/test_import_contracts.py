"""The layering holds: import-linter's contracts (pyproject.toml, [tool.importlinter]) pass.

The core (every module of `cluster` but the wiring, `cluster.launch`) imports no role and not the
wiring; the roles (`prefill`, `decode`, `router`) import no wiring and none of each other.
"""
from __future__ import annotations

import os
import pkgutil
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _contracts() -> list[dict]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def test_the_core_contract_names_every_module_of_cluster_but_the_wiring():
    core = next(c for c in _contracts() if "cluster.launch" in c.get("forbidden_modules", ()))
    modules = {f"cluster.{m.name}" for m in pkgutil.iter_modules([str(ROOT / "cluster")])}
    assert set(core["source_modules"]) == modules - {"cluster.launch"}


def test_import_contracts_hold():
    exe = shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports not found: install the test extra (pip install -e .[test])")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    # --no-cache: a stale cache from another checkout must not answer for this one.
    out = subprocess.run([exe, "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "broken" in out.stdout and " 0 broken" in out.stdout, out.stdout[-2000:]

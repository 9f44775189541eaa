"""splitserve's version (cluster/version.py): the installed package's, else the checkout's pyproject."""
from __future__ import annotations

import importlib.metadata
import tomllib

from cluster.version import PYPROJECT, pyproject_version, splitserve_version


def test_the_installed_version_is_the_checkouts_pyproject_version():
    declared = tomllib.loads(PYPROJECT.read_text())["project"]["version"]
    assert pyproject_version(PYPROJECT) == declared
    assert splitserve_version() == importlib.metadata.version("splitserve")


def test_without_metadata_the_pyproject_answers(tmp_path, monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(importlib.metadata, "version", missing)
    splitserve_version.cache_clear()
    try:
        assert splitserve_version() == pyproject_version(PYPROJECT)
    finally:
        splitserve_version.cache_clear()
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\nversion = "9.8.7"\n')
    assert pyproject_version(tmp_path / "pyproject.toml") == "9.8.7"
    assert pyproject_version(tmp_path / "missing.toml") == "unknown"
    (tmp_path / "bad.toml").write_text("[project\n")
    assert pyproject_version(tmp_path / "bad.toml") == "unknown"

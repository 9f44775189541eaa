"""splitserve's version: one answer for `splitserve --version`, the ServerInfo RPC and `GET /version`.

The installed package's metadata first; a checkout that runs without being installed reads its
own pyproject.toml.
"""
from __future__ import annotations

import functools
import importlib.metadata
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


@functools.cache
def splitserve_version() -> str:
    try:
        return importlib.metadata.version("splitserve")
    except importlib.metadata.PackageNotFoundError:
        return pyproject_version(PYPROJECT)


def pyproject_version(path: Path) -> str:
    try:
        return tomllib.loads(path.read_text())["project"]["version"]
    except (OSError, KeyError, TypeError, tomllib.TOMLDecodeError):
        return "unknown"

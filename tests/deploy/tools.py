"""External tools the deployment tests run. A test skips only when its tool is missing here AND
.ci/run installs it, so in CI every one of these tests runs."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def require(tool: str, installed_by: str) -> str:
    """The tool's path; skip if absent but CI installs it: `installed_by` is a Debian package named in
    .ci/run or a PyPI package of the project's extras (which .ci/run installs)."""
    path = shutil.which(tool)
    if path:
        return path
    if installed_by not in (ROOT / ".ci" / "run").read_text() + (ROOT / "pyproject.toml").read_text():
        pytest.fail(f"{tool} is missing and .ci/run does not install it ({installed_by})")
    pytest.skip(f"{tool} is not installed here; `bash .ci/run` installs it ({installed_by})")

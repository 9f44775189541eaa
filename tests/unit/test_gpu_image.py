"""The GPU check runs on the device machine's own image: torch, Triton, transformers and pytest,
but no Ray, NIXL, UCX, Starlette, uvicorn, openai or cryptography. Every Python entry point of
bench/gpu_check.sh must import (and its CUDA test files collect) with those packages absent,
here simulated by an import hook that refuses them."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ABSENT = ("ray", "nixl", "ucxx", "starlette", "uvicorn", "openai", "cryptography", "grpc_health", "grpc_reflection")
CUDA_TESTS = ("tests/unit/test_kv_checksums.py", "tests/unit/test_lazy_checkpoint.py",
              "tests/integration/test_device_placement.py", "tests/integration/test_decode_graphs.py",
              "tests/unit/test_cuda_ipc.py", "tests/integration/test_cuda_exactness.py")
SCRIPTS = ("kernel_speed", "engine_vs_transformers", "determinism", "transfer")

PRELUDE = textwrap.dedent(f"""
    import importlib.abc, importlib.util, sys
    class Absent(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {ABSENT!r}:
                raise ImportError(f"{{name}} is not on the GPU image")
    sys.meta_path.insert(0, Absent())
    sys.modules.pop("ray", None)
    sys.path[:0] = [{str(REPO)!r}, {str(REPO / "tests")!r}, {str(REPO / "bench")!r}]
""")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(code)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


def test_the_check_scripts_import_without_the_cluster_packages():
    proc = _run(f"""
        import importlib.util
        for name in {SCRIPTS!r}:
            spec = importlib.util.spec_from_file_location(name, {str(REPO / "bench")!r} + f"/{{name}}.py")
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
        import cluster.engine.engine, cluster.transfer.cuda_ipc, decode.spec.speculator
        import kernels.backend, kernels.batch_invariant
        print("imported")
    """)
    assert proc.returncode == 0 and "imported" in proc.stdout, proc.stderr[-3000:]


def test_the_cuda_tests_collect_without_the_cluster_packages():
    proc = _run(f"""
        import pytest
        raise SystemExit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "-m", "cuda",
                                      *{CUDA_TESTS!r}]))
    """)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "error" not in proc.stdout.lower()
    collected = [line for line in proc.stdout.splitlines() if "::" in line]
    assert len(collected) >= 5, proc.stdout   # the CUDA cases themselves, selected by their mark

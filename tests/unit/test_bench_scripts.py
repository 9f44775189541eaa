"""The bench scripts run as scripts: Python puts bench/ first on sys.path, so a script named like
one of the project's packages would shadow it for every other script (bench/kernels.py once hid
the `kernels` package, and bench/engine_vs_transformers.py could not import on any machine)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tiny_models import make_model

REPO = Path(__file__).resolve().parents[2]


def test_no_bench_script_shadows_a_package():
    packages = {p.name for p in REPO.iterdir() if (p / "__init__.py").exists()}
    assert {"cluster", "kernels", "router"} <= packages
    scripts = {p.stem for p in (REPO / "bench").glob("*.py")}
    assert not scripts & packages, f"bench scripts named like packages: {sorted(scripts & packages)}"


def test_engine_vs_transformers_runs_as_a_script(tmp_path):
    """The GPU check's engine step, on a tiny checkpoint on the CPU: it imports, runs ours beside
    transformers and prints both rates and the time to first token."""
    model = make_model(tmp_path / "m", "llama")
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "engine_vs_transformers.py"), "--model", str(model), "--dtype", "float32",
         "--batches", "2", "--prompt-len", "12", "--new-tokens", "4", "--repeats", "1", "--threads", "1"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = [line for line in proc.stdout.splitlines() if line.strip().startswith("2 |")]
    assert len(rows) == 1, proc.stdout
    # Ours and transformers' decode and prefill rates and their ratios: six numbers (their values
    # are timings of 4 tokens on a shared CPU, so noise can even make a decode rate negative).
    figures = [float(x) for x in rows[0].split("|")[1:]]
    assert len(figures) == 6, rows[0]
    assert "TTFT, 254-token prompt" in proc.stdout

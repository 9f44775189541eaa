"""The ahead-of-time compile check (kernels/compile_check.py) under one or more Triton versions,
side by side: the installed one, and others in throwaway virtual environments, so that version
drift (the GPU machine's image has Triton 3.6, we pin 3.9) is found on a CPU, not on the device.

    python bench/compile_check.py                        # the installed Triton and 3.6.0, suite subset
    python bench/compile_check.py --full --jobs 2        # the whole matrix (~1,200 specializations)
    python bench/compile_check.py --triton 3.6.0 --json out.json

A version other than the installed one gets a venv with --system-site-packages (so torch, the
CPU wheel on disk, is shared) and `pip install triton==VERSION` over it; venvs are kept in
--venv-root (default ~/.cache/splitserve/triton-venvs) and reused. Each version compiles into its
own Triton cache. Prints every failure, then one line per version: compiled, failed, spilling
specializations, the largest shared memory and register counts.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def installed_triton() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def python_for(version: str, venv_root: Path) -> str:
    """This interpreter for the installed version; otherwise a venv's, made once."""
    if version == installed_triton():
        return sys.executable
    path = venv_root / f"triton-{version}"
    py = path / "bin" / "python"
    if not py.exists():
        print(f"# making a venv with triton {version} in {path}", flush=True)
        venv.EnvBuilder(system_site_packages=True, with_pip=True).create(path)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", f"triton=={version}"],
                       check=True)
    return str(py)


def run_check(version: str, py: str, full: bool, jobs: int, out: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env["TRITON_CACHE_DIR"] = str(Path.home() / ".cache" / "splitserve" / f"triton-aot-{version}")
    cmd = [py, "-m", "kernels.compile_check", "--jobs", str(jobs), "--json", str(out)] + (["--full"] if full else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if not out.exists():
        raise SystemExit(f"triton {version}: the check wrote no report (rc {proc.returncode}):\n"
                         f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    report = json.loads(out.read_text())
    report["returncode"] = proc.returncode
    return report


def summary(report: dict) -> str:
    reports = report["reports"]
    failed = [r for r in reports if r["problems"]]
    spill = [r for r in reports if not r["error"] and r["spill_bytes"]]
    worst_regs = max((r["registers"] or 0) for r in reports)
    worst_shared = max((r["shared_bytes"] or 0) for r in reports)
    seconds = sum(r["seconds"] for r in reports)
    return (f"triton {report['triton']:<7} {len(reports) - len(failed):>5} ok {len(failed):>4} failed "
            f"{len(spill):>4} spill | max {worst_regs} registers, {worst_shared} B shared | "
            f"{seconds:.0f} s of compile | uncovered: {', '.join(report['uncovered']) or 'none'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--triton", nargs="+", default=None, help="versions (default: the installed one and 3.6.0)")
    ap.add_argument("--full", action="store_true", help="the whole matrix, not the test suite's subset")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--venv-root", type=Path, default=Path.home() / ".cache" / "splitserve" / "triton-venvs")
    ap.add_argument("--json", type=Path, default=None, help="every version's reports in one file")
    args = ap.parse_args()
    versions = args.triton or [v for v in (installed_triton(), "3.6.0") if v]
    versions = list(dict.fromkeys(versions))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for version in versions:
            report = run_check(version, python_for(version, args.venv_root), args.full, args.jobs,
                               Path(tmp) / f"{version}.json")
            results[version] = report
            for r in report["reports"]:
                if r["problems"]:
                    print(f"FAIL triton {version}: {r['label']}: {'; '.join(r['problems'])}", flush=True)
            print(summary(report), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0 if all(r["returncode"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

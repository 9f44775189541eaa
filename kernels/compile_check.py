"""Ahead-of-time compilation of the Triton kernels for a GPU, on any machine (no GPU needed).

The interpreter (TRITON_INTERPRET=1, what the CPU tests run) accepts code the compiler refuses,
and cannot tell how many registers, spills or bytes of shared memory a config costs. This module
compiles kernels with Triton's real compiler for a CUDA target (sm_90 by default) with the ptxas
in Triton's wheel, and reads each cubin's resource usage with its cuobjdump.

What gets compiled is recorded, not written down: `record_launches` swaps every launchable kernel
of the package for a recorder, the host code (the attention backend on the meta device, the
batch-invariant matmul and norm) runs as the engine would, and each `kernel[grid](...)` call
becomes a `Launch` (its signature, constexprs, warps and stages; an autotuned kernel becomes one
launch per config of its search space). `kernels/compile_cases.py` holds the steps to record;
`python -m kernels.compile_check` compiles them (tests/kernels/test_compile.py a subset,
bench/compile_check.py the whole matrix, also under another Triton in a throwaway venv).

Must run where TRITON_INTERPRET is unset: the kernels' search spaces and tile sizes are the
interpreter's otherwise (they are chosen when the modules are imported).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import importlib
import json
import multiprocessing
import os
import re
import signal
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import compile_cases
from kernels.launch_record import Launch, _jit_of, launchable_kernels, uncovered  # noqa: F401 (launchable_kernels: re-exported)


@dataclass(frozen=True)
class GpuLimits:
    name: str
    arch: int
    max_shared_bytes: int     # dynamic shared memory one block may opt into
    max_registers: int        # per thread
    num_sms: int              # what the split-KV plan assumes on this target


HOPPER = GpuLimits("sm_90 (H100/H200 SXM)", 90, 232_448, 255, 132)


@dataclass(frozen=True)
class CompileReport:
    launch: Launch
    seconds: float
    registers: int | None = None
    spill_bytes: int | None = None     # the thread's stack frame: registers spilled to local memory
    shared_bytes: int | None = None
    error: str | None = None

    def problems(self, limits: GpuLimits = HOPPER) -> list[str]:
        """What makes this specialization unlaunchable on the target (spills only cost speed)."""
        if self.error:
            return [self.error]
        out = []
        if self.shared_bytes is not None and self.shared_bytes > limits.max_shared_bytes:
            out.append(f"{self.shared_bytes} B of shared memory > {limits.max_shared_bytes} B on {limits.name}")
        if self.registers is not None and self.registers > limits.max_registers:
            out.append(f"{self.registers} registers > {limits.max_registers}")
        return out


# --- compiling ----------------------------------------------------------------------------------
def _cuobjdump() -> str:
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return knobs.nvidia.cuobjdump.path
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers, stack bytes) of a cubin's kernel, from cuobjdump -res-usage."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([_cuobjdump(), "-res-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    match = re.search(r"REG:(\d+) STACK:(\d+)", text)
    if match is None:
        raise RuntimeError(f"cannot read cuobjdump's resource usage: {text[-300:]}")
    return int(match.group(1)), int(match.group(2))


def compile_launch(launch: Launch, limits: GpuLimits = HOPPER) -> CompileReport:
    """Compile one launch for the target; a compiler error is reported, not raised."""
    mod_name, name = launch.kernel.rsplit(".", 1)
    fn = _jit_of(getattr(importlib.import_module(mod_name), name))
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in launch.aligned}
    src = ASTSource(fn, dict(launch.signature), dict(launch.constexprs), attrs)
    t0 = time.perf_counter()
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", limits.arch, 32),
                                  options=dict(num_warps=launch.num_warps, num_stages=launch.num_stages))
        regs, stack = resource_usage(compiled.asm["cubin"])
    except Exception as exc:   # noqa: BLE001  (every compiler failure is this check's finding)
        message = str(exc).strip().splitlines()
        return CompileReport(launch, time.perf_counter() - t0,
                             error=f"{type(exc).__name__}: {' / '.join(message[-3:])[:400]}")
    return CompileReport(launch, time.perf_counter() - t0, regs, stack, int(compiled.metadata.shared))


# --- the command line ---------------------------------------------------------------------------
def _compile_in_worker(launch: Launch) -> CompileReport:
    return compile_launch(launch)


def _die_with_parent() -> None:
    """A worker ends with the check (a timeout kills the check, not the pool's queue)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        pass


def compile_all(launches: list[Launch], jobs: int, progress=None) -> list[CompileReport]:
    """Compile in `jobs` fresh processes (spawned: no interpreter flag, no state of the caller)."""
    reports = []
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=_die_with_parent) as pool:
        for report in pool.map(_compile_in_worker, launches, chunksize=1):
            reports.append(report)
            if progress is not None:
                progress(report)
    return reports


def format_report(r: CompileReport, limits: GpuLimits = HOPPER) -> str:
    problems = r.problems(limits)
    if r.error:
        figures = "compile failed"
    else:
        figures = f"{r.registers:>3} regs {r.spill_bytes:>5} B stack {r.shared_bytes:>6} B shared"
    status = "FAIL" if problems else ("spill" if r.spill_bytes else "ok")
    tail = f"  <- {'; '.join(problems)}" if problems else ""
    return f"{status:<5} {r.seconds:5.1f}s {figures}  {r.launch.label()}{tail}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--full", action="store_true", help="the whole matrix (default: the test suite's subset)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", default=None, help="write every report to this file")
    ap.add_argument("--list", action="store_true", help="print the launches, compile nothing")
    args = ap.parse_args(argv)
    launches = compile_cases.all_launches() if args.full else compile_cases.suite_launches()
    kernels = sorted({launch.kernel for launch in launches})
    print(f"# triton {triton.__version__}, torch {torch.__version__}, target {HOPPER.name}: "
          f"{len(launches)} specializations of {len(kernels)} kernels", flush=True)
    missing = uncovered(launches)
    if missing:
        print(f"# FAIL: no compile case launches {', '.join(missing)} (add one to kernels/compile_cases.py)")
    if args.list:
        for launch in launches:
            print(launch.label())
        return 1 if missing else 0
    t0 = time.perf_counter()
    reports = compile_all(launches, max(1, args.jobs), lambda r: print(format_report(r), flush=True))
    failed = [r for r in reports if r.problems()]
    spilled = [r for r in reports if not r.error and r.spill_bytes]
    print(f"# {len(reports) - len(failed)} compiled within {HOPPER.name}'s limits, {len(failed)} failed, "
          f"{len(spilled)} spill; {time.perf_counter() - t0:.0f} s with {args.jobs} jobs; "
          f"max shared {max((r.shared_bytes or 0) for r in reports)} B", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(triton=triton.__version__, target=HOPPER.name, kernels=kernels, uncovered=missing,
                           reports=[dict(asdict(r), label=r.launch.label(), problems=r.problems()) for r in reports]),
                      f, indent=1, default=str)
    return 1 if failed or missing else 0


if __name__ == "__main__":
    raise SystemExit(main())

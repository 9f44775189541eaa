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

import contextlib
import importlib
import os
import pkgutil
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass

import torch
import triton

from kernels._common import interpreting


@dataclass(frozen=True)
class GpuLimits:
    name: str
    arch: int
    max_shared_bytes: int     # dynamic shared memory one block may opt into
    max_registers: int        # per thread
    num_sms: int              # what the split-KV plan assumes on this target


HOPPER = GpuLimits("sm_90 (H100/H200 SXM)", 90, 232_448, 255, 132)


@dataclass(frozen=True)
class Launch:
    """One specialization of one kernel, as its launch would compile it."""
    kernel: str                                  # "kernels.decode._split_kv_kernel"
    signature: tuple[tuple[str, str], ...]       # every argument: triton type or "constexpr"
    constexprs: tuple[tuple[str, object], ...]
    aligned: tuple[str, ...]                     # arguments divisible by 16 (pointers, strides)
    num_warps: int
    num_stages: int

    def label(self) -> str:
        shown = ", ".join(f"{k}={v}" for k, v in self.constexprs if not k.startswith("stride") and v is not None)
        pointer = next((t for _, t in self.signature if t.startswith("*")), "")
        return f"{self.kernel.rsplit('.', 1)[1]}[{pointer[1:]}; {shown}; w{self.num_warps} s{self.num_stages}]"


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


# --- which kernels exist ------------------------------------------------------------------------
def kernel_modules() -> list:
    """Every module of the package that defines Triton kernels (cpu_ops has none)."""
    import kernels
    mods = []
    for info in pkgutil.iter_modules(kernels.__path__):
        if info.name in ("cpu_ops", "compile_check", "compile_cases"):
            continue
        mods.append(importlib.import_module(f"kernels.{info.name}"))
    return mods


def _jit_of(obj):
    """The JITFunction behind a kernel object (an Autotuner wraps one), else None."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction
    if isinstance(obj, Autotuner):
        obj = obj.fn
    return obj if isinstance(obj, JITFunction) else None


def launchable_kernels() -> dict[str, object]:
    """"module.name" -> kernel object for every @triton.jit function of the package that no other
    jit function calls (those are device helpers, compiled inside their callers)."""
    found = {}
    for mod in kernel_modules():
        for name, obj in vars(mod).items():
            fn = _jit_of(obj)
            if fn is not None and fn.fn.__module__ == mod.__name__:
                found[f"{mod.__name__}.{name}"] = obj
    sources = {key: _jit_of(obj).src for key, obj in found.items()}
    called = {key for key in found
              if any(re.search(rf"\b{re.escape(key.rsplit('.', 1)[1])}\s*\(", src)
                     for other, src in sources.items() if other != key)}
    return {key: obj for key, obj in found.items() if key not in called}


# --- recording launches -----------------------------------------------------------------------
_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int32: "i32",
           torch.int64: "i64", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1"}


def _arg_type(value) -> tuple[str, bool]:
    """(triton type, divisible by 16) of a runtime argument, as Triton's JIT specializes it."""
    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[value.dtype], True   # torch's allocations are 16-byte aligned
    if isinstance(value, bool):
        return "i1", False
    if isinstance(value, int):
        return ("i32" if -2**31 <= value < 2**31 else "i64"), value % 16 == 0
    if isinstance(value, float):
        return "fp32", False
    raise TypeError(f"cannot type a kernel argument of {type(value).__name__}")


def launch_of(fn, args: tuple, kwargs: dict, num_warps: int, num_stages: int, kernel: str) -> Launch:
    names = fn.arg_names
    values = dict(zip(names, args))
    values.update((k, v) for k, v in kwargs.items() if k in names)
    missing = [n for n in names if n not in values]
    if missing:
        raise TypeError(f"{kernel}: no value for {missing}")
    constexpr_names = {names[i] for i in fn.constexprs}
    signature, constexprs, aligned = [], [], []
    for name in names:
        value = values[name]
        if name in constexpr_names or value is None or (type(value) is int and value == 1):
            signature.append((name, "constexpr"))   # Triton specializes ints equal to 1 as constants
            constexprs.append((name, value.value if isinstance(value, triton.language.constexpr) else value))
            continue
        ty, div16 = _arg_type(value)
        signature.append((name, ty))
        if div16:
            aligned.append(name)
    return Launch(kernel, tuple(signature), tuple(constexprs), tuple(aligned), num_warps, num_stages)


class _Recorder:
    """Stands in for a kernel object: `kernel[grid](*args, **kw)` records instead of launching."""

    def __init__(self, key: str, kernel, sink: list):
        self.key, self.kernel, self.sink = key, kernel, sink

    @property
    def fn(self):   # the JIT function under an autotuner, launched with a fixed config
        return _Recorder(self.key, self.kernel.fn, self.sink)

    def __getitem__(self, grid):
        return self._record

    def _record(self, *args, **kwargs) -> None:
        configs = getattr(self.kernel, "configs", None)
        fn = _jit_of(self.kernel)
        if configs is None:   # a plain JIT function: its launch options are in the call
            kw = dict(kwargs)
            warps, stages = kw.pop("num_warps", 4), kw.pop("num_stages", 3)
            self.sink.append(launch_of(fn, args, kw, warps, stages, self.key))
            return
        prune = getattr(self.kernel, "early_config_prune", None)
        if prune is not None and len(configs) > 1:   # as Autotuner.prune_configs does before tuning
            configs = prune(configs, dict(zip(fn.arg_names, args)), **kwargs)
        for cfg in configs:   # an autotuner compiles every config of its space
            self.sink.append(launch_of(fn, args, {**kwargs, **cfg.kwargs}, cfg.num_warps, cfg.num_stages, self.key))


@contextlib.contextmanager
def record_launches():
    """Within the block, every launchable kernel of the package records its launches into the
    yielded list instead of running."""
    if interpreting():
        raise RuntimeError("the compile check needs TRITON_INTERPRET unset: the kernels' GPU configs are chosen "
                           "at import")
    sink: list[Launch] = []
    swapped = []
    for key, kernel in launchable_kernels().items():
        mod = importlib.import_module(key.rsplit(".", 1)[0])
        name = key.rsplit(".", 1)[1]
        swapped.append((mod, name, kernel))
        setattr(mod, name, _Recorder(key, kernel, sink))
    try:
        yield sink
    finally:
        for mod, name, kernel in swapped:
            setattr(mod, name, kernel)


def unique(launches: list[Launch]) -> list[Launch]:
    return list(dict.fromkeys(launches))


def uncovered(launches: list[Launch]) -> list[str]:
    """Launchable kernels that none of `launches` compiles: a kernel added without a compile case."""
    return sorted(set(launchable_kernels()) - {launch.kernel for launch in launches})


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
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
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
    import ctypes
    import signal
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        pass


def compile_all(launches: list[Launch], jobs: int, progress=None) -> list[CompileReport]:
    """Compile in `jobs` fresh processes (spawned: no interpreter flag, no state of the caller)."""
    import concurrent.futures
    import multiprocessing
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
    import argparse
    import json
    from dataclasses import asdict
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--full", action="store_true", help="the whole matrix (default: the test suite's subset)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", default=None, help="write every report to this file")
    ap.add_argument("--list", action="store_true", help="print the launches, compile nothing")
    args = ap.parse_args(argv)
    from kernels import compile_cases
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

"""Recording what the compile check compiles (`kernels/compile_check.py`): which kernels of the
package can be launched, and `record_launches`, within which every `kernel[grid](...)` call
becomes a `Launch` (its signature, constexprs, warps and stages; an autotuned kernel becomes one
launch per config of its search space) instead of running. `kernels/compile_cases.py` holds the
steps to record; below both it and compile_check, which compiles what they record.
"""
from __future__ import annotations

import contextlib
import importlib
import pkgutil
import re
from dataclasses import dataclass

import torch
import triton
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import JITFunction

import kernels
from kernels._common import interpreting


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



# --- which kernels exist ------------------------------------------------------------------------
def kernel_modules() -> list:
    """Every module of the package that defines Triton kernels (cpu_ops has none)."""
    mods = []
    for info in pkgutil.iter_modules(kernels.__path__):
        if info.name in ("cpu_ops", "compile_check", "compile_cases", "launch_record"):
            continue
        mods.append(importlib.import_module(f"kernels.{info.name}"))
    return mods


def _jit_of(obj):
    """The JITFunction behind a kernel object (an Autotuner wraps one), else None."""
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

"""The fused CPU ops of `kernels/cpu/ops.c`, built at first use and called through ctypes (with
`cpu/quant.c`'s quantized linear, whose Python side is `kernels/cpu_quant.py`).

The library is compiled once per source and machine (gcc -O3 -march=native, about a second) into
the cache folder the engine passes (`SPLITSERVE_CACHE_DIR`, default `~/.cache/splitserve`) under a
name that hashes the sources, the flags, the CPU and torch's version, and renamed into place
atomically, so concurrent workers never load half a file. `cpu/parallel.cpp`, linked against
libtorch, splits rows between torch's own threads (at::parallel_for); without a C++ compiler the
ops run on one thread. Without a C compiler `load()` returns None and the engine keeps its torch ops (the kernel plan
only offers what is available). Tensors must be contiguous in their last dimension; callers pass
row strides explicitly.
"""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import inspect
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu") / "ops.c"
PARALLEL_SOURCE = SOURCE.with_name("parallel.cpp")   # ops.c's entry points over torch's thread pool
QUANT_SOURCE = SOURCE.with_name("quant.c")           # quantized-weight linear (kernels/cpu_quant.py)
DEQUANT_SOURCE = SOURCE.with_name("dequant.c")       # quantized weights to a dense matrix (prefill's GEMM)
KV_QUANT_SOURCE = SOURCE.with_name("kv_quant.c")     # stores into a quantized KV cache (--kv-cache-dtype)
MLA_SOURCE = SOURCE.with_name("mla.c")               # absorbed latent-attention decode (kernels/mla_decode.py)
PREFILL_SOURCE = SOURCE.with_name("prefill_attn.c")  # causal prefill attention (AVX-512 only)
QUANT_DOT_SOURCE = SOURCE.with_name("quant_dot.c")   # quantized linear for bf16 batches (AVX512_BF16 only)
C_SOURCES = (SOURCE, QUANT_SOURCE, KV_QUANT_SOURCE, DEQUANT_SOURCE, MLA_SOURCE, PREFILL_SOURCE, QUANT_DOT_SOURCE)
HEADERS = tuple(SOURCE.with_name(h) for h in ("bf16.h", "f16.h", "kv_quant.h", "quant_bh.h", "vexp.h"))   # included by the C files
# No FMA contraction: products and sums round where the torch code they replace rounds.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp-simd", "-fPIC", "-fno-math-errno")
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_KV_CODES = {torch.int8: 1, torch.uint8: 2}   # a quantized KV cache's arena dtype -> kv_quant.h's kvq
_I64, _F32, _P, _INT = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int
_SIGNATURES = {
    "ss_rms_norm": (_P, _I64, _P, _P, _P, _I64, _I64, _F32, _INT),
    "ss_rope": (_P, _I64, _P, _P, _P, _I64, _I64, _I64, _INT),
    "ss_decode_attention": (_P, _I64, _P, _P, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _F32, _P,
                            _INT, _INT),
    "ss_store_kv": (_P, _I64, _P, _I64, _P, _I64, _I64, _P, _P, _INT),
    "ss_store_kv_q": (_P, _I64, _P, _I64, _P, _I64, _I64, _I64, _P, _P, _INT, _INT),
    "ss_silu_mul": (_P, _P, _I64, _I64, _INT),
    "ss_linear": (_P, _I64, _P, _P, _I64, _I64, _I64, _P, _I64, _INT),
    "ss_qlinear": (_P, _I64, _P, _P, _P, _P, _I64, _I64, _I64, _P, _I64, _INT, _INT),
    "ss_qdequant": (_P, _P, _P, _I64, _I64, _I64, _I64, _P, _INT, _INT),
    "ss_masked_argmax": (_P, _I64, _P, _I64, _P, _P, _I64, _I64, _INT, _P, _P),
    "ss_mla_decode": (_P, _P, _P, _I64, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64, _I64, _F32, _P, _INT),
    "ss_prefill_attention": (_P, _I64, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _F32, _P, _INT),
}
LINEAR_MAX_ROWS = 8   # LIN_ROWS in ops.c: rows per weight pass (any number of rows is accepted)
# Entry points that exist only with parallel.cpp (the engine falls back to the separate ops).
_PARALLEL_ONLY = {
    "ss_decode_block": (_P, _I64, _P, _P, _P, _P, _P, _P, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64, _I64, _F32,
                        _P, _INT, _INT),
    "ss_decode_layer": (_P, _P, _P, _P, _P),
    "ss_moe_experts": (_P, _I64, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _P, _INT),
}


class SsQWeight(ctypes.Structure):
    """parallel.cpp's SsQWeight: a quantized linear layer's packed tensors and format code."""
    _fields_ = [("quants", _P), ("scales", _P), ("mins", _P), ("bias", _P), ("n", _I64), ("fmt", _I64)]


class SsLayer(ctypes.Structure):
    """parallel.cpp's SsLayer: one decoder layer's weights for ss_decode_layer."""
    _fields_ = [("ln1", _P), ("ln2", _P), ("eps", ctypes.c_double), ("window", _I64), ("cos_t", _P),
                ("sin_t", _P), ("qkv", SsQWeight), ("o", SsQWeight), ("gate_up", SsQWeight), ("down", SsQWeight)]


class SsDecodePass(ctypes.Structure):
    """parallel.cpp's SsDecodePass: a pure-decode pass's shapes, metadata and scratch rows."""
    _fields_ = [(name, _I64) for name in ("batch", "hidden", "hq", "hkv", "dim", "inter", "block_size",
                                          "max_blocks", "kvq", "dtype")] + \
               [("scale", ctypes.c_double)] + \
               [(name, _P) for name in ("positions", "slots", "tables", "lens", "h", "qkv", "attn", "y", "gate_up",
                                        "act")]


_fns: dict[str, ctypes._CFuncPtr] = {}   # op name -> the parallel entry point where built, else the serial one
_lib: ctypes.CDLL | None = None
_tried = False


def cpu_signature() -> str:
    """The CPU's model name and flags: what -march=native compiles for, and what a measured
    kernel choice depends on."""
    model, flags = platform.processor(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model.strip():
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}|{flags}"


def native_bf16() -> bool:
    """The CPU multiplies bfloat16 in hardware (AVX-512 BF16 or AMX): there bf16 halves the bytes a
    decode step reads at no extra compute; elsewhere torch emulates it, slower than float32."""
    flags = cpu_signature().rsplit("|", 1)[-1].split()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def supports(dtype: torch.dtype) -> bool:
    return dtype in _DTYPE_CODES


def _build(folder: Path) -> Path | None:
    """ops.c and quant.c plus, where torch's headers and a C++ compiler are there, parallel.cpp;
    the name hashes the sources, this recipe, the CPU and torch's version."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cc is None:
        log.info("no C compiler: fused CPU ops unavailable, torch ops only")
        return None
    torch_dir = Path(torch.__file__).parent
    key = hashlib.sha256(inspect.getsource(_build).encode() + " ".join(FLAGS).encode()
                         + b"".join(src.read_bytes() for src in (*C_SOURCES, PARALLEL_SOURCE, *HEADERS))
                         + cpu_signature().encode() + torch.__version__.encode()).hexdigest()[:16]
    target = folder / "cpu_ops" / f"ops-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("building the fused CPU ops into %s (once)", target,
             extra={"phase": "building the CPU kernels (first start only)"})
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = [str(Path(tmp) / f"{src.stem}.o") for src in C_SOURCES]
        par, built = Path(tmp) / "parallel.o", Path(tmp) / target.name
        try:
            for src, obj in zip(C_SOURCES, objects):
                _run([cc, *FLAGS, "-c", "-o", obj, str(src)])
            try:
                if cxx is None:
                    raise OSError("no C++ compiler")
                # at::parallel_for is inline OpenMP: compiled with -fopenmp and linked to torch's own
                # libgomp (the one already loaded: same soname), it runs on torch's thread team.
                _run([cxx, *FLAGS, "-fopenmp", "-std=c++17", "-c", "-o", str(par), str(PARALLEL_SOURCE),
                      f"-I{torch_dir / 'include'}"])
                _run([cxx, "-shared", "-o", str(built), *objects, str(par), f"-L{torch_dir / 'lib'}",
                      "-ltorch_cpu", "-lc10", "-lgomp", f"-Wl,-rpath,{torch_dir / 'lib'}", "-lm"])
            except (OSError, subprocess.SubprocessError) as exc:
                log.warning("fused CPU ops built without torch's thread pool (%s): they run on one thread", exc)
                _run([cc, "-shared", "-o", str(built), *objects, "-lm"])
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            log.warning("building fused CPU ops failed (%s) %s; torch ops only", exc, detail.decode()[-400:])
            return None
        os.replace(built, target)   # atomic: a concurrent worker loads the old file or the whole new one
    return target


def _run(cmd: list[str]) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=180)


def load(folder: Path | None = None) -> ctypes.CDLL | None:
    """The compiled library, building it under `folder` if needed (the first call's folder wins);
    None where no compiler is available."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    folder = folder or Path.home() / ".cache" / "splitserve"
    with _build_lock(folder):
        target = _build(folder)
    if target is None:
        return None
    lib = ctypes.CDLL(str(target))
    for name, args in _PARALLEL_ONLY.items():
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.argtypes = args
            fn.restype = None
            _fns[name] = fn
    for name, args in _SIGNATURES.items():
        for symbol in (name, f"{name}_par"):
            fn = getattr(lib, symbol, None)
            if fn is not None:
                fn.argtypes = args
                fn.restype = None
                _fns[name] = fn
    _lib = lib
    return lib


@contextlib.contextmanager
def _build_lock(folder: Path):
    """One build at a time per cache folder (a command's background build, its workers): a second
    process waits for the first's library instead of compiling its own. Best effort: a folder
    where no lock file can be made builds without one (the rename into place stays atomic)."""
    try:
        (folder / "cpu_ops").mkdir(parents=True, exist_ok=True)
        lock = open(folder / "cpu_ops" / ".build.lock", "a")   # noqa: SIM115 - held across the yield
    except OSError:
        yield
        return
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for the fused CPU ops another process is building in %s", folder / "cpu_ops",
                     extra={"phase": "building the CPU kernels (first start only)"})
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield                                                   # closing the file releases the lock


def op(name: str) -> ctypes._CFuncPtr:
    """The entry point `name` of _SIGNATURES (its parallel version where built), for the ops'
    other modules (kernels/cpu_quant.py); load() first."""
    return _fns[name]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """weight * norm(x) over the last dim of a 2-D x (rows may be strided). With `residual`:
    residual += x in place first, and the norm is of the sum."""
    rows, hidden = x.shape
    out = torch.empty((rows, hidden), dtype=x.dtype) if out is None else out
    _fns["ss_rms_norm"](x.data_ptr(), x.stride(0), _ptr(residual), weight.data_ptr(), out.data_ptr(),
                     rows, hidden, eps, _DTYPE_CODES[x.dtype])
    return out


def rope_(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
          heads: int, head_dim: int) -> None:
    """Rotate the first `heads` heads of every row of the fused projection [T, *] in place; cos
    and sin are the fp32 [max_positions, head_dim] tables, positions int64 [T]."""
    _fns["ss_rope"](qkv.data_ptr(), qkv.stride(0), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                 qkv.shape[0], heads, head_dim, _DTYPE_CODES[qkv.dtype])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear for any number of rows of x (last dim contiguous), weight [N, K] contiguous in x's
    dtype. Each row's result is the same whatever the rows beside it; the weights are streamed
    once per LINEAR_MAX_ROWS rows, so it beats BLAS only for small passes."""
    rows, k = x.shape
    n = weight.shape[0]
    out = torch.empty((rows, n), dtype=x.dtype)
    _fns["ss_linear"](x.data_ptr(), x.stride(0), weight.data_ptr(), _ptr(bias), n, k, rows, out.data_ptr(), n,
                      _DTYPE_CODES[x.dtype])
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for a contiguous [T, 2I] whose rows hold gate then up."""
    rows, width = gate_up.shape
    out = torch.empty((rows, width // 2), dtype=gate_up.dtype)
    _fns["ss_silu_mul"](gate_up.data_ptr(), out.data_ptr(), rows, width // 2, _DTYPE_CODES[gate_up.dtype])
    return out


def masked_argmax(logits: torch.Tensor, masks: torch.Tensor, rows: list[int], mask_rows: list[int],
                  vocab: int, steer: bool = False) -> tuple[list[int], list[float]] | None:
    """For each rows[j] of fp32 `logits` [R, V'] (V' >= vocab, rows contiguous): the argmax of the
    row with every token its mask (int32 `masks` row mask_rows[j], bit t & 31 of word t >> 5)
    forbids set to -inf, -1 when it forbids all; and the row's unmasked maximum. `steer`: that
    token's logit is raised above the row's maximum, in place. None when the ops are not built."""
    fn = _fns.get("ss_masked_argmax")
    if fn is None:
        return None
    index = torch.tensor(rows, dtype=torch.int64)
    mask_index = torch.tensor(mask_rows, dtype=torch.int64)
    tokens = torch.empty(len(rows), dtype=torch.int64)
    maxes = torch.empty(len(rows), dtype=torch.float32)
    fn(logits.data_ptr(), logits.stride(0), masks.data_ptr(), masks.stride(0), index.data_ptr(), mask_index.data_ptr(),
       len(rows), vocab, int(steer), tokens.data_ptr(), maxes.data_ptr())
    return tokens.tolist(), maxes.tolist()


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                     lens: torch.Tensor, window: int | None, scale: float, int4_view: bool = False,
                     tails: torch.Tensor | None = None) -> torch.Tensor:
    """q: [B, Hq, D] (row-strided allowed, heads contiguous); caches [blocks, block_size, Hkv, D]
    in q's dtype, or quantized rows [.., Hkv, D + 2] (cluster/kv/kv_quant.py); tables int64
    [B, max_blocks]; lens int64 [B]. Returns [B, Hq, D]. `int4_view`: int8 rows read as int4.
    `tails`: token-tree rows (int64 [B, 1 + W], contiguous): row b's last tails[b, 0] keys sit at
    the flat slots tails[b, 1:] (its ancestors, then itself), the keys before through the table."""
    b, hq, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    out = torch.empty((b, hq, d), dtype=q.dtype)
    tail_width = 0 if tails is None else tails.shape[1] - 1
    _fns["ss_decode_attention"](q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
                             tables.shape[1], lens.data_ptr(), _ptr(tails), tail_width, b, hq, hkv, d, block_size,
                             window or 0, scale, out.data_ptr(), _DTYPE_CODES[q.dtype], kv_code(k_cache, int4_view))
    return out


def has_bf16_dot() -> bool:
    """quant.c's Q_DOT path is built (AVX512_BF16): bf16 batches on quantized weights."""
    return _lib is not None and bool(_lib.ss_qdot_available())


def has_prefill_attention() -> bool:
    """The C prefill attention is built and vectorised (AVX-512); elsewhere SDPA is faster."""
    return _lib is not None and bool(_lib.ss_prefill_attention_fast())


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None,
                      scale: float) -> torch.Tensor:
    """Causal attention of q [q_len, Hq, D] (the last q_len positions) over k, v [ctx, Hkv, D]
    (row-strided allowed, heads and dims contiguous; D a multiple of 16, at most 256): [q_len, Hq, D].
    A row's result does not depend on q_len (chunking, a prefix-cache hit) or the thread count."""
    q_len, hq, d = q.shape
    ctx, hkv, _ = k.shape
    out = torch.empty((q_len, hq, d), dtype=q.dtype)
    _fns["ss_prefill_attention"](q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                                 q_len, ctx, hq, hkv, d, window or 0, scale, out.data_ptr(), _DTYPE_CODES[q.dtype])
    return out


def kv_code(cache: torch.Tensor, int4_view: bool = False) -> int:
    """kv_quant.h's code of a cache tensor: 0 in the activation dtype, 1 int8 rows, 2 E4M3 rows;
    3 int8 rows read through their int4 view (cluster/kv/kv_quant.py's int4_values)."""
    code = _KV_CODES.get(cache.dtype, 0)
    return 3 if int4_view and code == 1 else code


def store_kv(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """k, v: [T, Hkv, D] (rows may be strided views of the qkv projection); slots int64 [T];
    caches [blocks, block_size, Hkv, D] contiguous, or quantized rows (quantized as they are stored)."""
    kvq = kv_code(k_cache)
    if kvq:
        _fns["ss_store_kv_q"](k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slots.data_ptr(), k.shape[0],
                              k.shape[1], k.shape[2], k_cache.data_ptr(), v_cache.data_ptr(), _DTYPE_CODES[k.dtype],
                              kvq)
        return
    _fns["ss_store_kv"](k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slots.data_ptr(), k.shape[0],
                        k.shape[1] * k.shape[2], k_cache.data_ptr(), v_cache.data_ptr(), _DTYPE_CODES[k.dtype])


def has_mla_decode() -> bool:
    return "ss_mla_decode" in _fns


def mla_decode(q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor,
               lens: torch.Tensor, scale: float) -> torch.Tensor:
    """kernels/mla_decode.py's signature (contiguous tensors; kv one layer's [2, blocks, bs, 1, half])."""
    r, heads, c_dim = q_lat.shape
    q_lat, q_pe = q_lat.contiguous(), q_pe.contiguous()   # held: the call reads their memory
    out = torch.empty((r, heads, c_dim), dtype=q_lat.dtype)
    _fns["ss_mla_decode"](q_lat.data_ptr(), q_pe.data_ptr(), kv.data_ptr(), kv[0].numel(),
                          tables.data_ptr(), tables.shape[1], lens.data_ptr(), r, heads, c_dim, q_pe.shape[-1],
                          kv.shape[-1], kv.shape[2], scale, out.data_ptr(), _DTYPE_CODES[q_lat.dtype])
    return out


def has_decode_block() -> bool:
    return "ss_decode_block" in _fns


def decode_block(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                 lens: torch.Tensor, heads: int, kv_heads: int, head_dim: int, window: int | None,
                 scale: float, int4_view: bool = False) -> torch.Tensor:
    """RoPE + K/V store + decode attention of one layer of a pure-decode pass (one row per
    sequence of the fused qkv projection [B, *]); returns [B, heads * head_dim]."""
    b = qkv.shape[0]
    out = torch.empty((b, heads * head_dim), dtype=qkv.dtype)
    _fns["ss_decode_block"](qkv.data_ptr(), qkv.stride(0), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                            slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
                            tables.shape[1], lens.data_ptr(), b, heads, kv_heads, head_dim, k_cache.shape[1],
                            window or 0, scale, out.data_ptr(), _DTYPE_CODES[qkv.dtype], kv_code(k_cache, int4_view))
    return out


def has_moe_experts() -> bool:
    return "ss_moe_experts" in _fns


def moe_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, rows: torch.Tensor,
                starts: torch.Tensor, weights: torch.Tensor, y: torch.Tensor, out: torch.Tensor,
                max_rows: int = -1) -> None:
    """parallel.cpp's ss_moe_experts: out [T, H] (zeros) += the experts' weighted outputs of the
    pairs sorted by expert (rows [P] int64 their tokens, starts [E + 1] int64 each expert's first
    pair, weights [P] fp32). y [P, H]: the pairs' expert outputs, written here for the experts of
    at most `max_rows` pairs (all with -1) and given by the caller for the others. x's last dim
    contiguous; the stacked weights contiguous."""
    pairs, (num_experts, hidden, inter) = rows.shape[0], down.shape
    new = lambda width: torch.empty((pairs, width), dtype=x.dtype)   # noqa: E731
    xg, gu, act = new(hidden), new(2 * inter), new(inter)
    _fns["ss_moe_experts"](x.data_ptr(), x.stride(0), gate_up.data_ptr(), down.data_ptr(), rows.data_ptr(),
                           starts.data_ptr(), weights.data_ptr(), num_experts, pairs, hidden, inter, max_rows,
                           xg.data_ptr(), gu.data_ptr(), act.data_ptr(), y.data_ptr(), out.data_ptr(),
                           _DTYPE_CODES[x.dtype])


def has_decode_layer() -> bool:
    return "ss_decode_layer" in _fns


def decode_layer(layer: SsLayer, step: SsDecodePass, x: int, k_cache: int, v_cache: int) -> None:
    """One decoder layer of a pure-decode pass on quantized weights (parallel.cpp's
    ss_decode_layer), x's rows updated in place; pointers as ints (cluster/model/fused_layer.py)."""
    _fns["ss_decode_layer"](ctypes.byref(layer), ctypes.byref(step), x, k_cache, v_cache)


if __name__ == "__main__":   # kernels/cpu_build.py's child: build the library under the folder given
    load(Path(sys.argv[1]))

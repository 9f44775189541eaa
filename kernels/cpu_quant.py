"""Weight-only quantized linear layers on CPU: GGUF Q8_0, Q4_0, Q4_1 and int8 per output channel.

A `QuantizedWeight` holds an [N, K] weight in the layout `cpu/quant.c` streams (tiles of 8 output
columns, one sequential stream per tile; see that file), packed from a GGUF tensor's raw blocks
(`from_gguf`, no dequantized copy) or quantized from a float weight at load (`quantize`).
`quant_linear` is F.linear on it: activations float32 or bfloat16, fp32 arithmetic, output in the
activation dtype, each row's result independent of the rows beside it. `dequantize` is the
reference; `dequantize_into` writes the same values into a dense float32 or bfloat16 matrix (C),
for the GEMM that serves passes of many rows (cluster/model/quant_linear.py). The library is built and loaded by `cpu_ops` (one place builds it).

Q4_0 is stored as Q4_1 with m = -8d (exact: d(q-8) = dq - 8d in fp32), so one 4-bit kernel serves
both; float weights quantize to int8 per channel, Q8_0 or Q4_1 (groups of 32 with a minimum).
"""
from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from kernels import cpu_ops

TILE = 8      # output columns per tile (quant.c's QT)
BLOCK = 32    # weights per block along K (quant.c's QB)


class QuantFormat(enum.Enum):
    INT8 = "int8"     # int8 [N, K], one fp32 scale per output row: w = s * q
    Q8_0 = "q8_0"     # blocks of 32: fp16 d, 32 int8: w = d * q
    Q4_0 = "q4_0"     # blocks of 32: fp16 d, 32 nibbles: w = d * (q - 8)
    Q4_1 = "q4_1"     # blocks of 32: fp16 d, fp16 m, 32 nibbles: w = d * q + m


ACT_INT8 = 4   # quant.c's Q_ACT8: or-ed into the format code for int8 activations
BF16_DOT = 8   # quant.c's Q_DOT: bf16 passes of 32+ rows may run quant_dot.c (not the deterministic mode)
_KERNEL_FORMAT = {QuantFormat.INT8: 0, QuantFormat.Q8_0: 1, QuantFormat.Q4_0: 2, QuantFormat.Q4_1: 2}
_GGML_TYPES = {8: QuantFormat.Q8_0, 2: QuantFormat.Q4_0, 3: QuantFormat.Q4_1}   # GGMLQuantizationType values
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_GGUF_BLOCK_BYTES = {QuantFormat.Q8_0: 34, QuantFormat.Q4_0: 18, QuantFormat.Q4_1: 20}


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """An [n, k] weight in quant.c's layout. quants: uint8 [tiles, k/32, 8, 32 (8-bit) or 16
    (4-bit)]; scales: fp16 [tiles, k/32, 8] (fp32 [tiles * 8] for INT8); mins: fp16 like scales
    (4-bit formats only). Columns past n (padding to a whole tile) are zero."""
    format: QuantFormat
    n: int
    k: int
    quants: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None
    _kernel_args: tuple = field(init=False, repr=False)   # the pointers and format code ss_qlinear takes

    def __post_init__(self) -> None:
        mins = None if self.mins is None else self.mins.data_ptr()
        object.__setattr__(self, "_kernel_args", (self.quants.data_ptr(), self.scales.data_ptr(), mins,
                                                  _KERNEL_FORMAT[self.format]))

    @property
    def nbytes(self) -> int:
        """Bytes of the packed tensors (what a pass streams)."""
        return sum(t.numel() * t.element_size() for t in (self.quants, self.scales, self.mins) if t is not None)

    @classmethod
    def from_gguf(cls, raw: np.ndarray, ggml_type: int, shape: tuple[int, int]) -> QuantizedWeight:
        """From a GGUF tensor's raw block bytes (uint8, as gguf's reader gives them) of logical
        torch shape [N, K] and its GGMLQuantizationType (Q8_0, Q4_0 or Q4_1)."""
        fmt = _GGML_TYPES.get(int(ggml_type))
        if fmt is None:
            raise ValueError(f"GGML type {ggml_type!r} is not one of Q8_0, Q4_0, Q4_1")
        n, k = shape
        _check_k(k)
        with warnings.catch_warnings():   # a read-only memmap: torch warns, and only reads it here
            warnings.simplefilter("ignore", UserWarning)
            blocks = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(n, k // BLOCK, -1))
        if blocks.shape[-1] != _GGUF_BLOCK_BYTES[fmt]:
            raise ValueError(f"{fmt.value}: {blocks.shape[-1]} bytes per block, expected {_GGUF_BLOCK_BYTES[fmt]}")
        d = blocks[..., :2].contiguous().view(torch.float16)[..., 0]
        if fmt is QuantFormat.Q8_0:
            return cls(fmt, n, k, _tiles(blocks[..., 2:]), _tiles(d))
        if fmt is QuantFormat.Q4_1:
            m = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0]
            return cls(fmt, n, k, _pack_nibbles(_gguf_nibbles(blocks[..., 4:])), _tiles(d), _tiles(m))
        m = (d.float() * -8).to(torch.float16)
        if not torch.isfinite(m[torch.isfinite(d)]).all():
            raise ValueError("Q4_0 scale too large for its -8d minimum in fp16")
        return cls(fmt, n, k, _pack_nibbles(_gguf_nibbles(blocks[..., 2:])), _tiles(d), _tiles(m))

    @classmethod
    def quantize(cls, w: torch.Tensor, scheme: QuantFormat | str) -> QuantizedWeight:
        """Quantize a float [N, K] weight: INT8 (symmetric per output row, s = max|w| / 127, round
        to nearest), Q8_0 (d = max|w| / 127 per block of 32) or Q4_1 (d = (max - min) / 15,
        m = min per block of 32). GGUF's scales are fp16: q is rounded against the stored fp16 d
        and m (not the fp32 ones, as gguf does): the error is within d / 2 but for fp16 rounding."""
        fmt = QuantFormat(scheme)
        n, k = w.shape
        _check_k(k)
        w = w.detach().float()
        if fmt is QuantFormat.INT8:
            s = w.abs().amax(dim=1) / 127
            q = torch.round(w / torch.where(s == 0, 1.0, s)[:, None]).clamp(-127, 127).to(torch.int8)
            return cls(fmt, n, k, _tiles(q.view(torch.uint8).view(n, k // BLOCK, BLOCK)), _pad_rows(s))
        blocks = w.view(n, k // BLOCK, BLOCK)
        if fmt is QuantFormat.Q8_0:
            d16 = (blocks.abs().amax(dim=-1, keepdim=True) / 127).to(torch.float16)
            d = d16.float()
            q = torch.round(blocks * torch.where(d == 0, 0.0, 1 / d)).clamp(-127, 127).to(torch.int8)
            return cls(fmt, n, k, _tiles(q.view(torch.uint8)), _tiles(d16[..., 0]))
        if fmt is not QuantFormat.Q4_1:
            raise ValueError(f"quantize() makes int8, q8_0 or q4_1, not {fmt.value}")
        lo, hi = blocks.amin(dim=-1, keepdim=True), blocks.amax(dim=-1, keepdim=True)
        d16, m16 = ((hi - lo) / 15).to(torch.float16), lo.to(torch.float16)
        d, m = d16.float(), m16.float()
        q = torch.round((blocks - m) * torch.where(d == 0, 0.0, 1 / d)).clamp(0, 15).to(torch.uint8)
        return cls(fmt, n, k, _pack_nibbles(q), _tiles(d16[..., 0]), _tiles(m16[..., 0]))

    def dequantize(self) -> torch.Tensor:
        """The float32 [n, k] weight the kernel multiplies by (the reference)."""
        if self.format is QuantFormat.INT8:
            q = _untile(self.quants).view(torch.int8).float()
            return (q * self.scales[:, None, None]).reshape(-1, self.k)[: self.n]
        d = _untile(self.scales).float()[..., None]
        if self.format is QuantFormat.Q8_0:
            return (_untile(self.quants).view(torch.int8).float() * d).reshape(-1, self.k)[: self.n]
        w = _unpack_nibbles(self.quants).float() * d + _untile(self.mins).float()[..., None]
        return w.reshape(-1, self.k)[: self.n]


def quant_linear(x: torch.Tensor, qweight: QuantizedWeight, bias: torch.Tensor | None = None, *,
                 act_int8: bool = False, bf16_dot: bool = False) -> torch.Tensor:
    """x @ w.T (+ bias) for x [..., K] float32 or bfloat16; the output has x's dtype. A decode
    step makes ~120 of these calls, so the common case (2-D x, fp32 bias or none) does little
    Python: the weight's pointers are computed once, at construction.

    act_int8 (4-bit formats only): activations quantized to int8 per row and block of 32 inside
    the kernel (dx = max|x| / 127), integer dot products per block: faster at small batch, but the
    result carries the activations' rounding (not the default; still batch-invariant).
    bf16_dot: bf16 passes of 32 rows or more on AVX512_BF16 dot products over the weight rounded to
    bf16 per tile (kernels/cpu/quant_dot.c; a row's result then depends on its pass's row count)."""
    dtype_code = _DTYPE_CODES.get(x.dtype)
    if dtype_code is None:
        raise TypeError(f"quant_linear takes float32 or bfloat16 activations, not {x.dtype}")
    k, n = x.shape[-1], qweight.n
    if k != qweight.k:
        raise ValueError(f"activations have {k} features, the weight {qweight.k}")
    if act_int8 and qweight.format not in (QuantFormat.Q4_0, QuantFormat.Q4_1):
        raise ValueError(f"int8 activations need a 4-bit weight, not {qweight.format.value}")
    if cpu_ops.load() is None:   # no C compiler: correct, but dequantizes the weight at every call
        if act_int8:
            return act_int8_reference(x.float(), qweight, bias).to(x.dtype)
        return torch.nn.functional.linear(x.float(), qweight.dequantize(), bias).to(x.dtype)
    x2 = x if x.dim() == 2 else x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty((rows, n), dtype=x.dtype)
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.float().contiguous()
    quants, scales, mins, fmt = qweight._kernel_args
    if act_int8:
        fmt |= ACT_INT8
    elif bf16_dot:
        fmt |= BF16_DOT
    cpu_ops.op("ss_qlinear")(x2.data_ptr(), x2.stride(0), quants, scales, mins,
                              None if bias is None else bias.data_ptr(), n, k, rows, out.data_ptr(), n, fmt, dtype_code)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], n)


def dequantize_into(qweight: QuantizedWeight, out: torch.Tensor, row0: int = 0) -> torch.Tensor:
    """Rows [row0, row0 + len(out)) of the dense weight in `out` (contiguous, float32 or bfloat16;
    row0 a multiple of TILE, the rows within n): each element d * q + m (or d * q, s * q) in fp32
    as `dequantize` computes it, rounded once to out's dtype, the same bits on every call. For
    passes with enough rows that a GEMM on it beats `quant_linear`."""
    rows, k = out.shape
    dtype_code = _DTYPE_CODES.get(out.dtype)
    if dtype_code is None or k != qweight.k or not out.is_contiguous() or row0 % TILE or row0 + rows > qweight.n:
        raise ValueError(f"dequantize_into: rows {row0}.. of a {qweight.n}x{qweight.k} weight into a contiguous "
                         f"float32 or bfloat16 matrix, not {out.dtype} {tuple(out.shape)}")
    if cpu_ops.load() is None:   # no C compiler
        return out.copy_(qweight.dequantize()[row0:row0 + rows])
    if (row0 + rows) % TILE and row0 + rows != qweight.n:
        raise ValueError(f"dequantize_into: {rows} rows from {row0} end inside a tile of {TILE}")
    quants, scales, mins, fmt = qweight._kernel_args
    cpu_ops.op("ss_qdequant")(quants, scales, mins, row0 // TILE, -(-(row0 + rows) // TILE), qweight.n, qweight.k,
                              out.data_ptr(), fmt, dtype_code)
    return out


def act_int8_reference(x: torch.Tensor, qweight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What quant_linear(..., act_int8=True) computes, in float32 (x float32 [..., K], a 4-bit
    weight): the d * q part against the int8-rounded activations, the minimum's part against x."""
    m = _untile(qweight.mins).float()[..., None].expand(-1, -1, BLOCK).reshape(-1, qweight.k)[: qweight.n]
    linear = torch.nn.functional.linear
    return linear(_quantize_act_int8(x), qweight.dequantize() - m) + linear(x, m, bias)


def _quantize_act_int8(x: torch.Tensor) -> torch.Tensor:
    """What the kernel's int8 activations stand for, in float32: per row and block of 32,
    dx * round(x / dx) with dx = max|x| / 127 (x float32 [..., K])."""
    b = x.reshape(*x.shape[:-1], -1, BLOCK)
    amax = b.abs().amax(dim=-1, keepdim=True)
    # a true division as the kernel's (127 / amax would be amax.reciprocal() * 127: ties round apart)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return (torch.round(b * inv).clamp(-127, 127) * (amax / 127)).reshape(x.shape)


def _check_k(k: int) -> None:
    if k % BLOCK:
        raise ValueError(f"K = {k}: quantized weights need K a multiple of {BLOCK}")


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    """t [n, ...] with zero rows up to a whole number of tiles."""
    pad = -t.shape[0] % TILE
    return torch.cat([t, t.new_zeros((pad, *t.shape[1:]))]) if pad else t


def _tiles(t: torch.Tensor) -> torch.Tensor:
    """[n, blocks, *rest] -> [tiles, blocks, TILE, *rest] (contiguous): a tile's columns side by side per block."""
    t = _pad_rows(t)
    return t.view(-1, TILE, *t.shape[1:]).transpose(1, 2).contiguous()


def _untile(t: torch.Tensor) -> torch.Tensor:
    """[tiles, blocks, TILE, *rest] -> [tiles * TILE, blocks, *rest]."""
    return t.transpose(1, 2).reshape(-1, *t.shape[1:2], *t.shape[3:])


def _gguf_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """GGUF 4-bit bytes [..., 16] (byte j: element j low, j + 16 high) -> values [..., 32] in order."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Values [n, blocks, 32] (0..15) -> quant.c's 4-bit tiles: byte 8h + i of a block holds element
    16h + i (low nibble) and 16h + 8 + i (high nibble), h < 2, i < 8."""
    v = q.reshape(*q.shape[:-1], 2, 2, 8)                  # [.., h, low/high, i]
    packed = v[..., 0, :] | (v[..., 1, :] << 4)            # [.., h, i]
    return _tiles(packed.reshape(*q.shape[:-1], 16))


def _unpack_nibbles(quants: torch.Tensor) -> torch.Tensor:
    """quant.c's 4-bit tiles -> values [tiles * TILE, blocks, 32] in element order."""
    b = _untile(quants).reshape(*_untile(quants).shape[:-1], 2, 8)   # [.., h, i]
    return torch.stack([b & 15, b >> 4], dim=-2).reshape(*b.shape[:-2], 32)

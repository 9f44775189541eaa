"""The quantized-weight linear (kernels/cpu_quant.py, kernels/cpu/quant.c) against its reference,
dequantize() then F.linear in float32: every format, float32 and bfloat16 activations, row counts
across the register tiles and row blocks, N not a multiple of the tile. Also: GGUF blocks packed
without a dequantized copy dequantize exactly as the gguf library does, each row's result is
bitwise independent of its batch and of the thread count, quantize() keeps its error bounds, and
the portable (no SIMD) and AVX-512 builds of quant.c compile (the portable one is run)."""
import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from kernels import cpu_ops
from kernels.cpu_quant import QuantFormat, QuantizedWeight, quant_linear

if cpu_ops.load() is None:
    pytest.skip("no C compiler: the fused CPU ops are not built here", allow_module_level=True)

FORMATS = list(QuantFormat)
QUANT_C = Path(cpu_ops.__file__).with_name("cpu") / "quant.c"


def _weight(fmt: QuantFormat, n: int, k: int, seed: int) -> QuantizedWeight:
    """Random weights in `fmt`: through gguf's own quantizer for the GGUF formats it has."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    if fmt is QuantFormat.INT8:
        return QuantizedWeight.quantize(w, fmt)
    gguf = pytest.importorskip("gguf")
    qtype = gguf.GGMLQuantizationType[fmt.name]
    return QuantizedWeight.from_gguf(gguf.quants.quantize(w.numpy(), qtype), qtype, (n, k))


def _bound(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """fp32 rounding allowance of a row's sum: 3e-6 of sum_k |x_k| (|w_k| + |m|) (Q4's minimum term
    is summed apart from the d * q term, so its magnitude counts too)."""
    mag = qw.dequantize().abs()
    if qw.mins is not None:
        mag = mag + qw.mins.float().abs().transpose(1, 2).reshape(-1, qw.k // 32)[: qw.n].repeat_interleave(32, 1)
    return 3e-6 * (x.float().abs() @ mag.T) + 1e-7


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n,k", [(577, 576), (100, 1536)])
def test_kernel_matches_dequantized_linear(fmt, dtype, n, k):
    qw = _weight(fmt, n, k, seed=n)
    w = qw.dequantize()
    g = torch.Generator().manual_seed(k)
    bias = torch.randn(n, generator=g)
    for rows in (1, 3, 8, 13, 64):
        x = torch.randn(rows, k + 16, generator=g).to(dtype)[:, :k]      # strided rows
        b = bias if rows % 2 else None
        got = quant_linear(x, qw, b)
        assert got.dtype == dtype and got.shape == (rows, n)
        want = torch.nn.functional.linear(x.float(), w, b)
        allowed = _bound(x, qw)
        if dtype == torch.bfloat16:
            allowed = allowed + want.abs() * 2.0 ** -8                   # the output's one rounding
        err = (got.float() - want).abs()
        assert (err <= allowed).all(), (rows, (err / allowed).max().item())


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rows_are_batch_and_thread_invariant(fmt, dtype):
    """Row i alone, in a batch of 13 (row blocks 8 + 5, tiles of several rows and a single one) or
    of 37, and on one thread or two: bitwise the same."""
    qw = _weight(fmt, 45, 96, seed=3)
    x = torch.randn(37, 96, generator=torch.Generator().manual_seed(4)).to(dtype)
    bias = torch.randn(45, generator=torch.Generator().manual_seed(5))
    alone = torch.cat([quant_linear(x[i : i + 1], qw, bias) for i in range(len(x))])
    assert torch.equal(quant_linear(x[:13], qw, bias), alone[:13])
    assert torch.equal(quant_linear(x, qw, bias), alone)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(quant_linear(x, qw, bias), alone)
    finally:
        torch.set_num_threads(threads)


def test_bias_and_leading_dims():
    g = torch.Generator().manual_seed(8)
    qw = QuantizedWeight.quantize(torch.randn(20, 64, generator=g), "q4_1")
    x = torch.randn(2, 3, 64, generator=g)
    bias = torch.randn(20, generator=g).to(torch.bfloat16)     # converted to fp32 for the kernel
    got = quant_linear(x, qw, bias)
    assert got.shape == (2, 3, 20)
    assert torch.equal(got, quant_linear(x.reshape(6, 64), qw, bias).view(2, 3, 20))
    torch.testing.assert_close(got - quant_linear(x, qw), bias.float().expand(2, 3, 20), rtol=0, atol=1e-5)


@pytest.mark.parametrize("fmt", [QuantFormat.Q8_0, QuantFormat.Q4_0, QuantFormat.Q4_1], ids=lambda f: f.value)
def test_from_gguf_dequantizes_as_gguf_does(fmt):
    gguf = pytest.importorskip("gguf")
    qtype = gguf.GGMLQuantizationType[fmt.name]
    w = np.random.default_rng(0).standard_normal((27, 96)).astype(np.float32)
    w[3, :32] = 0.5                                                      # a constant block: d = 0
    raw = gguf.quants.quantize(w, qtype)
    raw.setflags(write=False)                                            # as a memory-mapped file's
    qw = QuantizedWeight.from_gguf(raw, qtype, (27, 96))
    assert torch.equal(qw.dequantize(), torch.from_numpy(gguf.quants.dequantize(raw, qtype)))
    assert qw.nbytes == ((27 + 7) // 8 * 8) * 96 // 32 * (34 if fmt is QuantFormat.Q8_0 else 20)


def test_from_gguf_refuses_other_types_and_shapes():
    with pytest.raises(ValueError, match="not one of"):
        QuantizedWeight.from_gguf(np.zeros(64, np.uint8), 12, (1, 256))     # Q4_K
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantizedWeight.from_gguf(np.zeros(34, np.uint8), 8, (1, 40))


def test_quantize_error_bounds():
    g = torch.Generator().manual_seed(7)
    w = torch.randn(33, 256, generator=g) * torch.rand(33, 1, generator=g)
    w[5] = 0.0                                                           # an all-zero row: scale 0
    err = (QuantizedWeight.quantize(w, "int8").dequantize() - w).abs()
    s = w.abs().amax(dim=1, keepdim=True) / 127
    assert (err <= s / 2 * (1 + 1e-6) + 1e-12).all()
    blocks = w.view(33, 8, 32)
    err = (QuantizedWeight.quantize(w, "q8_0").dequantize() - w).abs().view(33, 8, 32)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    assert (err <= d / 2 * (1 + 2.0 ** -10) + 1e-12).all()
    err = (QuantizedWeight.quantize(w, "q4_1").dequantize() - w).abs().view(33, 8, 32)
    lo, hi = blocks.amin(dim=-1, keepdim=True), blocks.amax(dim=-1, keepdim=True)
    d = (hi - lo) / 15
    # d / 2, plus what the fp16 rounding of d (times 15 at the top of the range) and m can add.
    assert (err <= d / 2 + 15 * d * 2.0 ** -11 + lo.abs() * 2.0 ** -11 + 1e-7).all()


def _compile(tmp_path: Path, *flags: str, shared: bool) -> Path:
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    out = tmp_path / ("quant.so" if shared else "quant.o")
    cmd = [cc, "-O2", "-ffp-contract=off", "-fPIC", *flags, *(["-shared"] if shared else ["-c"]), "-o", str(out),
           str(QUANT_C), "-lm"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


def test_avx512_build_compiles(tmp_path):
    if subprocess.run(["uname", "-m"], capture_output=True, text=True).stdout.strip() != "x86_64":
        pytest.skip("x86 only")
    _compile(tmp_path, "-mavx512f", "-mavx512bw", "-mfma", "-mf16c", "-Wall", "-Werror", shared=False)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
def test_portable_build_matches_reference(tmp_path, fmt):
    """quant.c without SIMD (the fallback on CPUs without AVX2): same layout, same results."""
    flags = ["-march=x86-64", "-mno-avx", "-mno-f16c"] if Path("/proc/cpuinfo").exists() and \
        subprocess.run(["uname", "-m"], capture_output=True, text=True).stdout.strip() == "x86_64" else []
    lib = ctypes.CDLL(str(_compile(tmp_path, *flags, shared=True)))
    fn = lib.ss_qlinear
    fn.argtypes, fn.restype = cpu_ops._SIGNATURES["ss_qlinear"], None
    qw = _weight(fmt, 21, 64, seed=11)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(12))
    bias = torch.randn(21, generator=torch.Generator().manual_seed(13))

    def run(rows: torch.Tensor) -> torch.Tensor:
        out = torch.empty(len(rows), 21)
        mins = None if qw.mins is None else qw.mins.data_ptr()
        fn(rows.data_ptr(), 64, qw.quants.data_ptr(), qw.scales.data_ptr(), mins, bias.data_ptr(), 21, 64, len(rows),
           out.data_ptr(), 21, {QuantFormat.INT8: 0, QuantFormat.Q8_0: 1}.get(fmt, 2), 0)
        return out

    got = run(x)
    want = torch.nn.functional.linear(x, qw.dequantize(), bias)
    assert ((got - want).abs() <= _bound(x, qw)).all()
    assert torch.equal(torch.cat([run(x[i : i + 1].contiguous()) for i in range(5)]), got)


def test_quant_linear_module():
    from cluster.model.quant_linear import QuantLinear
    torch.manual_seed(10)
    linear = torch.nn.Linear(64, 24)
    module = QuantLinear.from_linear(linear, "int8")
    x = torch.randn(3, 64).to(torch.bfloat16)
    assert (module.in_features, module.out_features) == (64, 24)
    assert torch.equal(module(x), quant_linear(x, module.qweight, linear.bias.detach()))
    assert sum(b.numel() * b.element_size() for b in module.buffers()) == module.qweight.nbytes + 24 * 4


def test_without_a_compiler_the_reference_serves(monkeypatch):
    g = torch.Generator().manual_seed(9)
    qw = QuantizedWeight.quantize(torch.randn(20, 64, generator=g), "q4_1")
    x, bias = torch.randn(3, 64, generator=g).to(torch.bfloat16), torch.randn(20, generator=g)
    want = quant_linear(x, qw, bias)
    monkeypatch.setattr(cpu_ops, "load", lambda folder=None: None)
    got = quant_linear(x, qw, bias)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2.0 ** -7, atol=1e-5)   # one bf16 step apart at most


# Int8 activations (quant_linear(..., act_int8=True), 4-bit weights): an option, not the default.
Q4_FORMATS = [QuantFormat.Q4_0, QuantFormat.Q4_1]


def _act8_bound(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """fp32 rounding allowance against act_int8_reference (the integer dot products are exact)."""
    from kernels.cpu_quant import _quantize_act_int8
    xq = _quantize_act_int8(x.float())
    m = qw.mins.float().abs().transpose(1, 2).reshape(-1, qw.k // 32)[: qw.n].repeat_interleave(32, 1)
    return 3e-6 * (xq.abs() @ qw.dequantize().abs().T + x.float().abs() @ (2 * m).T) + 1e-7


@pytest.mark.parametrize("fmt", Q4_FORMATS, ids=lambda f: f.value)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n,k", [(577, 576), (100, 1536)])
def test_int8_activations_match_their_reference(fmt, dtype, n, k):
    from kernels.cpu_quant import act_int8_reference
    qw = _weight(fmt, n, k, seed=n + 1)
    g = torch.Generator().manual_seed(k + 1)
    bias = torch.randn(n, generator=g)
    for rows in (1, 2, 3, 8, 13, 64):
        x = torch.randn(rows, k + 16, generator=g).to(dtype)[:, :k]
        x[0, :32] = 0.0                                                  # a zero block: dx = 0
        b = bias if rows % 2 else None
        got = quant_linear(x, qw, b, act_int8=True)
        assert got.dtype == dtype and got.shape == (rows, n)
        want = act_int8_reference(x.float(), qw, b)
        allowed = _act8_bound(x, qw)
        if dtype == torch.bfloat16:
            allowed = allowed + want.abs() * 2.0 ** -8
        err = (got.float() - want).abs()
        assert (err <= allowed).all(), (rows, (err / allowed).max().item())
        # and within the activation rounding of the exact product
        exact = torch.nn.functional.linear(x.float(), qw.dequantize(), b)
        assert (got.float() - exact).abs().max() < 0.05 * exact.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_int8_activations_are_batch_and_thread_invariant(dtype):
    qw = _weight(QuantFormat.Q4_1, 45, 96, seed=3)
    x = torch.randn(37, 96, generator=torch.Generator().manual_seed(4)).to(dtype)
    bias = torch.randn(45, generator=torch.Generator().manual_seed(5))
    alone = torch.cat([quant_linear(x[i : i + 1], qw, bias, act_int8=True) for i in range(len(x))])
    assert torch.equal(quant_linear(x[:13], qw, bias, act_int8=True), alone[:13])
    assert torch.equal(quant_linear(x, qw, bias, act_int8=True), alone)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(quant_linear(x, qw, bias, act_int8=True), alone)
    finally:
        torch.set_num_threads(threads)
    assert not torch.equal(quant_linear(x, qw, bias), alone)             # the default path is the fp32 one


@pytest.mark.parametrize("fmt", [QuantFormat.INT8, QuantFormat.Q8_0], ids=lambda f: f.value)
def test_int8_activations_need_a_4bit_weight(fmt):
    qw = QuantizedWeight.quantize(torch.randn(8, 64), fmt.value)
    with pytest.raises(ValueError, match="4-bit"):
        quant_linear(torch.randn(1, 64), qw, act_int8=True)


def test_portable_build_int8_activations(tmp_path):
    from kernels.cpu_quant import ACT_INT8, act_int8_reference
    flags = ["-march=x86-64", "-mno-avx", "-mno-f16c"] if Path("/proc/cpuinfo").exists() and \
        subprocess.run(["uname", "-m"], capture_output=True, text=True).stdout.strip() == "x86_64" else []
    lib = ctypes.CDLL(str(_compile(tmp_path, *flags, shared=True)))
    fn = lib.ss_qlinear
    fn.argtypes, fn.restype = cpu_ops._SIGNATURES["ss_qlinear"], None
    qw = _weight(QuantFormat.Q4_1, 21, 64, seed=11)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(12))
    out = torch.empty(5, 21)
    fn(x.data_ptr(), 64, qw.quants.data_ptr(), qw.scales.data_ptr(), qw.mins.data_ptr(), None, 21, 64, 5,
       out.data_ptr(), 21, 2 | ACT_INT8, 0)
    assert ((out - act_int8_reference(x, qw)).abs() <= _act8_bound(x, qw)).all()


def test_int8_activations_without_a_compiler(monkeypatch):
    qw = _weight(QuantFormat.Q4_0, 20, 64, seed=9)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    want = quant_linear(x, qw, act_int8=True)
    monkeypatch.setattr(cpu_ops, "load", lambda folder=None: None)
    got = quant_linear(x, qw, act_int8=True)
    torch.testing.assert_close(got.float(), want.float(), rtol=2.0 ** -7, atol=1e-5)

"""Prefill on quantized weights (cluster/model/quant_linear.py): passes of many rows dequantize the
weight in C (kernels/cpu/dequant.c) into a scratch matrix and run torch's GEMM. The dense weight
is exactly the reference dequantize() rounded to the activations' dtype (SIMD and portable
builds), the layer's output is the float reference within tolerance (LM-head-sized layers in
chunks too), and the kernel plan keeps the row-independent kernel in batch-invariant mode."""
import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn

from cluster.model import quant_linear
from cluster.model.kernel_choice import apply_kernel_plan
from cluster.model.kernel_plan import KernelPlan
from cluster.model.quant_linear import DENSE_MIN_ROWS, QuantLinear
from kernels import cpu_ops
from kernels.cpu_quant import QuantFormat, QuantizedWeight, dequantize_into

if cpu_ops.load() is None:
    pytest.skip("no C compiler: the fused CPU ops are not built here", allow_module_level=True)

FORMATS = [QuantFormat.INT8, QuantFormat.Q8_0, QuantFormat.Q4_1]   # Q4_0 is stored as Q4_1
DTYPES = [torch.float32, torch.bfloat16]


def _weight(fmt: QuantFormat, n: int, k: int, seed: int = 3) -> QuantizedWeight:
    return QuantizedWeight.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05, fmt)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
def test_dense_weight_is_the_reference_rounded_once(fmt):
    qw = _weight(fmt, 45, 96)                                  # n not a multiple of the 8-row tile
    ref = qw.dequantize()
    for dtype in DTYPES:
        assert torch.equal(dequantize_into(qw, torch.empty(45, 96, dtype=dtype)), ref.to(dtype))
        part = dequantize_into(qw, torch.empty(21, 96, dtype=dtype), 24)     # rows 24..44: the last tile's end
        assert torch.equal(part, ref[24:].to(dtype))
    with pytest.raises(ValueError, match="rows"):
        dequantize_into(qw, torch.empty(10, 96), 4)            # not at a tile's start


def test_portable_build_matches_reference(tmp_path):
    """dequant.c without SIMD (the fallback on CPUs without AVX-512): the same values."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    x86 = subprocess.run(["uname", "-m"], check=False, capture_output=True, text=True).stdout.strip() == "x86_64"
    out = tmp_path / "dequant.so"
    src = Path(cpu_ops.__file__).with_name("cpu") / "dequant.c"
    proc = subprocess.run([cc, "-O2", "-ffp-contract=off", "-fPIC", "-shared", "-Wall", "-Werror",
                           *(["-march=x86-64", "-mno-avx"] if x86 else []), "-o", str(out), str(src)],
                          check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    fn = ctypes.CDLL(str(out)).ss_qdequant
    fn.argtypes, fn.restype = cpu_ops._SIGNATURES["ss_qdequant"], None
    for fmt in FORMATS:
        qw = _weight(fmt, 21, 64, seed=11)
        quants, scales, mins, code = qw._kernel_args
        for dtype, dtype_code in ((torch.float32, 0), (torch.bfloat16, 1)):
            got = torch.empty(21, 64, dtype=dtype)
            fn(quants, scales, mins, 0, 3, 21, 64, got.data_ptr(), code, dtype_code)
            assert torch.equal(got, qw.dequantize().to(dtype)), (fmt, dtype)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dense_pass_equals_the_float_reference(fmt, dtype, monkeypatch):
    monkeypatch.setattr(quant_linear, "DENSE_CHUNK_ROWS", 64)   # 200 outputs: 4 chunks, the last short
    qw = _weight(fmt, 200, 128)
    bias = torch.randn(200, generator=torch.Generator().manual_seed(5))
    layer = QuantLinear(qw, bias)
    layer.dense_rows = 16
    x = torch.randn(2, 20, 128, generator=torch.Generator().manual_seed(7)).to(dtype)   # 40 rows: dense
    ref = nn.functional.linear(x.float(), qw.dequantize(), bias)
    got = layer(x)
    assert got.dtype == dtype and got.shape == (2, 20, 200)
    # float32: the same weights, another summation order; bfloat16: the weight and output rounded
    tol = 1e-5 if dtype == torch.float32 else 0.03 * ref.abs().max().item()
    assert (got.float() - ref).abs().max().item() <= tol
    layer.dense_rows = None                                     # the kernel: the same layer, close
    assert (layer(x).float() - got.float()).abs().max().item() <= 2 * tol


def test_kernel_plan_keeps_the_row_independent_kernel_in_batch_invariant_mode():
    model = nn.Sequential(QuantLinear(_weight(QuantFormat.Q4_1, 64, 64)), QuantLinear(_weight(QuantFormat.Q8_0, 64, 64)))
    apply_kernel_plan(model, KernelPlan.reference(torch.float32))
    assert [(m.dense_rows, m.bf16_dot) for m in model] == [(DENSE_MIN_ROWS, True)] * 2
    apply_kernel_plan(model, KernelPlan.invariant(torch.float32))
    assert [(m.dense_rows, m.bf16_dot) for m in model] == [(None, False)] * 2
    x = torch.randn(DENSE_MIN_ROWS * 2, 64)
    rows = model(x)                                             # every row as it is alone
    assert all(torch.equal(rows[i:i + 1], model(x[i:i + 1])) for i in range(0, len(x), 9))


@pytest.mark.skipif(not cpu_ops.has_bf16_dot(), reason="quant_dot.c is built only with AVX512_BF16")
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
def test_bf16_dot_pass_is_the_bf16_weight_product(fmt):
    """bf16 passes of 32+ rows on kernels/cpu/quant_dot.c: the weight rounded to bf16 once (the dense
    path's values), exact products summed in fp32, one rounding of the output; fewer rows stay on
    the row-independent kernel (decode and verification rows alike)."""
    qw = _weight(fmt, 45, 96)
    bias = torch.randn(45, generator=torch.Generator().manual_seed(5))
    layer = QuantLinear(qw, bias)
    layer.dense_rows, layer.bf16_dot = DENSE_MIN_ROWS, True
    for rows in (32, 35, 45):                                  # 4-row tiles, tails of 3 and 1
        x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).bfloat16()
        ref = nn.functional.linear(x.float(), qw.dequantize().bfloat16().float(), bias)
        got = layer(x)
        assert got.dtype == torch.bfloat16
        assert (got.float() - ref).abs().max().item() <= 0.005 * ref.abs().max().item()
    x = torch.randn(31, 96, generator=torch.Generator().manual_seed(3)).bfloat16()
    layer.bf16_dot = False
    kernel = layer(x)
    layer.bf16_dot = True
    assert torch.equal(layer(x), kernel)                       # 31 rows: the row-independent kernel either way

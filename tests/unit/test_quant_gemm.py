"""The Triton quantized GEMM (kernels/quant_gemm.py) under the interpreter against its reference,
dequantize() then F.linear in float32: every format (Q4_0 from GGUF blocks, the others quantized
at load), float32, bfloat16 and float16 activations, decode and prefill row counts (1, 3, 17, 64:
both tile configs, a partial row tile), N not a multiple of the column tile nor of the 8-column
weight tile, strided and 3-D activations, with and without a bias.

Tolerance: |got - want| <= 3e-6 * sum_k |x_k| (|w_k| + |m|) + 1e-7 (fp32 accumulation in another
order; the 4-bit minimum term m * sum(x) is summed apart, so its magnitude counts), plus, for
16-bit outputs, one unit in the last place of the output (the interpreter truncates fp32 to bf16
where a GPU rounds to nearest; fp16 rounds)."""
import os
import sys

import pytest
import torch

# Set before triton is imported: its own library functions are decorated interpreted or
# compiled at import, the kernels at their decoration.
if "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from kernels._common import interpreting  # noqa: E402
from kernels.cpu_quant import QuantFormat, QuantizedWeight  # noqa: E402
from kernels.quant_gemm import triton_quant_linear  # noqa: E402

if not interpreting():
    pytest.skip("triton was imported before this module could set TRITON_INTERPRET (run it alone)",
                allow_module_level=True)

N, K = 44, 64          # 3 column tiles of the interpreter's 16, the last cut at 44; 2 blocks of 32
ROWS = (1, 3, 17, 64)  # 16-row tiles, then 32-row tiles (17: a partial one)
EPS = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}


def _q4_0_blocks(w: torch.Tensor) -> torch.Tensor:
    """GGUF Q4_0 blocks of w [n, k] as the file stores them: fp16 d, then byte j holding element
    j (low nibble) and j + 16 (high); d = max|w| / 8 signed as gguf does, w = d (q - 8)."""
    n, k = w.shape
    blocks = w.view(n, k // 32, 32)
    idx = blocks.abs().argmax(-1, keepdim=True)
    d16 = (blocks.gather(-1, idx) / -8).to(torch.float16)
    d = d16.float()
    q = (torch.round(blocks * torch.where(d == 0, 0.0, 1 / d)) + 8).clamp(0, 15).to(torch.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)
    return torch.cat([d16.view(torch.uint8), packed], dim=-1).reshape(n, -1)


def _weight(fmt: QuantFormat, seed: int) -> QuantizedWeight:
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * 0.05
    if fmt is QuantFormat.Q4_0:
        return QuantizedWeight.from_gguf(_q4_0_blocks(w).numpy(), 2, (N, K))
    return QuantizedWeight.quantize(w, fmt)


def _allowed(x: torch.Tensor, qw: QuantizedWeight, want: torch.Tensor) -> torch.Tensor:
    mag = qw.dequantize().abs()
    if qw.mins is not None:
        mag = mag + qw.mins.float().abs().transpose(1, 2).reshape(-1, qw.k // 32)[: qw.n].repeat_interleave(32, 1)
    return 3e-6 * (x.float().abs() @ mag.T) + 1e-7 + want.abs() * EPS[x.dtype]


@pytest.mark.parametrize("fmt", list(QuantFormat), ids=lambda f: f.value)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_dequantized_linear(fmt, dtype):
    qw = _weight(fmt, seed=len(fmt.value))
    w = qw.dequantize()
    g = torch.Generator().manual_seed(7)
    bias = torch.randn(N, generator=g)
    for rows in ROWS:
        x = torch.randn(rows, K + 16, generator=g).to(dtype)[:, :K]      # strided rows
        b = bias if rows % 2 else None
        got = triton_quant_linear(x, qw, b)
        assert got.dtype == dtype and got.shape == (rows, N)
        want = torch.nn.functional.linear(x.float(), w, b)
        err = (got.float() - want).abs()
        allowed = _allowed(x, qw, want)
        assert (err <= allowed).all(), (rows, (err / allowed).max().item())


@pytest.mark.parametrize("fmt", [QuantFormat.Q8_0, QuantFormat.Q4_1], ids=lambda f: f.value)
def test_fp16_and_3d_activations(fmt):
    """fp16 (the GPU's other 16-bit dtype; the CPU kernel has none) in a [batch, seq, K] tensor."""
    qw = _weight(fmt, seed=11)
    x = torch.randn(2, 9, K, generator=torch.Generator().manual_seed(12)).half()
    got = triton_quant_linear(x, qw)
    assert got.dtype == torch.float16 and got.shape == (2, 9, N)
    want = torch.nn.functional.linear(x.float(), qw.dequantize())
    assert ((got.float() - want).abs() <= _allowed(x, qw, want)).all()


def test_refuses_what_it_cannot_run():
    qw = _weight(QuantFormat.INT8, seed=1)
    with pytest.raises(TypeError, match="activations"):
        triton_quant_linear(torch.zeros(1, K, dtype=torch.float64), qw)
    with pytest.raises(ValueError, match="features"):
        triton_quant_linear(torch.zeros(1, K + 32), qw)
    assert triton_quant_linear(torch.zeros(0, K), qw).shape == (0, N)


def test_quant_linear_reads_its_buffers_where_they_moved():
    """QuantLinear's frozen QuantizedWeight follows the buffers a `.to(device)` replaces (here a
    clone stands in for the move; the Triton path takes the weight the same way), in its packed
    dtypes even after a module-wide dtype cast."""
    from kernels import cpu_ops
    if cpu_ops.load() is None:
        pytest.skip("no C compiler: the CPU kernel is not built here")
    from cluster.model.quant_linear import QuantLinear
    layer = QuantLinear(_weight(QuantFormat.Q4_1, seed=5), torch.randn(N))
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(6))
    before = layer(x)
    layer._apply(lambda t: t.clone())
    layer.to(torch.bfloat16)
    assert layer(x.bfloat16()).float().allclose(before, atol=2e-2, rtol=2e-2)
    assert layer.qweight.quants is layer.quants and layer.qweight.scales.dtype == torch.float16

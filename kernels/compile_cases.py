"""The steps the compile check records: the engine's attention steps, batch-invariant ops and
quantized GEMM over the model shapes people serve, in every dtype the engine runs.

Each case runs the real host code (the attention backend's `prepare` and `forward` on the meta
device, `batch_invariant.matmul` and `rms_norm` and `quant_gemm.triton_quant_linear` on meta
tensors) under
`launch_record.record_launches`, so the launches are exactly what the backends would select:
which kernel runs a section, split or not, BLOCK_M from the group and the verification width,
the autotune space. The suite compiles `suite_launches()`, a subset that still covers every
launchable kernel and every value of each constexpr the backends choose among; bench compiles
`all_launches()`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kernels import batch_invariant, fused_moe, mla_triton, quant_gemm
from kernels.backend import TritonAttentionBackend
from kernels.cpu_quant import BLOCK, TILE, QuantFormat, QuantizedWeight
from kernels.launch_record import Launch, record_launches, unique


@dataclass(frozen=True)
class AttentionShape:
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: int | None = None


SHAPES = {s.name: s for s in (
    AttentionShape("smollm2-135m", 9, 3, 64),            # the default model (stdlib-coder has the same group)
    AttentionShape("llama3-8b", 32, 8, 128),
    AttentionShape("qwen2.5-0.5b", 14, 2, 64),           # a group of 7
    AttentionShape("mistral-7b", 32, 8, 128, window=4096),
    AttentionShape("head-dim-80", 32, 32, 80),           # MHA, head dim padded to 128 lanes
    AttentionShape("mqa-32", 32, 1, 128),                # wide verification through the prefill kernel
)}
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# The fields of cluster.model.attention.AttentionBatch and PrefillSpan that the backend reads
# (kernels never imports cluster; tests/unit/test_compile_cases.py keeps the two in step).
@dataclass(frozen=True)
class Span:
    query_start: int
    query_len: int
    context_len: int
    block_table: tuple[int, ...]
    tree: tuple[int, ...] = ()
    kv_window: object | None = None   # a windowed chunk's KVWindow (the torch backend's masks; never set here)
    dropped: int = 0
    capture: object | None = None     # a compacting chunk's query capture (the torch backend's; never set here)


@dataclass(frozen=True)
class Batch:
    num_decode: int
    decode_context_lens: tuple[int, ...]
    decode_block_tables: tuple[tuple[int, ...], ...]
    prefills: tuple[Span, ...]
    slot_mapping: torch.Tensor
    block_size: int
    verifies: tuple[Span, ...] = ()


def make_batch(decodes: list[int], verifies: list[tuple[int, int]], prefills: list[tuple[int, int]],
               block_size: int) -> Batch:
    """decodes: context lengths; verifies and prefills: (query len, context len), laid out flat."""
    def table(ctx: int) -> tuple[int, ...]:
        return tuple(range(-(-ctx // block_size)))
    spans, start = {}, len(decodes)
    for kind, items in (("verify", verifies), ("prefill", prefills)):
        spans[kind] = []
        for q_len, ctx in items:
            spans[kind].append(Span(start, q_len, ctx, table(ctx)))
            start += q_len
    return Batch(len(decodes), tuple(decodes), tuple(table(c) for c in decodes), tuple(spans["prefill"]),
                 torch.empty(start, dtype=torch.long, device="meta"), block_size, tuple(spans["verify"]))


def attention_steps(block_size: int, verify_lens: tuple[int, ...]) -> list[Batch]:
    """A mixed short step (one pass each), a long one (split-KV), and verification spans of each
    width (the width sets BLOCK_M; past 128 packed rows the prefill kernel takes them)."""
    steps = [make_batch([40, 17], [(4, 50), (4, 33)], [(30, 30), (20, 100)], block_size),
             make_batch([8192], [(5, 8192)], [], block_size)]
    # A token tree: every row a decode row, the tree's rows reading their path's slots (tails).
    tree = make_batch([40], [(5, 60)], [], block_size)
    steps.append(dataclasses.replace(tree, verifies=(dataclasses.replace(tree.verifies[0], tree=(-1, -1, 0, 2)),)))
    steps += [make_batch([], [(n, 200)], [], block_size) for n in verify_lens]
    return steps


def record_attention(shape: AttentionShape, dtype: torch.dtype, block_size: int = 16,
                     verify_lens: tuple[int, ...] = (2, 9, 17, 33), invariant: bool = False,
                     kv_dtype: torch.dtype | None = None) -> list[Launch]:
    """`kv_dtype`: a quantized cache's (int8, or uint8 for fp8 rows: D + 2 bytes a row); None, `dtype`."""
    backend = TritonAttentionBackend(shape.num_heads, shape.num_kv_heads, shape.head_dim, "meta", invariant=invariant,
                                     dtype=dtype)
    with record_launches() as sink:
        for batch in attention_steps(block_size, verify_lens):
            meta = backend.prepare(batch)
            tokens = batch.slot_mapping.numel()
            q = torch.empty(tokens, shape.num_heads, shape.head_dim, dtype=dtype, device="meta")
            # k and v arrive as views of the fused qkv projection, as the model passes them.
            kv = torch.empty(tokens, 2, shape.num_kv_heads, shape.head_dim, dtype=dtype, device="meta")
            width = shape.head_dim + (2 if kv_dtype is not None else 0)   # quantized rows end in an fp16 scale
            cache = torch.empty(1024, block_size, shape.num_kv_heads, width, dtype=kv_dtype or dtype, device="meta")
            backend.forward(q, kv[:, 0], kv[:, 1], cache, cache, shape.window, meta)
    return unique(sink)


# DeepSeek-V3's latent attention (128 heads, 512 + 64 latent) and a small MLA (16 heads, 256 + 32).
MLA_SHAPES = ((128, 512, 64), (16, 256, 32))


def record_mla(dtype: torch.dtype, shapes=MLA_SHAPES, block_size: int = 16) -> list[Launch]:
    """The absorbed-MLA decode (kernels/mla_triton.py) over a latent cache, on meta tensors."""
    with record_launches() as sink:
        for heads, c_dim, p_dim in shapes:
            rows = 4
            kv = torch.empty(2, 64, block_size, 1, -(-(c_dim + p_dim) // 2), dtype=dtype, device="meta")
            tables = torch.empty(rows, 8, dtype=torch.long, device="meta")
            lens = torch.empty(rows, dtype=torch.long, device="meta")
            mla_triton.mla_decode_triton(torch.empty(rows, heads, c_dim, dtype=dtype, device="meta"),
                                         torch.empty(rows, heads, p_dim, dtype=dtype, device="meta"),
                                         kv, tables, lens, 0.1)
    return unique(sink)


def record_batch_invariant(dtype: torch.dtype, hidden: int = 576, out_features: int = 1536) -> list[Launch]:
    """The batch-invariant linear (with and without bias, one row and several) and RMSNorm
    (with and without the residual) on meta tensors."""
    with record_launches() as sink:
        for rows in (1, 7):
            x = torch.empty(rows, hidden, dtype=dtype, device="meta")
            w = torch.empty(out_features, hidden, dtype=dtype, device="meta")
            batch_invariant.matmul(x, w)
            batch_invariant.matmul(x, w, torch.empty(out_features, dtype=dtype, device="meta"))
            weight = torch.empty(hidden, dtype=dtype, device="meta")
            batch_invariant.rms_norm(x, weight, 1e-6)
            batch_invariant.rms_norm(x, weight, 1e-6, residual=torch.empty_like(x))
    return unique(sink)


def record_fused_moe(dtype: torch.dtype, hidden: int = 2048, inter: int = 768, experts: int = 128,
                     top_k: int = 8, rows: tuple[int, ...] = (8, 512)) -> list[Launch]:
    """The fused MoE kernels (Qwen3-30B-A3B's expert shape by default) at a decode batch and a
    prefill chunk, the routing weights in the model's dtype (Qwen) and in float32 (Mixtral)."""
    meta = lambda *shape, dt=dtype: torch.empty(*shape, dtype=dt, device="meta")   # noqa: E731
    with record_launches() as sink:
        for m in rows:
            for weight_dtype in (dtype, torch.float32):
                fused_moe.fused_moe(meta(m, hidden), meta(experts, 2 * inter, hidden), meta(experts, hidden, inter),
                                    torch.empty(m, top_k, dtype=torch.int64, device="meta"),
                                    meta(m, top_k, dt=weight_dtype))
    return unique(sink)


def _meta_weight(fmt: QuantFormat, n: int, k: int) -> QuantizedWeight:
    """A QuantizedWeight of cpu_quant's layout on the meta device."""
    tiles, blocks = -(-n // TILE), k // BLOCK
    if fmt is QuantFormat.INT8:
        return QuantizedWeight(fmt, n, k, torch.empty(tiles, blocks, TILE, BLOCK, dtype=torch.uint8, device="meta"),
                               torch.empty(tiles * TILE, device="meta"))
    width = BLOCK if fmt is QuantFormat.Q8_0 else BLOCK // 2
    scales = torch.empty(tiles, blocks, TILE, dtype=torch.float16, device="meta")
    return QuantizedWeight(fmt, n, k, torch.empty(tiles, blocks, TILE, width, dtype=torch.uint8, device="meta"),
                           scales, None if fmt is QuantFormat.Q8_0 else torch.empty_like(scales))


def record_quant_gemm(dtype: torch.dtype, hidden: int = 576, out_features: int = 1536,
                      rows: tuple[int, ...] = (1, 7, 300), formats: tuple[QuantFormat, ...] = tuple(QuantFormat),
                      bias: tuple[bool, ...] = (False, True)) -> list[Launch]:
    """The quantized linear (QuantLinear on CUDA) on meta tensors: a decode row (M = 1 is a
    constant to Triton), a decode batch and a prefill chunk (the two tile configs), with the fp32
    bias QuantLinear keeps and without."""
    with record_launches() as sink:
        for fmt in formats:
            qw = _meta_weight(fmt, out_features, hidden)
            for m in rows:
                x = torch.empty(m, hidden, dtype=dtype, device="meta")
                for with_bias in bias:
                    b = torch.empty(out_features, device="meta") if with_bias else None
                    quant_gemm.triton_quant_linear(x, qw, b)
    return unique(sink)


def all_launches() -> list[Launch]:
    """The whole matrix: every shape and dtype in both attention modes with 16-token blocks, and
    the default shape with 32-token blocks too (the block size only moves address arithmetic)."""
    out = []
    for dtype in DTYPES:
        for shape in SHAPES.values():
            for invariant in (False, True):
                out += record_attention(shape, dtype, 16, invariant=invariant)
        out += record_attention(SHAPES["smollm2-135m"], dtype, 32)
        out += quantized_kv_launches(dtype, full=True)
        out += record_mla(dtype)
        for hidden, features in ((576, 1536), (4096, 14336), (8192, 1024)):
            out += record_batch_invariant(dtype, hidden, features)
            out += record_quant_gemm(dtype, hidden, features)
        out += record_fused_moe(dtype)
        out += record_fused_moe(dtype, hidden=4096, inter=14336, experts=8, top_k=2)   # Mixtral-8x7B
    return unique(out)


def suite_launches() -> list[Launch]:
    """The test suite's subset: the default model's shape in bf16 (every verification width, both
    modes), the fp32 worst case for shared memory (head dim 128) and a window; fp16 once."""
    out = record_attention(SHAPES["smollm2-135m"], torch.bfloat16)
    out += quantized_kv_launches(torch.bfloat16)
    out += record_attention(SHAPES["smollm2-135m"], torch.bfloat16, invariant=True)
    out += record_attention(SHAPES["llama3-8b"], torch.float32, verify_lens=(33,))
    out += record_attention(SHAPES["mistral-7b"], torch.float16, verify_lens=())
    out += record_batch_invariant(torch.bfloat16)
    out += record_mla(torch.bfloat16) + record_mla(torch.float32, MLA_SHAPES[:1])   # fp32: the most registers
    # Every format in bf16 and fp32 (IEEE dots: the most registers) at both tile configs; fp16 once.
    out += record_quant_gemm(torch.bfloat16, rows=(1, 300), bias=(False,))
    out += record_quant_gemm(torch.bfloat16, rows=(7,), formats=(QuantFormat.Q4_1,), bias=(True,))
    out += record_quant_gemm(torch.float32, rows=(7, 300), bias=(False,))
    out += record_quant_gemm(torch.float16, rows=(300,), formats=(QuantFormat.Q4_1,), bias=(False,))
    # The fused MoE in bf16 and fp32 (IEEE dots); one decode batch (the tile config is fixed).
    out += record_fused_moe(torch.bfloat16, rows=(8,))
    out += record_fused_moe(torch.float32, rows=(8,))
    return unique(out)


QUANTIZED_KV = (torch.int8, torch.uint8)   # --kv-cache-dtype int8, fp8_e4m3 (kernels/kv_quant.py)


def quantized_kv_launches(dtype: torch.dtype, full: bool = False) -> list[Launch]:
    """Attention over quantized KV rows (the store, and K/V dequantized beside the dots). The
    suite's: int8 in the autotuned launches, only their 8-warp configs (the widest tiles, the
    most registers); fp8 in the invariant ones (one fixed config). `full`: every shape, both
    modes, both kinds, every config."""
    if not full:
        int8 = record_attention(SHAPES["smollm2-135m"], dtype, verify_lens=(), kv_dtype=torch.int8)
        return ([launch for launch in int8 if launch.num_warps == 8 or "store" in launch.kernel]
                + record_attention(SHAPES["smollm2-135m"], dtype, verify_lens=(), invariant=True, kv_dtype=torch.uint8))
    return [launch for kv in QUANTIZED_KV for shape in SHAPES.values() for invariant in (False, True)
            for launch in record_attention(shape, dtype, invariant=invariant, kv_dtype=kv)]

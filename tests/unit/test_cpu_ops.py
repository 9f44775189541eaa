"""The fused C ops (kernels/cpu_ops.py) against the torch code they replace: bit for bit where the
op copies torch's rounding (bf16 norm, RoPE), within fp32 rounding for attention, over the shapes
the engine meets (GQA groups 1-8, head dims that are and are not multiples of 16, windows, block
sizes, ragged lengths, rows strided inside the fused qkv projection)."""
import pytest
import torch

from cluster.model.attention import AttentionBatch, TorchAttentionBackend
from cluster.model.ops import _torch_norm_fused, _torch_norm_ops, apply_rope
from kernels import cpu_ops

if cpu_ops.load() is None:
    pytest.skip("no C compiler: the fused CPU ops are not built here", allow_module_level=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(1, 384), (7, 48), (300, 512)])
def test_rms_norm_and_fused_residual(dtype, rows, hidden):
    g = torch.Generator().manual_seed(rows)
    wide = torch.randn(rows, hidden + 16, generator=g).to(dtype)
    x = wide[:, :hidden]                                  # strided rows, as a slice of a wider output
    w = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    residual = torch.randn(rows, hidden, generator=g).to(dtype)
    ref = (_torch_norm_ops if dtype == torch.bfloat16 else _torch_norm_fused)(x, w, 1e-5)
    got = cpu_ops.rms_norm(x, w, 1e-5)
    if dtype == torch.bfloat16:
        assert torch.equal(got, ref)          # transformers' rounding: normalise in fp32, round, times weight
    else:
        torch.testing.assert_close(got, ref, rtol=2e-6, atol=2e-6)
    summed = residual + x
    res = residual.clone()
    got = cpu_ops.rms_norm(x, w, 1e-5, residual=res)
    assert torch.equal(res, summed)
    torch.testing.assert_close(got, cpu_ops.rms_norm(summed, w, 1e-5), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(6, 2, 64), (4, 4, 16), (8, 1, 80)])
def test_rope_in_place_equals_torch(dtype, heads, kv_heads, dim):
    from cluster.model.llama import RotaryTable
    from cluster.model.model_config import RopeConfig
    rotary = RotaryTable(RopeConfig(kind="default", theta=10000.0), dim, 512)
    rows = 9
    g = torch.Generator().manual_seed(dim)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    positions = torch.randint(0, 512, (rows,), generator=g)
    n = heads + kv_heads
    cos, sin = rotary.lookup(positions, dtype)
    want = apply_rope(qkv[:, : n * dim].view(rows, n, dim), cos, sin)
    got = qkv.clone()
    cpu_ops.rope_(got, positions, rotary.cos, rotary.sin, n, dim)
    assert torch.equal(got[:, : n * dim].view(rows, n, dim), want)
    assert torch.equal(got[:, n * dim:], qkv[:, n * dim:])          # values untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim,block_size,window", [
    (6, 2, 64, 16, None), (8, 1, 128, 4, None), (4, 4, 48, 16, 23), (3, 1, 16, 1, None), (2, 2, 80, 32, 5)])
def test_decode_attention_matches_sdpa(dtype, heads, kv_heads, dim, block_size, window):
    g = torch.Generator().manual_seed(heads * dim)
    lens = [1, 5, block_size, block_size + 1, 3 * block_size + 7, 70]
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for n in lens:
        need = -(-n // block_size)
        tables.append(tuple(perm[used:used + need]))
        used += need
    q = torch.randn(len(lens), heads + 2, dim, generator=g).to(dtype)[:, :heads]   # strided rows
    backend = TorchAttentionBackend(heads, kv_heads, dim, torch.device("cpu"))
    batch = AttentionBatch(num_decode=len(lens), decode_context_lens=tuple(lens), decode_block_tables=tuple(tables),
                           prefills=(), slot_mapping=torch.zeros(len(lens), dtype=torch.long), block_size=block_size)
    meta = backend.prepare(batch).decode
    want = backend._decode(q, k_cache, v_cache, window, meta)
    got = cpu_ops.decode_attention(q, k_cache, v_cache, meta.block_table.view(len(lens), -1), meta.lens, window,
                                   dim ** -0.5)
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_decode_attention_rows_are_batch_invariant():
    """A row's output does not depend on the other rows of the call: bitwise, in bf16."""
    g = torch.Generator().manual_seed(0)
    k_cache = torch.randn(40, 16, 2, 64, generator=g).to(torch.bfloat16)
    v_cache = torch.randn(40, 16, 2, 64, generator=g).to(torch.bfloat16)
    q = torch.randn(5, 6, 64, generator=g).to(torch.bfloat16)
    tables = torch.arange(40).view(5, 8)
    lens = torch.tensor([100, 3, 128, 17, 64])
    together = cpu_ops.decode_attention(q, k_cache, v_cache, tables, lens, None, 0.125)
    for i in range(5):
        alone = cpu_ops.decode_attention(q[i:i + 1], k_cache, v_cache, tables[i:i + 1], lens[i:i + 1], None, 0.125)
        assert torch.equal(alone[0], together[i])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_strided_rows_at_their_slots(dtype):
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, (4 + 2 * 2) * 16, generator=g).to(dtype)
    k = qkv[:, 64:96].view(5, 2, 16)
    v = qkv[:, 96:].view(5, 2, 16)
    slots = torch.tensor([7, 0, 33, 12, 5])
    want_k, want_v = torch.zeros(9, 4, 2, 16, dtype=dtype), torch.zeros(9, 4, 2, 16, dtype=dtype)
    want_k.view(-1, 2, 16).index_copy_(0, slots, k)
    want_v.view(-1, 2, 16).index_copy_(0, slots, v)
    got_k, got_v = torch.zeros_like(want_k), torch.zeros_like(want_v)
    cpu_ops.store_kv(k, v, slots, got_k, got_v)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,inter", [(1, 1024), (70, 40)])
def test_silu_mul_of_the_fused_projection(dtype, rows, inter):
    gate_up = (torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(rows)) * 4).to(dtype)
    want = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    got = cpu_ops.silu_mul(gate_up)
    tol = 2e-6 if dtype == torch.float32 else 1e-2   # exp within a few fp32 ulp; bf16: one rounding step
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(640, 384), (33, 96), (101, 40)])   # AVX-512 blocks and the generic tail
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_small_batch_linear_equals_torch(dtype, n, k, rows):
    g = torch.Generator().manual_seed(n + rows)
    x = torch.randn(rows, k + 8, generator=g).to(dtype)[:, :k]          # strided rows
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    want = torch.nn.functional.linear(x.float(), w.float(), b.float())
    got = cpu_ops.linear(x, w, b)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(45, 96), (13, 40)])   # tiles with column tails; the generic path
def test_small_batch_linear_row_is_independent_of_its_batch(dtype, n, k):
    """A row's output is bitwise the same whatever rows and tiles it shares a call with."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(cpu_ops.LINEAR_MAX_ROWS, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    alone = torch.cat([cpu_ops.linear(x[i : i + 1], w, None) for i in range(len(x))])
    for rows in range(2, len(x) + 1):
        assert torch.equal(cpu_ops.linear(x[:rows], w, None), alone[:rows]), rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(300, 96), (70, 40)])   # several column chunks; the generic path
def test_linear_at_any_row_count_is_batch_invariant(dtype, n, k):
    """The batch-invariant mode's linear: a pass of any length (blocks of LINEAR_MAX_ROWS rows,
    ragged last block, strided rows) gives every row bitwise its result alone, close to F.linear."""
    g = torch.Generator().manual_seed(k)
    wide = torch.randn(37, k + 8, generator=g).to(dtype)
    x = wide[:, :k]
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    alone = torch.cat([cpu_ops.linear(x[i : i + 1], w, b) for i in range(len(x))])
    for rows in (9, 16, 23, 37):
        assert torch.equal(cpu_ops.linear(x[:rows], w, b), alone[:rows]), rows
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(alone.float(), torch.nn.functional.linear(x.float(), w.float(), b.float()),
                               rtol=tol, atol=tol)


@pytest.mark.parametrize("vocab,width", [(49152, 49152), (1000, 1024), (37, 64)])
def test_masked_argmax_equals_torch_argmax_of_the_masked_row(vocab, width):
    """Structured output's greedy rows (cluster/engine/grammar.py): the kernel's token is torch's
    argmax with every forbidden logit at -inf (ties: the first index), -1 when nothing is allowed,
    and with `steer` the row's argmax becomes that token."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, width, generator=g)
    logits[2, :vocab] = torch.randint(0, 3, (vocab,), generator=g).float()      # many ties
    words = -(-vocab // 32)
    masks = torch.randint(-2**31, 2**31 - 1, (7, words), dtype=torch.int32, generator=g)
    masks[1] = 0                                                       # mask row 1 forbids everything
    masks[3] = 0
    masks[3, 0] = 1 << 5                                               # only token 5
    rows, mask_rows = [0, 2, 3, 4, 5], [4, 6, 3, 1, 0]
    bits = ((masks.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).bool().view(7, -1)[:, :vocab]
    want = []
    for r, m in zip(rows, mask_rows):
        masked = torch.where(bits[m], logits[r, :vocab], torch.tensor(float("-inf")))
        want.append(int(masked.argmax()) if bits[m].any() else -1)
    before = logits.clone()
    tokens, maxes = cpu_ops.masked_argmax(logits, masks, rows, mask_rows, vocab, steer=True)
    assert tokens == want
    assert maxes == [float(before[r, :vocab].max()) for r in rows]
    for r, t in zip(rows, tokens):
        if t >= 0:
            assert int(logits[r, :vocab].argmax()) == t
    assert torch.equal(logits[1], before[1])                          # rows not named are untouched


def test_a_second_process_waits_for_the_build_under_way_instead_of_compiling(tmp_path):
    """A command's first start builds the ops in a child process (kernels/cpu_build.py) beside its
    other work; a process that needs them meanwhile waits on the build lock, then loads that build."""
    import fcntl
    import shutil
    import subprocess
    import sys

    from kernels.cpu_build import build_in_background
    built = cpu_ops._build(cpu_ops.Path.home() / ".cache" / "splitserve")   # this process's library (built above)
    folder = tmp_path / "cache"
    (folder / "cpu_ops").mkdir(parents=True)
    with open(folder / "cpu_ops" / ".build.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)                                       # a build under way
        script = ("import logging, sys; from pathlib import Path; logging.basicConfig(level=logging.INFO); "
                  "from kernels import cpu_ops; sys.exit(cpu_ops.load(Path(sys.argv[1])) is None)")
        loader = subprocess.Popen([sys.executable, "-c", script, str(folder)], stderr=subprocess.PIPE, text=True)
        said = iter(loader.stderr.readline, "")
        assert any("waiting for the fused CPU ops another process is building" in line for line in said)
        shutil.copy(built, folder / "cpu_ops" / built.name)                   # ... which finishes
    assert loader.wait(60) == 0
    assert "building the fused CPU ops" not in loader.stderr.read()
    assert build_in_background(folder) is None                                # built: no second build started

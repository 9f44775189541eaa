"""Decode graphs: the padding and static-buffer path of CUDA-graph decode, run on CPU with eager
replays (the same buffers, meta and model call a CUDA graph captures), and on CUDA with real graphs.
Greedy output equals eager decoding; in the batch-invariant mode every logits row is bitwise the
same; pad rows live in a block no sequence owns."""
import pytest
import torch

from cluster.config import CacheConfig, EngineConfig, SchedulerConfig
from cluster.engine.engine import LLMEngine
from cluster.engine.graphs import DecodeBucket, DecodeGraphs, EagerReplay
from cluster.types import SamplingParams
from logits_recorder import LogitsRecorder

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def _prompts(n, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(torch.randint(2, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _engine(model, graphs, device="cpu", dtype="float32", **kw):
    return LLMEngine(EngineConfig(model=model, dtype=dtype, device=device, cuda_graphs=graphs,
                                  cache=CacheConfig(block_size=4, num_blocks=160),
                                  scheduler=SchedulerConfig(max_num_seqs=8), **kw))


def test_pad_rows_fill_the_bucket_with_the_pad_block():
    bucket = DecodeBucket(4, 3, pad_block=9, block_size=4, device=torch.device("cpu"), table_dtype=torch.long)
    bucket.fill([11, 12], [5, 0], [22, 4], [[3, 5], [1]], [6, 1])
    assert bucket.input_ids.tolist() == [11, 12, 0, 0] and bucket.positions.tolist() == [5, 0, 0, 0]
    assert bucket.slots.tolist() == [22, 4, 36, 36]                       # pad rows write the pad block
    assert bucket.tables.tolist() == [[3, 5, 9], [1, 9, 9], [9, 9, 9], [9, 9, 9]]
    assert bucket.lens.tolist() == [6, 1, 1, 1]


def test_capture_warm_up_attends_a_long_context(tiny_model_dir):
    """The capture's warm-up runs are where Triton autotunes decode on CUDA: they attend the
    tuning context (the model's whole context here, 256 < TUNE_CONTEXT), not pad rows of one
    key; the buckets hold pad rows of length 1 again once captured."""
    engine = _engine(tiny_model_dir("llama"), "on")
    seen = []

    def recording_replay(fn, pool):   # as CudaGraphReplay: warm-up runs at construction
        bucket = fn.args[-1]
        seen.append((bucket.size, bucket.lens.unique().tolist()))
        assert torch.isfinite(fn()).any()
        return EagerReplay(fn)
    graphs = DecodeGraphs(engine.model, engine.kv_cache.arena, engine.backend, 4, engine.device, [1, 4, 8],
                          engine.max_model_len // 4, engine.memory_plan.num_blocks, recording_replay)
    assert graphs.tune_context == engine.max_model_len == 256
    assert seen == [(8, [256]), (4, [256]), (1, [256])]
    assert all(b.lens.tolist() == [1] * b.size for b in graphs.buckets.values())
    prompts = _prompts(3, engine.model_config.vocab_size)
    want = [c.token_ids for c in engine.generate(prompts, GREEDY)]
    engine.runner.graphs = graphs
    assert [c.token_ids for c in engine.generate(prompts, GREEDY)] == want
    assert graphs.replays > 0
    engine.pool.check_idle()


@pytest.mark.parametrize("kind", ["llama", "mistral"])
@pytest.mark.parametrize("batch", [3, 5, 8])   # padded to 4, 8 and exactly 8
def test_greedy_with_decode_graphs_equals_eager(kind, batch, tiny_model_dir):
    prompts = _prompts(batch, 384, seed=batch)
    eager = _engine(tiny_model_dir(kind), "off").generate(prompts, GREEDY)
    engine = _engine(tiny_model_dir(kind), "on")
    assert isinstance(next(iter(engine.runner.graphs.buckets.values())).replay, EagerReplay)
    got = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in eager]
    assert engine.runner.graphs.replays >= GREEDY.max_tokens - 2
    assert engine.kv_cache.arena.shape[2] == engine.pool.num_blocks + 1   # the pad block, outside the pool
    engine.pool.check_idle()


def test_graph_rows_are_bitwise_the_eager_rows_in_the_invariant_mode():
    prompts = _prompts(5, 8000, seed=4)
    runs = []
    for graphs in ("off", "on"):
        engine = LLMEngine(EngineConfig(dtype="bfloat16", deterministic=True, cuda_graphs=graphs,
                                        cache=CacheConfig(num_blocks=128)))
        rec = LogitsRecorder(engine)
        runs.append((rec, engine.generate(prompts, GREEDY)))
    (eager, eager_out), (graphed, graphed_out) = runs
    for prompt, out in zip(prompts, graphed_out):
        compared, differ = eager.compare(graphed, prompt + list(out.token_ids))
        assert compared == GREEDY.max_tokens and differ == []


def test_graphs_need_a_decode_kernel_that_reads_static_tables(tiny_model_dir):
    with pytest.raises(ValueError, match="fused C decode kernel"):
        _engine(tiny_model_dir("llama"), "on", kernels="torch")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_decode_equals_eager_on_cuda(tiny_model_dir):
    prompts = _prompts(5, 384, seed=5)
    eager = _engine(tiny_model_dir("llama"), "off", device="cuda").generate(prompts, GREEDY)
    engine = _engine(tiny_model_dir("llama"), "auto", device="cuda")
    assert engine.runner.graphs is not None
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == [o.token_ids for o in eager]
    assert engine.runner.graphs.replays > 0
    engine.pool.check_idle()


def test_auto_leaves_graphs_off_where_the_backend_cannot_replay():
    """The torch backend on a GPU (SDPA over gathered blocks) has no static decode path: "auto"
    keeps eager decoding there instead of refusing to start."""
    from cluster.model.attention import TorchAttentionBackend
    from cluster.model.kernel_plan import KernelPlan
    gpu_torch = TorchAttentionBackend(4, 2, 16, torch.device("cuda"), KernelPlan.reference(torch.float32, "cpu"))
    assert not gpu_torch.static_decode_ready()
    cpu_sdpa = TorchAttentionBackend(4, 2, 16, torch.device("cpu"), KernelPlan.reference(torch.float32, "cpu"))
    assert not cpu_sdpa.static_decode_ready()


@pytest.mark.parametrize("method", ["draft", "quantspec"])
def test_draft_model_passes_replay_their_own_graphs(method):
    """Draft speculation with decode graphs on (the target's plain steps and the draft's
    one-token passes both replayed; quantspec's over the target's own arena) gives the tokens of
    graphs off."""
    from cluster.config import SpeculativeConfig
    from decode.spec.speculator import make_speculator
    prompts = [p for p in _prompts(4, 8000, seed=6)]
    sp = SamplingParams(max_tokens=16, ignore_eos=True, speculative=method, num_speculative_tokens=3)
    outs, engines = [], []
    for graphs in ("off", "on"):
        engine = LLMEngine(EngineConfig(dtype="float32", cuda_graphs=graphs, cache=CacheConfig(num_blocks=128),
                                        speculative=SpeculativeConfig(method=method, num_speculative_tokens=3)),
                           speculator_factory=make_speculator)
        outs.append([o.token_ids for o in engine.generate(prompts, sp)])
        engine.pool.check_idle()
        engines.append(engine)
    assert outs[0] == outs[1]
    draft = engines[1].speculator.proposers[method]
    assert draft.passes.graphs is not None and draft.passes.graphs.replays > 0
    assert engines[0].speculator.proposers[method].passes.graphs is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_verification_steps_replay_as_decode_rows(dtype, tiny_model_dir):
    """n-gram verification through the graphs: every verified token a decode row; greedy output
    equals graphs off, and in the invariant mode the rows are bitwise those of plain decoding."""
    from cluster.config import SpeculativeConfig
    from decode.spec.speculator import make_speculator
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    sp = SamplingParams(max_tokens=16, ignore_eos=True, speculative="ngram", num_speculative_tokens=3)
    outs, recs = [], []
    for graphs in ("off", "on"):
        engine = LLMEngine(EngineConfig(model=tiny_model_dir("llama"), dtype=dtype, deterministic=dtype == "bfloat16",
                                        cuda_graphs=graphs, cache=CacheConfig(block_size=4, num_blocks=128),
                                        speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3)),
                           speculator_factory=make_speculator)
        verified = []
        if engine.runner.graphs is not None:
            run = engine.runner.graphs.run
            engine.runner.graphs.run = lambda plan, bucket: (verified.append(len(plan.verifies)), run(plan, bucket))[1]
        recs.append(LogitsRecorder(engine))
        outs.append([o.token_ids for o in engine.generate([prompt, prompt[:9]], sp)])
        engine.pool.check_idle()
    assert outs[0] == outs[1]
    assert sum(verified) > 0, "no verification step went through the graphs"
    if dtype == "bfloat16":
        for p, out in zip((prompt, prompt[:9]), outs[1]):
            compared, differ = recs[0].compare(recs[1], p + list(out))
            assert compared and differ == []

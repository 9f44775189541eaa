"""Batch-invariant mode (`deterministic`), in bf16: a request's logits rows are bitwise the same
alone and inside batches of 2, 8 and 32 mixed requests (some sharing its prefix, some prefilled
in chunks beside it, some preempted), as decode rows, as prefill-chunk rows and inside
speculative verification spans; and a deliberately batch-variant reduction makes the same check
fail (the check has teeth)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cluster.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from cluster.engine.engine import LLMEngine
from cluster.model.linear import InvariantLinear
from cluster.types import SamplingParams
from kernels import cpu_ops
from logits_recorder import LogitsRecorder

if cpu_ops.load() is None:
    pytest.skip("no C compiler: the batch-invariant CPU kernels are not built here", allow_module_level=True)

MAX_TOKENS = 16
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


def _engine(model=None, budget=2048, num_blocks=512, spec="off", dtype="bfloat16") -> LLMEngine:
    from decode.spec.speculator import make_speculator  # noqa: PLC0415
    kwargs = {} if model is None else {"model": model}
    config = EngineConfig(**kwargs, dtype=dtype, deterministic=True,
                          cache=CacheConfig(num_blocks=num_blocks),
                          scheduler=SchedulerConfig(max_num_batched_tokens=budget),
                          speculative=SpeculativeConfig(method=spec))
    return LLMEngine(config, speculator_factory=make_speculator if spec != "off" else None)


def _prompts(n: int, vocab: int, seed: int, prefix: list[int]) -> list[list[int]]:
    """Mixed neighbours: every third one shares the target's first 48 tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(3, 160, (1,), generator=g))
        tail = torch.randint(5, vocab, (length,), generator=g).tolist()
        out.append(prefix[:48] + tail if i % 3 == 0 else tail)
    return out


@pytest.fixture(scope="module")
def target():
    g = torch.Generator().manual_seed(11)
    return torch.randint(5, 8000, (130,), generator=g).tolist()   # crosses 9 blocks of 16


@pytest.fixture(scope="module")
def alone(target):
    """The target alone, prefilled in one pass: the reference rows."""
    engine = _engine()
    rec = LogitsRecorder(engine)
    out = engine.generate([target], GREEDY)[0]
    engine.pool.check_idle()
    return rec, list(out.token_ids)


def _run_batch(engine, target, neighbours, warm_prefix=False):
    rec = LogitsRecorder(engine)
    if warm_prefix:   # the target's first 64 tokens in the prefix cache before the batch
        engine.generate([target[:64]], SamplingParams(max_tokens=1))
    outs = engine.generate([*neighbours, target], GREEDY)   # the target last: the youngest, preempted first
    engine.pool.check_idle()
    return rec, outs


def _check_against_alone(alone, target, rec, out) -> list[int]:
    ref_rec, ref_tokens = alone
    full = target + list(out.token_ids)
    compared, differ = ref_rec.compare(rec, full)
    assert compared == MAX_TOKENS   # the prompt's last row, then every decode row
    return differ


@pytest.mark.parametrize("size,budget,blocks", [(2, 2048, 512), (8, 48, 512), (32, 64, 40)])
def test_row_is_bitwise_the_same_in_any_batch(size, budget, blocks, alone, target):
    engine = _engine(budget=budget, num_blocks=blocks)
    rec, outs = _run_batch(engine, target, _prompts(size - 1, 8000, size, target), warm_prefix=size == 8)
    out = outs[-1]
    assert _check_against_alone(alone, target, rec, out) == []
    assert list(out.token_ids) == alone[1]
    if size == 8:
        assert out.num_cached_tokens == 64
    if size == 32:   # the pool is too small for the batch: the target was preempted and recomputed
        assert tuple(target) in rec.preempted


def _split_k_linear(self, x):
    """A batch-VARIANT linear: a split-K sum whose split depends on the number of rows."""
    splits = 1 + x.shape[0] % 3
    out = sum(F.linear(x[:, c].float(), self.weight[:, c].float()) for c in torch.arange(x.shape[1]).chunk(splits))
    if self.bias is not None:
        out = out + self.bias.float()
    return out.to(x.dtype)


def test_the_check_has_teeth(alone, target, monkeypatch):
    """The same comparison with one batch-variant reduction in the linears reports differing rows."""
    monkeypatch.setattr(InvariantLinear, "forward", _split_k_linear)
    alone_engine = _engine()
    ref = LogitsRecorder(alone_engine)
    alone_engine.generate([target], GREEDY)
    rec, outs = _run_batch(_engine(budget=48), target, _prompts(7, 8000, 8, target))
    compared, differ = ref.compare(rec, target + list(outs[-1].token_ids))
    assert compared and differ, "a batch-variant linear went unnoticed"


@pytest.mark.parametrize("method", ["ngram", "draft", "eagle"])
def test_speculative_verification_rows_equal_decode_rows(method):
    """Speculation in the invariant mode: rows computed inside verification spans equal the plain
    decode rows of the same positions, so greedy output equals plain decoding."""
    engine = _engine(spec=method, budget=64)
    tok = engine.tokenizer
    code = "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n"
    prompt = tok.encode(code).ids
    plain = _engine()
    plain_rec = LogitsRecorder(plain)
    want = plain.generate([prompt], GREEDY)[0]
    rec = LogitsRecorder(engine)
    outs = engine.generate([prompt, *_prompts(3, 8000, 5, prompt)], SamplingParams(
        max_tokens=MAX_TOKENS, ignore_eos=True, speculative=method, num_speculative_tokens=4))
    assert list(outs[0].token_ids) == list(want.token_ids)
    compared, differ = plain_rec.compare(rec, prompt + list(want.token_ids))
    assert compared == MAX_TOKENS and differ == []
    assert rec.verified > MAX_TOKENS // 2   # most positions were computed inside verification spans
    engine.pool.check_idle()


@pytest.mark.parametrize("kind", ["llama", "mistral"])   # mistral: a sliding window shorter than the prompts
def test_tiny_checkpoints_in_bf16(kind, tiny_model_dir):
    model = tiny_model_dir(kind)
    g = torch.Generator().manual_seed(3)
    target = torch.randint(3, 384, (45,), generator=g).tolist()
    ref_engine = _engine(model)
    ref = LogitsRecorder(ref_engine)
    want = ref_engine.generate([target], GREEDY)[0]
    engine = _engine(model, budget=24)
    rec = LogitsRecorder(engine)
    outs = engine.generate([*_prompts(7, 384, 9, target), target], GREEDY)
    compared, differ = ref.compare(rec, target + list(want.token_ids))
    assert compared == MAX_TOKENS and differ == []
    assert list(outs[-1].token_ids) == list(want.token_ids)


def test_seeded_sampling_is_the_same_in_any_batch(target):
    """A seeded request draws the same tokens alone and beside others (its own generator; rows
    bitwise equal, so the same probabilities meet the same noise)."""
    sp = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.9, top_p=0.95, seed=1234)
    want = _engine().generate([target], sp)[0].token_ids
    neighbours = _prompts(7, 8000, 21, target)
    outs = _engine(budget=48).generate([*neighbours, target],
                                       [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7)] * 7 + [sp])
    assert outs[-1].token_ids == want


def test_the_invariant_plan_is_one_choice_for_every_row_count():
    from cluster.model.kernel_choice import invariant_plan
    from cluster.model.kernel_plan import KernelPlan, LinearPath
    plan = invariant_plan(torch.bfloat16, torch.device("cpu"))
    assert plan.batch_invariant and plan.linear is LinearPath.INVARIANT
    assert len(set(plan.norm)) == len(set(plan.rope)) == len(set(plan.act)) == 1
    assert KernelPlan.from_json(plan.to_json()) == plan
    with pytest.raises(ValueError, match="float32 or bfloat16, not torch.float16"):
        invariant_plan(torch.float16, torch.device("cpu"))

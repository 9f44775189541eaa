"""Constrained decoding in the engine: every output parses and matches its constraint, and a
constraint gives the same tokens on every path a request can take: speculation (chains and
trees, the drafts masked along their paths), n > 1 forks, a P/D handoff's decode side and a
failover's resume from the streamed tokens. Every block comes back."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from cluster.config import CacheConfig, EngineConfig, SpeculativeConfig
from cluster.engine.engine import LLMEngine
from cluster.engine.grammar import GrammarError, build_grammar
from cluster.types import FinishReason, Fork, SamplingParams, StructuredKind, StructuredOutput
from decode.handoff import add_prefilled
from decode.spec.speculator import make_speculator
from prefill.handoff import PrefillHandoff

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "size": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "tags": {"type": "array", "items": {"enum": ["os", "io", "re"]},
                                                    "maxItems": 3}},
          "required": ["name", "size", "tags"], "additionalProperties": False}
JSON_SCHEMA = StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(SCHEMA))
PROMPTS = ["def config():\n    return ", "import json\n\ndata = ", "# settings\nSETTINGS = "]
MAX_TOKENS = 60


def _config(**kw):
    return EngineConfig(num_threads=2, deterministic=True, cache=CacheConfig(num_blocks=256), **kw)


@pytest.fixture(scope="module")
def plain():
    return LLMEngine(_config())


@pytest.fixture(scope="module")
def reference(plain):
    outs = plain.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, structured=JSON_SCHEMA))
    return [o.token_ids for o in outs]


def _spec(method, k, **kw):
    return LLMEngine(_config(speculative=SpeculativeConfig(method=method, num_speculative_tokens=k, **kw)),
                     speculator_factory=make_speculator)


def test_every_kind_of_constraint_holds(plain):
    cases = [(JSON_SCHEMA, lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
             (StructuredOutput(StructuredKind.JSON_OBJECT), lambda t: isinstance(json.loads(t), dict) or 1 / 0),
             (StructuredOutput(StructuredKind.REGEX, r"[a-z]{2,6}_\d{2}"),
              lambda t: re.fullmatch(r"[a-z]{2,6}_\d{2}", t) or 1 / 0),
             (StructuredOutput(StructuredKind.CHOICE, json.dumps(["alpha", "beta", "gamma"])),
              lambda t: t in ("alpha", "beta", "gamma") or 1 / 0),
             (StructuredOutput(StructuredKind.GRAMMAR, 'root ::= "x = " [0-9] [0-9]? ("." [0-9] [0-9]?)?'),
              lambda t: re.fullmatch(r"x = \d\d?(\.\d\d?)?", t) or 1 / 0),
             (StructuredOutput(StructuredKind.LARK, 'start: "ok(" NAME ")"\nNAME: /[a-z]+/'),
              lambda t: re.fullmatch(r"ok\([a-z]+\)", t) or 1 / 0)]
    outs = plain.generate([PROMPTS[0]] * len(cases), [SamplingParams(max_tokens=MAX_TOKENS, structured=s)
                                                      for s, _ in cases])
    for (spec, check), out in zip(cases, outs):
        assert out.finish_reason is FinishReason.STOP, (spec.kind, out.text)
        check(out.text)
    # A sampled constrained request holds too.
    sampled = plain.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=7,
                                                     structured=JSON_SCHEMA))
    for out in sampled:
        if out.finish_reason is FinishReason.STOP:
            jsonschema.validate(json.loads(out.text), SCHEMA)
    plain.pool.check_idle()


def test_constrained_output_equals_itself_in_mixed_batches(plain, reference):
    """Constrained and free requests share steps; the masks land on the constrained rows only."""
    free = SamplingParams(max_tokens=20)
    want_free = [o.token_ids for o in plain.generate(PROMPTS, free)]
    outs = plain.generate(PROMPTS * 2, [SamplingParams(max_tokens=MAX_TOKENS, structured=JSON_SCHEMA)] * 3 + [free] * 3)
    assert [o.token_ids for o in outs[:3]] == reference
    assert [o.token_ids for o in outs[3:]] == want_free
    for o in outs[:3]:
        jsonschema.validate(json.loads(o.text), SCHEMA)


@pytest.mark.parametrize("method,k,tree", [("ngram", 4, 0), ("draft", 3, 0), ("eagle", 3, 0), ("eagle", 3, 4)])
def test_speculation_keeps_constrained_greedy_output(method, k, tree, reference):
    engine = _spec(method, k, spec_tree_budget=tree, spec_tree_min_gain=0.0)
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, structured=JSON_SCHEMA))
    assert [o.token_ids for o in outs] == reference
    stats = engine.speculator.stats()[method]
    assert stats["steps"] > 0 and stats["accepted"] > 0, stats
    engine.pool.check_idle()


def test_forks_each_keep_the_constraint(plain):
    forks = [Fork(f"f{j}", SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=10 + j,
                                          structured=JSON_SCHEMA)) for j in range(3)]
    lead = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=9, structured=JSON_SCHEMA)
    rid = plain.add_request(PROMPTS[1], lead, forks=forks)
    texts: dict[str, str] = {}
    ended = {}
    while plain.has_unfinished():
        for d in plain.step():
            texts[d.request_id] = texts.get(d.request_id, "") + d.text
            if d.finished:
                ended[d.request_id] = d.finish_reason
    for name in (rid, "f0", "f1", "f2"):
        if ended[name] is FinishReason.STOP:
            jsonschema.validate(json.loads(texts[name]), SCHEMA)
    assert len({texts[n] for n in (rid, "f0", "f1", "f2")}) > 1     # four samples, not one
    plain.pool.check_idle()


def test_resume_from_streamed_tokens_continues_the_same_output(plain, reference):
    """A failover's new attempt: the prompt plus the tokens already streamed, the matcher moved
    past them (`skip_samples`), gives exactly the rest of a fault-free run."""
    prompt_ids = plain.validate_prompt(PROMPTS[0])
    full = reference[0]
    for cut in (1, 7, len(full) // 2):
        sp = SamplingParams(max_tokens=MAX_TOKENS - cut, structured=JSON_SCHEMA)
        rid = plain.add_request([*prompt_ids, *full[:cut]], sp)
        plain.skip_samples(rid, cut)
        tokens = []
        while plain.has_unfinished():
            tokens += [t for d in plain.step() if d.request_id == rid for t in d.token_ids]
        assert [*full[:cut], *tokens] == list(full), cut
    plain.pool.check_idle()


def test_handed_off_request_continues_under_its_constraint(plain, reference):
    """Both sides of a P/D handoff: the producer's first token obeys the constraint, the consumer
    rebuilds the matcher past it on the copied blocks, and the rest equals one engine's."""
    sp = SamplingParams(max_tokens=MAX_TOKENS, structured=JSON_SCHEMA)
    producer = LLMEngine(_config(), hold_factory=PrefillHandoff)
    hold = producer.hold_hook
    rid = producer.add_request(PROMPTS[2], SamplingParams(max_tokens=1, structured=JSON_SCHEMA), "h1", hold_kv=True)
    first = None
    while producer.has_unfinished():
        for d in producer.step():
            first = d.token_ids[0] if d.request_id == rid and d.token_ids else first
    assert first == reference[2][0]
    prompt = list(hold.leases[rid].seq.prompt_token_ids)
    blocks, _ = hold.take(rid)
    local = plain.pool.allocate(len(blocks))
    plain.kv_cache.arena[:, :, local] = producer.kv_cache.arena[:, :, blocks]
    hold.release(rid)
    add_prefilled(plain, rid, prompt, first, sp, local)
    got = [first]
    while plain.has_unfinished():
        got += [t for d in plain.step() if d.request_id == rid for t in d.token_ids]
    assert got == list(reference[2])
    plain.pool.check_idle()
    producer.pool.check_idle()


def test_bad_constraints_are_refused_by_name():
    with pytest.raises(GrammarError, match="json_schema"):
        build_grammar(StructuredOutput(StructuredKind.JSON_SCHEMA, '{"type": "object", "properties": 5}'))
    with pytest.raises(GrammarError, match="regex"):
        build_grammar(StructuredOutput(StructuredKind.REGEX, "(unclosed"))
    with pytest.raises(GrammarError, match="grammar"):
        build_grammar(StructuredOutput(StructuredKind.GRAMMAR, "root ::= undefined_rule"))
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured=JSON_SCHEMA)


def test_compiled_grammars_are_cached_and_bounded(plain, monkeypatch):
    import cluster.engine.grammar as grammar
    runtime = plain.grammar
    monkeypatch.setattr(grammar, "COMPILED_CACHE_SIZE", 2)
    runtime._compiled.clear()
    specs = [StructuredOutput(StructuredKind.REGEX, f"a{{{i}}}") for i in range(1, 4)]
    first = runtime.compiled(specs[0])
    assert runtime.compiled(specs[0]) is first                 # a hit: the same compiled grammar
    for spec in specs[1:]:
        runtime.compiled(spec)
    assert list(runtime._compiled) == specs[1:]                # the least recently used one went

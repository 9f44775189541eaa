"""Online adaptation on one engine (decode/spec/online/): what a decode worker captures of served
traffic, the score promotion and rollback rest on (against the dense reference drafter), training
that lifts held-out acceptance, and per-tenant head versions that never change the output."""
from __future__ import annotations

import glob
from dataclasses import replace

import pytest
import torch

from cluster.config import STDLIB_CODER_DIR, EngineConfig, SpeculativeConfig
from cluster.engine.engine import LLMEngine
from cluster.types import SamplingParams
from decode.spec.online.messages import HeadUpdate, pack_tensors
from decode.spec.online.trainer import HeadTrainer
from decode.spec.speculator import make_speculator
from decode.spec.heads.eagle import draft_greedy

# Held-out code the model was not trained on: the standard library's json package.
PROMPTS = [open(f).read()[a:a + 500] for a in (0, 1500) for f in sorted(glob.glob("/usr/lib/python3*/json/*.py"))[:6]]
MAX_TOKENS = 96


def _run(engine: LLMEngine, tenant: str, **sampling) -> list[list[int]]:
    ids = [engine.add_request(p, SamplingParams(max_tokens=MAX_TOKENS, **sampling), f"{tenant}-{i}-{len(sampling)}",
                              tenant=tenant) for i, p in enumerate(PROMPTS)]
    seqs = [engine.requests.seqs[i] for i in ids]
    while any(not s.is_finished for s in seqs):
        engine.step()
    return [list(s.token_ids) for s in seqs]


@pytest.fixture(scope="module")
def served():
    config = EngineConfig(dtype="float32", num_threads=2, speculative=SpeculativeConfig(
        method="eagle", num_speculative_tokens=4, spec_online=True, spec_online_tenants="acme,beta"))
    engine = LLMEngine(config, speculator_factory=make_speculator)
    outputs = {t: _run(engine, t) for t in ("acme", "beta", "gamma")}
    samples, counts = engine.speculator.take_online()
    trainer = HeadTrainer(engine.speculator.models.eagle_dir, config.model)
    yield engine, outputs, samples, counts, trainer
    engine.pool.check_idle()


def test_only_opted_in_tenants_traffic_is_kept_each_in_its_own_samples(served):
    engine, outputs, samples, counts, _ = served
    assert {s.tenant for s in samples} == {"acme", "beta"}, "gamma did not opt in: nothing of it is kept"
    for s in samples:
        whole = next(o for o in outputs[s.tenant] if o[s.first_pos:s.first_pos + len(s.tokens)] == list(s.tokens))
        assert len(whole) == s.first_pos + len(s.tokens) + 1, "every computed position; the last token has none"
        assert s.features.shape == (len(s.tokens), engine.model_config.hidden_size)
    assert {(c.tenant, c.version) for c in counts} == {("acme", 0), ("beta", 0)}
    assert engine.speculator.take_online()[0] == (), "a take hands the samples over once"


def test_features_are_the_targets_hidden_states(served):
    import transformers
    from decode.spec.heads.eagle import FeatureHook
    _, outputs, samples, _, _ = served
    sample = samples[0]
    whole = next(o for o in outputs[sample.tenant] if o[sample.first_pos:sample.first_pos + len(sample.tokens)]
                 == list(sample.tokens))
    assert sample.first_pos == len(whole) - 1 - MAX_TOKENS, "from the prompt's last position on"
    hf = transformers.LlamaForCausalLM.from_pretrained(STDLIB_CODER_DIR, torch_dtype=torch.float32).eval()
    hook = FeatureHook(hf)
    with torch.no_grad():
        hf(torch.tensor([whole[:-1]]))
    hook.remove()
    torch.testing.assert_close(sample.features, hook.f[0, sample.first_pos:], atol=2e-3, rtol=2e-3)


def test_the_score_is_the_dense_reference_drafters_chain_acceptance(served):
    _, _, samples, _, trainer = served
    sample = min(samples, key=lambda s: len(s.tokens))
    tokens, f, depth = list(sample.tokens), sample.features.float(), trainer.depth
    trainer.load(trainer.base)
    accepted = []
    for p in range(len(tokens) - depth):
        drafted = draft_greedy(trainer.head, trainer.tp, tokens[:p + 1], f, depth)
        run = 0
        while run < depth and drafted[run] == tokens[p + 1 + run]:
            run += 1
        accepted.append(run)
    assert trainer.score(trainer.base, [sample]) == pytest.approx(sum(accepted) / len(accepted), abs=1.5 / len(accepted))


def test_training_fits_the_served_traffic(served):
    """The fit itself (what a round starts from). Whether it generalizes is the held-out check's
    job (policy.py); on the default model's code traffic it lifted unseen files' acceptance 2.8x
    (docs/benchmarks.md)."""
    _, _, samples, _, trainer = served
    acme = [s for s in samples if s.tenant == "acme"]
    before = trainer.score(trainer.base, acme)
    tuned = trainer.train(trainer.base, acme, steps=60, max_passes=float("inf"))   # no cap: the fit alone
    assert trainer.score(tuned, acme) >= 1.15 * before, (before, trainer.score(tuned, acme))
    assert sorted(tuned) == sorted(trainer.names)
    assert tuned.keys() == trainer.base.keys() and any(not torch.equal(tuned[k], trainer.base[k]) for k in tuned)


def test_a_tenants_head_version_drafts_for_it_alone_and_never_changes_the_output(served):
    engine, outputs, samples, _, trainer = served
    heads = engine.speculator.heads
    tuned = trainer.train(trainer.base, [s for s in samples if s.tenant == "acme"], steps=20)
    update = HeadUpdate("acme", 1, heads.target_fingerprint, heads.base_head, pack_tensors(tuned))
    heads.stage(update, heads.build_update(update))
    heads.activate("acme", 1)
    assert heads.head_for("acme") is not heads.base and heads.head_for("beta") is heads.base
    plain = _run(engine, "plain", speculative="off")
    assert _run(engine, "acme") == plain and _run(engine, "beta") == plain == outputs["acme"]
    _, counts = engine.speculator.take_online()
    versions = {(c.tenant, c.version) for c in counts if c.steps}
    assert ("acme", 1) in versions and ("beta", 0) in versions and ("acme", 0) not in versions
    heads.activate("acme", 0, rollback=True)
    assert [(h.tenant, h.version, h.swaps, h.rollbacks) for h in heads.versions()] == [("acme", 0, 2, 1)]


def test_a_head_for_other_weights_or_another_base_is_refused(served):
    engine, _, _, _, trainer = served
    heads = engine.speculator.heads
    good = pack_tensors(trainer.base)
    with pytest.raises(ValueError, match="other target weights"):
        heads.build_update(HeadUpdate("acme", 2, "safetensors-sha256:feed", heads.base_head, good))
    with pytest.raises(ValueError, match="adapts the head"):
        heads.build_update(HeadUpdate("acme", 2, heads.target_fingerprint, "another-head", good))
    partial = pack_tensors({k: v for k, v in list(trainer.base.items())[1:]})
    with pytest.raises(ValueError, match="exactly"):
        heads.build_update(HeadUpdate("acme", 2, heads.target_fingerprint, heads.base_head, partial))
    with pytest.raises(KeyError, match="not staged"):
        heads.activate("acme", 7)


def test_the_setting_needs_an_eagle_head():
    with pytest.raises(ValueError, match="spec_online"):
        SpeculativeConfig(method="ngram", spec_online=True)
    assert not replace(SpeculativeConfig(method="eagle"), spec_online=False).online_tenant("acme")

"""The block drafter (`--speculative block`) at serving time: the engine's drafts equal the dense
training reference's over transformers' own hidden states; greedy output equals plain decoding,
through prefix-cache hits and a P/D handoff (the prefill engine's window of features crosses in
the handoff); the handoff's window is checked; a drafter for other weights is refused by name."""
import json

import pytest
import torch

from cluster.config import STDLIB_CODER_DIR, CacheConfig, EngineConfig, SpeculativeConfig
from cluster.engine.engine import LLMEngine
from cluster.engine.scheduler import StepPlan
from cluster.types import SamplingParams
from decode.handoff import add_prefilled
from decode.spec.block import window_of
from decode.spec.compat import check_speculative_models, weights_fingerprint
from decode.spec.speculator import make_kv_only_speculator, make_speculator
from decode.spec.heads.block import (BlockConfig, BlockDrafter, draft_block_reference, load_block_drafter,
                                     save_block_drafter)
from decode.spec.heads.eagle import EagleConfig, load_target_parts
from prefill.handoff import PrefillHandoff

LAYERS = (0, 2, 4)
PROMPTS = ["import os\n\nclass Config:\n    def __init__(self, path):\n        self.path = path\n",
           "def parse(self, text):\n", "import sys\n\nfor line in sys.stdin:\n"]


def _random_drafter(tmp_path, fingerprint: str, context: int = 6):
    base = EagleConfig.from_target(str(STDLIB_CODER_DIR), intermediate_size=256)
    d2t = torch.randperm(base.vocab_size, generator=torch.Generator().manual_seed(1))[:512].sort().values
    cfg = BlockConfig(**vars(base), block_size=6, context=context, feature_layers=LAYERS, draft_vocab_size=512,
                      emb_scale=3.0)
    drafter = BlockDrafter(cfg, d2t)
    drafter.init_weights(seed=0, std=0.05)
    with torch.no_grad():
        drafter.depth_scale.copy_(torch.tensor([2.0, 5.0, 9.0]))   # folded into fuse on export
    out = tmp_path / "block"
    save_block_drafter(drafter, str(out), "stdlib-coder", fingerprint)
    return out


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    return _random_drafter(tmp_path_factory.mktemp("block"), weights_fingerprint(STDLIB_CODER_DIR))


def _engine(drafter_dir, prefix_caching: bool = True, factory=make_speculator, hold_factory=None):
    return LLMEngine(EngineConfig(model=STDLIB_CODER_DIR, dtype="float32", num_threads=2,
                                  cache=CacheConfig(enable_prefix_caching=prefix_caching),
                                  speculative=SpeculativeConfig(method="block", block_drafter=drafter_dir,
                                                                num_speculative_tokens=4)),
                     speculator_factory=factory, hold_factory=hold_factory)


def _run(engine, prompts, sp, cached: list | None = None):
    done = engine.generate(prompts, sp)
    engine.pool.check_idle()
    if cached is not None:
        cached.extend(c.num_cached_tokens for c in done)
    return [list(c.token_ids) for c in done]


def test_engine_drafts_what_the_dense_reference_drafts(drafter_dir):
    import transformers
    engine = _engine(drafter_dir)
    rid = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=8))
    engine.step()                                     # prefill: first token and the window
    seq = engine.requests.seqs[rid]
    k = 4
    assert engine.scheduler.lookahead_room(seq, k, StepPlan(budget_left=k)) == k
    window = window_of(seq)
    assert window.pos == seq.num_computed_tokens - 1 and len(window.rows) == 6
    drafted = engine.speculator.proposers["block"].propose([seq], [k], [None])[0].tokens

    hf = transformers.LlamaForCausalLM.from_pretrained(STDLIB_CODER_DIR, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        hs = hf(torch.tensor([seq.token_ids]), output_hidden_states=True).hidden_states
    feats3 = torch.cat([hs[i + 1][0] for i in LAYERS], dim=-1)
    reference = load_block_drafter(str(drafter_dir)).float()
    expected = draft_block_reference(reference, load_target_parts(str(STDLIB_CODER_DIR)), list(seq.token_ids),
                                     feats3, k)
    assert list(drafted) == expected
    assert set(drafted) <= set(reference.d2t.tolist())
    engine.abort(rid)
    engine.step()
    engine.pool.check_idle()


def test_greedy_output_equals_plain_decoding_through_prefix_hits(drafter_dir):
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = LLMEngine(EngineConfig(model=STDLIB_CODER_DIR, dtype="float32", num_threads=2))
    want = _run(plain, PROMPTS, sp)
    plain_cached: list[int] = []
    _run(plain, PROMPTS, sp, plain_cached)
    engine = _engine(drafter_dir)
    assert _run(engine, PROMPTS, sp) == want
    cached: list[int] = []
    assert _run(engine, PROMPTS, sp, cached) == want    # the second round starts from prefix hits
    assert cached == plain_cached and cached[0] > 0     # drafting took nothing from the prefix cache
    counts = engine.speculator.stats()["block"]
    assert counts["drafted"] > 0 and counts["steps"] > 0


def test_the_window_crosses_a_handoff_and_output_equals_one_engine(drafter_dir):
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    want = _run(_engine(drafter_dir), PROMPTS[:1], sp)[0]
    producer = _engine(drafter_dir, factory=make_kv_only_speculator, hold_factory=PrefillHandoff)
    hold = producer.hold_hook
    consumer = _engine(drafter_dir)
    rid = producer.add_request(PROMPTS[0], SamplingParams(max_tokens=1, ignore_eos=True), "h1", hold_kv=True)
    first = None
    while producer.has_unfinished():
        for d in producer.step():
            if d.request_id == rid and d.token_ids:
                first = d.token_ids[0]
    prompt = list(hold.leases[rid].seq.prompt_token_ids)
    feature = hold.take_feature(rid)
    assert len(feature) == 6 * 384 * 4                # the window: 6 fused rows, float32
    with pytest.raises(ValueError, match="1 to 6 rows of the prompt's fused features"):
        consumer.speculator.import_state(feature[:-4], len(prompt))
    blocks, _ = hold.take(rid)
    local = consumer.pool.allocate(len(blocks))
    consumer.kv_cache.arena[:, :, local] = producer.kv_cache.arena[:, :, blocks]
    hold.release(rid)
    add_prefilled(consumer, rid, prompt, first, sp, local, feature=feature)
    got = [first]
    while consumer.has_unfinished():
        for d in consumer.step():
            got.extend(d.token_ids)
    assert got == want
    assert consumer.speculator.stats()["block"]["drafted"] > 0
    for e in (producer, consumer):
        e.pool.check_idle()


def test_a_drafter_for_other_weights_or_layers_is_refused(tmp_path):
    other = _random_drafter(tmp_path, "safetensors-sha256:" + "0" * 64)
    cfg = EngineConfig(model=STDLIB_CODER_DIR, speculative=SpeculativeConfig(method="block", block_drafter=other))
    with pytest.raises(ValueError, match="trained for other weights"):
        check_speculative_models(cfg, disaggregated=False)
    raw = json.loads((other / "config.json").read_text())
    raw["feature_layers"] = [0, 2, 9]
    (other / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"reads the outputs of layers \[0, 2, 9\], but the target has 6 layers"):
        check_speculative_models(cfg, disaggregated=False)
    raw["model_type"] = "splitserve_eagle3"
    (other / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="is not a block drafter"):
        check_speculative_models(cfg, disaggregated=False)


def test_the_default_models_shipped_drafter_drafts_well_and_changes_nothing():
    """SmolLM2-135M-Instruct with its shipped block drafter, on chat questions it was not trained
    on: the greedy answers equal plain decoding's, and the drafter earns its keep."""
    from transformers import AutoTokenizer

    from bench.spec_training.smollm_data import chat_ids
    from cluster.config import DEFAULT_MODEL_BLOCK_DIR, default_model_file
    model = default_model_file()
    plain = LLMEngine(EngineConfig(model=model, num_threads=2))
    spec = LLMEngine(EngineConfig(model=model, num_threads=2, speculative=SpeculativeConfig(
        method="block", num_speculative_tokens=4)), speculator_factory=make_speculator)
    assert spec.speculator.models.footprint.hidden_layers == (1, 14, 26)
    assert DEFAULT_MODEL_BLOCK_DIR.name in spec.layout.model_id
    tok = AutoTokenizer.from_pretrained(plain.config.model)
    prompts = [chat_ids(tok, q) for q in ("What is the difference between a list and a tuple in Python?",
                                          "Write a Python function that checks whether a number is prime.")]
    sp = SamplingParams(max_tokens=64)
    want = [c.token_ids for c in plain.generate(prompts, sp)]
    assert [c.token_ids for c in spec.generate(prompts, sp)] == want
    c = spec.speculator.stats()["block"]
    # An untrained drafter accepts next to nothing; this one about half of the first positions
    # on held-out prompts (its model card).
    assert c["accepted_at"][0] / c["drafted_at"][0] > 0.25, c
    spec.pool.check_idle()

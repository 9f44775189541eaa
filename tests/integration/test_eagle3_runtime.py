"""EAGLE-3-style heads at serving time: the engine's paged head (fused features from three
depths, its own LM head over a draft vocabulary) drafts what the dense training reference drafts,
and a head trained for other weights, or reading layers the target lacks, is refused by name."""
import json

import pytest
import torch

from decode.spec.heads.eagle import EagleConfig, load_target_parts
from decode.spec.heads.eagle3 import Eagle3Config, Eagle3Head, draft_greedy3, save_eagle3_head
from cluster.config import STDLIB_CODER_DIR, EngineConfig, SpeculativeConfig
from cluster.engine.engine import LLMEngine
from cluster.engine.scheduler import StepPlan
from cluster.types import SamplingParams
from decode.spec.compat import check_speculative_models, weights_fingerprint
from decode.spec.speculator import make_speculator

LAYERS = (0, 2, 4)


def _random_head(tmp_path, fingerprint: str, layers=LAYERS):
    base = EagleConfig.from_target(str(STDLIB_CODER_DIR))
    d2t = torch.randperm(base.vocab_size, generator=torch.Generator().manual_seed(1))[:512].sort().values
    head = Eagle3Head(Eagle3Config(**vars(base), draft_vocab_size=512, feature_layers=layers), d2t)
    head.init_weights(seed=0, std=0.05)
    with torch.no_grad():
        head.fuse.weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(2))
    out = tmp_path / "head3"
    save_eagle3_head(head, str(out), "stdlib-coder", fingerprint)
    return out


def _engine(head_dir):
    return LLMEngine(EngineConfig(model=STDLIB_CODER_DIR, dtype="float32", num_threads=2,
                                  speculative=SpeculativeConfig(method="eagle", eagle_head=head_dir)),
                     speculator_factory=make_speculator)


def test_paged_eagle3_head_drafts_what_the_dense_reference_drafts(tmp_path):
    import transformers
    head_dir = _random_head(tmp_path, weights_fingerprint(STDLIB_CODER_DIR))
    from decode.spec.heads.eagle3 import load_eagle3_head
    head = load_eagle3_head(str(head_dir)).float()
    engine = _engine(head_dir)
    prompt = "import os\n\nclass Config:\n    def __init__(self, path):\n        self.path = path\n"
    rid = engine.add_request(prompt, SamplingParams(max_tokens=8))
    engine.step()                                    # prefill: first token, fused features and head KV
    seq = engine.requests.seqs[rid]
    k = 4
    assert engine.scheduler.lookahead_room(seq, k, StepPlan(budget_left=k)) == k
    drafted = engine.speculator.proposers["eagle"].propose([seq], [k], [None])[0].tokens

    hf = transformers.LlamaForCausalLM.from_pretrained(STDLIB_CODER_DIR, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        hs = hf(torch.tensor([seq.token_ids]), output_hidden_states=True).hidden_states
    feats3 = torch.cat([hs[i + 1][0] for i in LAYERS], dim=-1)
    expected = draft_greedy3(head, load_target_parts(str(STDLIB_CODER_DIR)), list(seq.token_ids), feats3, k)
    assert list(drafted) == expected
    assert set(drafted) <= set(head.d2t.tolist())    # drafts are target ids from the draft vocabulary
    engine.abort(rid)
    engine.step()
    engine.pool.check_idle()


def test_greedy_output_equals_plain_decoding_and_blocks_return(tmp_path):
    head_dir = _random_head(tmp_path, weights_fingerprint(STDLIB_CODER_DIR))
    prompts = ["def parse(self, text):\n", "import sys\n\nfor line in sys.stdin:\n"]
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    outs = []
    for engine in (LLMEngine(EngineConfig(model=STDLIB_CODER_DIR, dtype="float32", num_threads=2)), _engine(head_dir)):
        ids = [engine.add_request(p, sp) for p in prompts]
        got = {r: [] for r in ids}
        while engine.has_unfinished():
            for d in engine.step():
                got[d.request_id].extend(d.token_ids)
        engine.pool.check_idle()
        outs.append([got[r] for r in ids])
    assert outs[0] == outs[1]


def test_a_head_for_other_weights_is_refused(tmp_path):
    head_dir = _random_head(tmp_path, "safetensors-sha256:" + "0" * 64)
    cfg = EngineConfig(model=STDLIB_CODER_DIR, speculative=SpeculativeConfig(method="eagle", eagle_head=head_dir))
    with pytest.raises(ValueError, match="trained for other weights"):
        check_speculative_models(cfg, disaggregated=False)


def test_a_head_reading_layers_the_target_lacks_is_refused(tmp_path):
    head_dir = _random_head(tmp_path, weights_fingerprint(STDLIB_CODER_DIR))
    raw = json.loads((head_dir / "config.json").read_text())
    raw["feature_layers"] = [0, 2, 9]
    (head_dir / "config.json").write_text(json.dumps(raw))
    cfg = EngineConfig(model=STDLIB_CODER_DIR, speculative=SpeculativeConfig(method="eagle", eagle_head=head_dir))
    with pytest.raises(ValueError, match=r"reads the outputs of layers \[0, 2, 9\], but the target has 6 layers"):
        check_speculative_models(cfg, disaggregated=False)


def test_the_default_models_shipped_head_drafts_well_and_changes_nothing():
    """SmolLM2-135M-Instruct with its shipped EAGLE-3-style head, on chat questions it was not
    trained on: the greedy answers equal plain decoding's, and the head earns its keep."""
    from transformers import AutoTokenizer

    from cluster.config import DEFAULT_MODEL_EAGLE_DIR, default_model_file
    from bench.spec_training.smollm_data import chat_ids
    model = default_model_file()
    plain = LLMEngine(EngineConfig(model=model, num_threads=2))
    spec = LLMEngine(EngineConfig(model=model, num_threads=2, speculative=SpeculativeConfig(
        method="eagle", num_speculative_tokens=4)), speculator_factory=make_speculator)
    assert spec.speculator.models.footprint.hidden_layers == (1, 14, 26)
    assert DEFAULT_MODEL_EAGLE_DIR.name in spec.layout.model_id
    tok = AutoTokenizer.from_pretrained(plain.config.model)
    prompts = [chat_ids(tok, q) for q in ("What is the difference between a list and a tuple in Python?",
                                          "Write a Python function that checks whether a number is prime.")]
    sp = SamplingParams(max_tokens=64)
    want = [c.token_ids for c in plain.generate(prompts, sp)]
    assert [c.token_ids for c in spec.generate(prompts, sp)] == want
    c = spec.speculator.stats()["eagle"]
    # An untrained head, or one for other weights, accepts next to nothing (first position ~0);
    # this one accepts about 4 in 10 first tokens on such questions (its model card).
    assert c["accepted_at"][0] / c["drafted_at"][0] > 0.25, c
    spec.pool.check_idle()

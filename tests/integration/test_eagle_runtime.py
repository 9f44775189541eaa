"""The serving-time EAGLE head (paged KV, one more arena layer) computes what the dense training
reference computes: the same drafted tokens from the same prefix, in fp32."""
import torch

from cluster.config import STDLIB_CODER_DIR, EngineConfig, SpeculativeConfig
from cluster.engine.engine import LLMEngine
from cluster.engine.scheduler import StepPlan
from decode.spec.heads.eagle import (EagleConfig, EagleHead, FeatureHook, draft_greedy, load_target_parts,
                                       save_eagle_head)
from cluster.types import SamplingParams
from decode.spec.speculator import make_speculator


def test_paged_head_drafts_what_the_dense_reference_drafts(tmp_path):
    import transformers
    head = EagleHead(EagleConfig.from_target(str(STDLIB_CODER_DIR)))
    head.init_weights(seed=0, std=0.05)
    save_eagle_head(head, str(tmp_path / "head"))
    head = head.float().eval()
    engine = LLMEngine(EngineConfig(dtype="float32", num_threads=2, speculative=SpeculativeConfig(
        method="eagle", eagle_head=tmp_path / "head")), speculator_factory=make_speculator)
    prompt = "import os\n\nclass Config:\n    def __init__(self, path):\n        self.path = path\n"
    rid = engine.add_request(prompt, SamplingParams(max_tokens=8))
    engine.step()                                    # prefill: first token, features and head KV
    seq = engine.requests.seqs[rid]
    k = 4
    assert engine.scheduler.lookahead_room(seq, k, StepPlan(budget_left=k)) == k
    drafted = engine.speculator.proposers["eagle"].propose([seq], [k], [None])[0].tokens

    hf = transformers.LlamaForCausalLM.from_pretrained(STDLIB_CODER_DIR, torch_dtype=torch.float32).eval()
    hook = FeatureHook(hf)
    with torch.no_grad():
        hf(torch.tensor([seq.token_ids]))
    features = hook.f[0]
    hook.remove()
    tp = load_target_parts(str(STDLIB_CODER_DIR))
    assert list(drafted) == draft_greedy(head, tp, list(seq.token_ids), features, k)
    engine.abort(rid)
    engine.step()
    engine.pool.check_idle()

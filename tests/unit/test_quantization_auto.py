"""`--quantization auto` (the default; cluster/config.py auto_quantization): a GGUF model whose
tensors are all in the block types the CPU kernels serve is served from its stored blocks (gguf);
anything else as `none`. Resolved once, in EngineConfig, with the reason the banner prints."""
import json

import pytest

from cluster.config import (
    EngineConfig,
    SpeculativeConfig,
    auto_quantization,
    default_model_file,
    resolve_model,
)
from cluster.launch.banner import Endpoints, banner
from cluster.launch.cli import load


def _converted(tmp_path, types):
    """A directory as a GGUF's conversion leaves it, as far as the choice reads it."""
    (tmp_path / "gguf_source.json").write_text(json.dumps({"gguf": "x.gguf", "tensor_types": types}))
    return tmp_path


def test_the_served_block_types_go_gguf_anything_else_none(tmp_path):
    assert auto_quantization(_converted(tmp_path, ["F32", "Q4_1", "Q8_0"]), "cpu", "auto", "off") == \
        ("gguf", "the GGUF's Q4_1/Q8_0 blocks served as stored, faster decode than dequantized")
    scheme, why = auto_quantization(_converted(tmp_path, ["F32", "Q4_K", "Q6_K"]), "cpu", "auto", "off")
    assert scheme == "none" and "Q4_K/Q6_K" in why
    assert auto_quantization(_converted(tmp_path, ["F32"]), "cpu", "auto", "off")[0] == "none"   # an F32 GGUF
    served = _converted(tmp_path, ["F32", "Q4_0"])
    assert auto_quantization(served, "cuda:0", "auto", "off")[0] == "none"            # the kernels are CPU's
    assert auto_quantization(served, "cpu", "float16", "off")[0] == "none"            # they take fp32/bf16
    assert auto_quantization(served, "cpu", "bfloat16", "quantspec")[0] == "none"     # its draft is the 4-bit copy
    assert auto_quantization(tmp_path / "missing", "cpu", "auto", "off") == ("none", "not a GGUF model: weights in --dtype")


def test_engine_config_resolves_auto_once_and_keeps_explicit_choices(tiny_model_dir):
    hf = EngineConfig(model=tiny_model_dir("llama"))
    assert (hf.quantization, hf.quantization_choice) == ("none", "auto: none (not a GGUF model: weights in --dtype)")
    assert EngineConfig(model=tiny_model_dir("llama"), quantization="int8").quantization_choice is None
    try:
        smollm2 = resolve_model(default_model_file())
    except FileNotFoundError as exc:      # CI installs it (.ci/run)
        pytest.fail(str(exc))
    default = EngineConfig(model=smollm2)
    assert default.quantization == "gguf" and default.quantization_choice.startswith("auto: gguf (the GGUF's Q4_1/Q8_0")
    assert EngineConfig(model=smollm2, quantization="none").quantization == "none"
    assert EngineConfig(model=smollm2, quantized_activations="int8").quantization == "gguf"   # 4-bit: accepted
    spec = EngineConfig(model=smollm2, speculative=SpeculativeConfig(method="quantspec"))
    assert spec.quantization == "none"


def test_the_banner_says_what_auto_chose_and_why():
    def weights_line(*argv) -> str:
        cfg = load(["serve", *argv], check_machine=False).config
        return next(line for line in banner(cfg, "m", "9.9.9", Endpoints("127.0.0.1:1", None, None), True)
                    if line.startswith("  weights:"))
    assert weights_line("--model", str(default_model_file())) == (
        "  weights: --quantization auto: gguf (the GGUF's Q4_1/Q8_0 blocks served as stored, faster decode than "
        "dequantized) (docs/quantization.md)")
    assert weights_line("--model", "stdlib-coder") == \
        "  weights: --quantization auto: none (not a GGUF model: weights in --dtype) (docs/quantization.md)"
    assert weights_line("--quantization", "none", "--quantization", "int4") == \
        "  weights: --quantization int4 (docs/quantization.md)"

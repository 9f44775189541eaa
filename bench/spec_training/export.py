"""Write a complete HF checkpoint directory (bf16 safetensors + tokenizer)."""
from __future__ import annotations

import argparse
import copy
import json
import os
import shutil

import torch
from transformers import GenerationConfig, LlamaForCausalLM

from .shapes import make_config
from .tokenizer import EOT_ID

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def export_hf(model: LlamaForCausalLM, tokenizer_dir: str, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    m = copy.deepcopy(model).to(torch.bfloat16).eval()
    m.config.architectures = ["LlamaForCausalLM"]
    m.generation_config = GenerationConfig(
        bos_token_id=EOT_ID, eos_token_id=EOT_ID, pad_token_id=EOT_ID, do_sample=False
    )
    m.save_pretrained(out_dir, safe_serialization=True)
    _add_legacy_config_keys(os.path.join(out_dir, "config.json"))
    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(out_dir, name))


def _add_legacy_config_keys(path: str) -> None:
    """transformers 5 writes ``dtype``/``rope_parameters``; readers written for
    4.x (and simple loaders) look for ``torch_dtype``/``rope_theta``. Keep both."""
    with open(path) as f:
        cfg = json.load(f)
    cfg.setdefault("torch_dtype", cfg.get("dtype", "bfloat16"))
    rope = cfg.get("rope_parameters") or {}
    cfg.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")


def load_checkpoint_model(ckpt_path: str) -> LlamaForCausalLM:
    """Rebuild the fp32 model from a trainer checkpoint (``ckpt.pt``)."""
    state = torch.load(ckpt_path, map_location="cpu", weights_only=False)
    model = LlamaForCausalLM(make_config(state["shape"]))
    model.load_state_dict(state["model"])
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description="Export a trainer ckpt.pt as an HF dir.")
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    export_hf(load_checkpoint_model(args.ckpt), args.tokenizer, args.out)
    print(f"exported {args.ckpt} -> {args.out}")


if __name__ == "__main__":
    main()

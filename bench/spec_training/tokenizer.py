"""Train the byte-level BPE tokenizer and write the HF tokenizer files.

Byte-level BPE with no normalizer maps every byte to a symbol, so any str
round-trips exactly: ``decode(encode(x)) == x`` (tabs, CRLF, trailing spaces,
non-ASCII). Only the training split is used to learn merges.

``<|endoftext|>`` (id 0) is bos, eos and pad. The post-processor prepends it,
matching training, where every file starts with it.
"""
from __future__ import annotations

import argparse
import json
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from .corpus import iter_stdlib_files, split_files

VOCAB_SIZE = 8192
EOT = "<|endoftext|>"
EOT_ID = 0


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],  # first special token -> id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    assert tok.token_to_id(EOT) == EOT_ID
    tok.post_processor = processors.TemplateProcessing(
        single=f"{EOT} $A", pair=f"{EOT} $A {EOT} $B", special_tokens=[(EOT, EOT_ID)]
    )
    return tok


def write_hf_tokenizer_files(tok: Tokenizer, out_dir: str) -> None:
    """tokenizer.json + the two small json files AutoTokenizer expects."""
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT,
        "eos_token": EOT,
        "pad_token": EOT,
        "unk_token": None,
        "add_bos_token": True,  # informational: the post-processor adds it
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,  # would break round-tripping
        "model_max_length": 2048,
        "padding_side": "left",
    }
    specials = {"bos_token": EOT, "eos_token": EOT, "pad_token": EOT}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump(specials, f, indent=2)
        f.write("\n")


def roundtrip_ok(tok: Tokenizer, text: str) -> bool:
    ids = tok.encode(text, add_special_tokens=False).ids
    return tok.decode(ids, skip_special_tokens=False) == text


TRICKY = [
    "def f(x):\n\treturn x  \r\n",
    "s = 'héllo wörld — ünïcode ✓ 日本語 🐍'\n",
    "\n\n   \t \n",
    "x = '\\x00\\u1234'  # trailing   \r\n\r\n",
    "",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True, help="directory to write tokenizer files into")
    ap.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = ap.parse_args()
    train, _ = split_files(iter_stdlib_files())
    tok = train_tokenizer([f.text for f in train], args.vocab_size)
    for t in TRICKY + [f.text for f in train[:50]]:
        assert roundtrip_ok(tok, t), repr(t[:80])
    write_hf_tokenizer_files(tok, args.out)
    print(f"vocab {tok.get_vocab_size()} -> {args.out}")


if __name__ == "__main__":
    main()

"""A model's tokenizer (its `tokenizer.json`), without torch: the frontends and the command line
load it where no model runs."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer


def load_tokenizer(model_dir: Path) -> Tokenizer:
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} has no tokenizer.json (a Hugging Face fast tokenizer is required)")
    return Tokenizer.from_file(str(path))

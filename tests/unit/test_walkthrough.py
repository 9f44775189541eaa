"""docs/walkthrough.md names files and functions: each must exist, so the walkthrough cannot rot."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "walkthrough.md"
# A backquoted path, then (optionally, after a space) a backquoted name defined in that file.
PAIR = re.compile(r"`([\w/]+\.py)`\s+`([A-Za-z_][\w.]*)`")
PATH = re.compile(r"`([\w/]+(?:\.py|/))`")


def _defines(source: str, dotted: str) -> bool:
    return all(re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{re.escape(part)}\b|^{re.escape(part)}\s*=",
                         source, re.M) for part in dotted.split("."))


def test_every_named_path_exists():
    text = DOC.read_text()
    missing = [p for p in PATH.findall(text) if not (ROOT / p).exists()]
    assert not missing, f"docs/walkthrough.md names paths that do not exist: {missing}"


def test_every_named_function_is_defined_in_its_file():
    text = DOC.read_text()
    pairs = PAIR.findall(text)
    assert len(pairs) >= 15, "the walkthrough should name its steps' files and functions"
    wrong = [f"{path} {name}" for path, name in pairs if not _defines((ROOT / path).read_text(), name)]
    assert not wrong, f"docs/walkthrough.md names functions its files do not define: {wrong}"

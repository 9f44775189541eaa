"""Locate the Python standard library sources and split them train/held-out.

The split is fixed by a hash of each file's path relative to the stdlib root, so
it does not depend on file-system walk order or on which other files exist:
``sha1(relpath) % 20 == 0`` -> held out (~5% of files).
"""
from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass

# Test suites are excluded: they are ~60% of the stdlib bytes, full of odd
# fixtures (py2 syntax, deliberately broken encodings) and would dominate a
# corpus meant to model ordinary library code.
EXCLUDED_DIRS = frozenset({"site-packages", "__pycache__", "test", "tests", "idle_test"})
HELDOUT_MODULUS = 20


@dataclass(frozen=True)
class SourceFile:
    relpath: str  # posix-style path relative to the stdlib root
    text: str


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def is_heldout(relpath: str) -> bool:
    digest = hashlib.sha1(relpath.encode("utf-8")).digest()
    return int.from_bytes(digest, "big") % HELDOUT_MODULUS == 0


def iter_stdlib_files(root: str | None = None) -> list[SourceFile]:
    """All UTF-8 ``.py`` files under the stdlib root, sorted by relative path."""
    root = root or stdlib_root()
    out: list[SourceFile] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            with open(path, "rb") as f:
                raw = f.read()
            try:
                text = raw.decode("utf-8")  # a few legacy files are latin-1: skip them
            except UnicodeDecodeError:
                continue
            out.append(SourceFile(rel, text))
    out.sort(key=lambda s: s.relpath)
    return out


def split_files(files: list[SourceFile]) -> tuple[list[SourceFile], list[SourceFile]]:
    train = [f for f in files if not is_heldout(f.relpath)]
    heldout = [f for f in files if is_heldout(f.relpath)]
    return train, heldout


if __name__ == "__main__":
    files = iter_stdlib_files()
    train, heldout = split_files(files)
    nbytes = lambda fs: sum(len(f.text.encode("utf-8")) for f in fs)  # noqa: E731
    print(f"stdlib root: {stdlib_root()}")
    print(f"train: {len(train)} files, {nbytes(train)} bytes")
    print(f"heldout: {len(heldout)} files, {nbytes(heldout)} bytes")

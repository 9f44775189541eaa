"""The fused CPU ops (`cpu_ops.py`) built in a child process from a command's first moment, on a
first start: the build is one compiler on one core while the command does its other first-start
work (converting a GGUF file, starting Ray) on another. `cpu_ops.load` waits on the build lock for
it instead of compiling a second time. Imports neither torch nor the ops: the command line starts
without torch."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path


def build_in_background(folder: Path) -> subprocess.Popen | None:
    """Start building the ops under `folder` where none was ever built there (a first start; after
    an upgrade the command builds them at first use, as before). The child's output is dropped: a
    build that fails fails again, logged, where the command loads the ops."""
    if any((Path(folder) / "cpu_ops").glob("ops-*.so")):
        return None
    if not (os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")):   # cpu_ops' compilers: none here
        return None
    return subprocess.Popen([sys.executable, "-m", "kernels.cpu_ops", str(folder)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

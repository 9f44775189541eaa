"""The API fuzz of tests/e2e/test_hostile.py at a larger size, with fresh random examples each run
(the suite runs 120 of each, derandomized).

    python bench/fuzz_api.py [--examples 2000]

Runs the module's two fuzz tests (OpenAI bodies over HTTP; v1 messages and raw bytes over gRPC)
and its health check afterwards, against the module's served cluster, and prints pytest's result.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--examples", type=int, default=2000, help="examples per fuzz test")
    args = p.parse_args()
    env = dict(os.environ, SPLITSERVE_FUZZ_EXAMPLES=str(args.examples))
    return subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            "tests/e2e/test_hostile.py", "-k", "fuzz or after_the_fuzz"], cwd=REPO, env=env)


if __name__ == "__main__":
    sys.exit(main())

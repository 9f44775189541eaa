"""bench/gpu_check.sh's own mechanics, with a stand-in interpreter (no GPU, no real step): step
limits within the call's budget, a deadline that cuts and skips steps, output kept from a step
killed at its limit, and no more files than the device tool brings back."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path


SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.sh"

# Ignores SIGINT (as a step stuck in a CUDA call would), so only the SIGKILL after the grace
# ends it; what it printed must already be in its file (PYTHONUNBUFFERED in the script).
STUB = '''#!/usr/bin/env python3
import signal, sys, time
if sys.argv[1] == "-c":
    print("stub interpreter")
    raise SystemExit(0)
signal.signal(signal.SIGINT, signal.SIG_IGN)
print("partial figures of", sys.argv[1])
time.sleep(600)
'''


def test_step_limits_fit_one_device_call():
    text = SCRIPT.read_text()
    limits = [int(m) for m in re.findall(r"^step \w+ (\d+) ", text, flags=re.M)]
    assert len(limits) == 6 and sum(limits) == 510
    assert "DEADLINE=${GPU_CHECK_DEADLINE:-575}" in text and "GRACE=${GPU_CHECK_GRACE:-15}" in text
    assert "MIN_STEP=${GPU_CHECK_MIN_STEP:-10}" in text
    assert "PYTHONUNBUFFERED=1" in text and "HF_HUB_OFFLINE=1" in text and 'PY="${PYTHON:-python3}"' in text


def test_a_step_cut_at_the_deadline_keeps_its_output(tmp_path):
    stub = tmp_path / "python-stub"
    stub.write_text(STUB)
    stub.chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=str(stub), GPU_CHECK_DEADLINE="7", GPU_CHECK_GRACE="1",
               GPU_CHECK_MIN_STEP="3")
    proc = subprocess.run(["bash", str(SCRIPT), str(out)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    summary = (out / "summary.txt").read_text().splitlines()
    assert summary[0] == "stub interpreter"
    cut = re.fullmatch(r"kernels rc=137 \d+s \(limit (\d+)s\), cut at its limit", summary[1])
    assert cut, summary
    # The step gets what the deadline leaves after the versions line and the grace (at most 7 - 1;
    # a step left under 3 s is skipped), however long that line took on a loaded machine.
    assert 3 <= int(cut.group(1)) <= 6
    assert all(line.endswith("skipped: the deadline is near") for line in summary[2:]) and len(summary) == 7
    assert (out / "kernels.txt").read_text().startswith("partial figures of bench/kernel_speed.py")
    assert len(list(out.iterdir())) <= 8

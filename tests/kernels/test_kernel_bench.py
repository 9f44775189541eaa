"""bench/kernel_speed.py, the GPU check's kernel step, on the CPU: what it times is what the engine
launches (no host work inside the timed call), and a run writes its figures as it goes."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from kernels import prefill
from kernels.reference import prefill_attention_ref

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import kernel_speed  # noqa: E402


def test_the_timed_prefill_call_builds_no_tile_map(monkeypatch):
    """The tile map is the backend's per-step host work (a .tolist() sync and a copy): timing it
    inside every call biased prefill against Triton. The timed callable reuses one map."""
    kc, vc, tables = kernel_speed.paged([40, 23], 4, 2, 16, torch.float32, "cpu")
    qlens = kernel_speed.i32([40, 23], "cpu")
    starts = kernel_speed.i32([0, 40], "cpu")
    q = torch.randn(63, 4, 16, generator=torch.Generator().manual_seed(0))
    out = torch.empty_like(q)
    call = kernel_speed.prefill_call(q, kc, vc, tables, starts, qlens, qlens, 40, 0.25, out)

    def no_host_work(*args, **kwargs):
        raise AssertionError("host work inside the timed call")
    monkeypatch.setattr(prefill, "prefill_tiles", no_host_work)
    monkeypatch.setattr(torch.Tensor, "tolist", no_host_work)
    call()
    monkeypatch.undo()
    want = prefill_attention_ref(q, kc, vc, tables, starts, qlens, qlens, 40, 0.25)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)


def test_a_run_writes_its_figures_per_section(tmp_path):
    """--smoke walks every section on tiny shapes; the JSON holds the correctness checks and the
    timing sections, after what an earlier run of the check had written there."""
    out = tmp_path / "kernels.json"
    out.write_text(json.dumps(dict(results=[dict(check="from an earlier run", ok=True)])))
    proc = subprocess.run([sys.executable, str(BENCH / "kernel_speed.py"), "--smoke", "--skip-engine",
                           "--correctness-dtypes", "float32", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    assert results[0]["check"] == "from an earlier run"
    checks = [r for r in results if "check" in r and r["check"] != "from an earlier run"]
    assert checks and all(r["ok"] and r["dtype"] == "float32" for r in checks)
    assert {r.get("bench") for r in results} >= {"decode", "verify", "prefill", "prefill_prefix"}

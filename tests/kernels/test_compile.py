"""Every Triton kernel the engine can launch compiles for Hopper (sm_90) with the installed Triton,
on this CPU machine: the interpreter these tests otherwise run accepts code the compiler refuses
(a plain-float global read inside a kernel passed every CPU test and failed every GPU).

The compile runs in a subprocess without TRITON_INTERPRET (the kernels pick their GPU configs at
import), over `kernels.compile_cases.suite_launches()`: the default model's shape in bf16 in both
attention modes, fp32 at head dim 128 (the tightest for registers and shared memory), fp16 with a
sliding window, the batch-invariant matmul and norm, and the quantized GEMM. The whole matrix is
`python bench/compile_check.py`. Compiled kernels land in Triton's cache, so a second run costs
seconds.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kernels.compile_cases import Batch, Span

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Triton's ptxas ships for Linux")


def _compiler_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    return env


@pytest.fixture(scope="module")
def suite_report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("compile") / "report.json"
    proc = subprocess.run([sys.executable, "-m", "kernels.compile_check", "--jobs", str(min(4, os.cpu_count() or 1)),
                           "--json", str(out)], env=_compiler_env(), capture_output=True, text=True, timeout=900)
    if not out.exists():
        pytest.fail(f"the compile check wrote no report (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                    f"{proc.stderr[-3000:]}")
    report = json.loads(out.read_text())
    report["stdout"] = proc.stdout
    report["returncode"] = proc.returncode
    return report


def test_every_kernel_compiles_for_hopper_within_its_limits(suite_report):
    bad = [f"{r['label']}: {'; '.join(r['problems'])}" for r in suite_report["reports"] if r["problems"]]
    assert not bad, "\n".join(bad)
    assert suite_report["returncode"] == 0, suite_report["stdout"][-3000:]
    for r in suite_report["reports"]:
        assert r["registers"] and r["shared_bytes"] is not None   # the cubin's figures were read


def test_every_launchable_kernel_has_a_compile_case(suite_report):
    assert suite_report["uncovered"] == []
    names = {k.rsplit(".", 1)[1] for k in suite_report["kernels"]}
    # The engine's kernels today; a new one shows up in `uncovered` until it has a case.
    assert {"_split_kv_kernel", "_merge_kernel", "_ordered_merge_kernel", "_prefill_kernel", "_store_kv_kernel",
            "_matmul_kernel", "_rms_norm_kernel", "_quant_gemm_kernel", "_store_quant_kernel"} <= names


def test_the_suite_covers_what_the_backends_choose_among(suite_report):
    """Both attention modes, every dtype, split and unsplit decode and verification, windows,
    and every BLOCK_M a verification width can select (16 to 128 rows)."""
    split_kv = [r["launch"] for r in suite_report["reports"] if r["launch"]["kernel"].endswith("_split_kv_kernel")]
    consts = [dict(launch["constexprs"]) for launch in split_kv]
    assert {(c["IS_DECODE"], c["SPLIT"]) for c in consts} == {(True, True), (True, False), (False, True),
                                                                (False, False)}
    assert {c["HAS_WINDOW"] for c in consts} == {True, False}
    assert {c["BLOCK_M"] for c in consts} >= {16, 32, 64}
    assert {c["KV_QUANT"] for c in consts} == {0, 1, 2}   # plain, int8 and fp8 KV rows
    pointer_types = {dict(r["launch"]["signature"])["q_ptr"] for r in suite_report["reports"]
                     if r["launch"]["kernel"].endswith(("_split_kv_kernel", "_prefill_kernel"))}
    assert pointer_types == {"*bf16", "*fp16", "*fp32"}
    assert any(r["launch"]["kernel"].endswith("_ordered_merge_kernel") for r in suite_report["reports"])


def test_a_kernel_without_a_case_is_reported(tmp_path):
    """A jit kernel added to the package (here through a folder put on its path) is listed as
    launchable, its device helper is not, and the check fails naming it."""
    (tmp_path / "_probe_kernel.py").write_text(textwrap.dedent('''
        import triton
        import triton.language as tl

        @triton.jit
        def _helper(x):
            return x + 1

        @triton.jit
        def _new_kernel(ptr):
            tl.store(ptr, _helper(tl.load(ptr)))
    '''))
    code = textwrap.dedent(f'''
        import kernels
        kernels.__path__.append({str(tmp_path)!r})
        from kernels import compile_check
        found = compile_check.launchable_kernels()
        assert "kernels._probe_kernel._new_kernel" in found, sorted(found)
        assert "kernels._probe_kernel._helper" not in found
        raise SystemExit(compile_check.main(["--list"]))
    ''')
    proc = subprocess.run([sys.executable, "-c", code], env=_compiler_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "no compile case launches kernels._probe_kernel._new_kernel" in proc.stdout


def test_the_meta_batch_has_the_engines_fields():
    """compile_cases builds the backend's input with its own types (kernels never imports
    cluster); they must stay the fields the engine's AttentionBatch and PrefillSpan have."""
    from cluster.model.attention import AttentionBatch, PrefillSpan
    for ours, theirs in ((Batch, AttentionBatch), (Span, PrefillSpan)):
        assert [f.name for f in dataclasses.fields(ours)] == [f.name for f in dataclasses.fields(theirs)]


def test_prefill_tiles_travel_with_their_row_count():
    """A tile map is only right for the BLOCK_M it was cut for (fp32 cuts smaller tiles)."""
    from kernels.prefill import prefill_attention
    q = torch.zeros(4, 2, 16)
    cache = torch.zeros(2, 16, 1, 16)
    ints = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="block_m"):
        prefill_attention(q, cache, cache, torch.zeros(1, 1, dtype=torch.int32), ints, ints + 4, ints + 4, 4, 0.25,
                          tiles=torch.zeros(1, 2, dtype=torch.int32))

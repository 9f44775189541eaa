"""The committed generated Python matches the .proto files."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_fresh(tmp_path):
    pytest.importorskip("grpc_tools")
    # protoc runs in a process of its own: grpc_tools' compiler and NIXL's bindings cannot share
    # one (either import order aborts the process), and the suite's process loads NIXL (the disk tier).
    run = subprocess.run([sys.executable, str(ROOT / "proto" / "generate.py"), str(tmp_path)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    written = [Path(line) for line in run.stdout.split()]
    assert written, "no generated files"
    for path in written:
        committed = ROOT / "proto" / path.relative_to(tmp_path)
        assert committed.is_file(), f"{committed} is missing: run python proto/generate.py"
        assert committed.read_text() == path.read_text(), f"{committed} is stale: run python proto/generate.py"


def test_api_names_scripts_rely_on():
    from proto.splitserve.v1 import inference_pb2 as pb
    assert pb.DESCRIPTOR.package == "splitserve.v1"
    assert "Inference" in pb.DESCRIPTOR.services_by_name
    req = pb.GenerateRequest(request_id="r", model="m", text="hi",
                             sampling=pb.SamplingParams(temperature=0.5, top_p=0.9, top_k=5, min_p=0.1,
                                                        max_tokens=7, seed=3, stop_token_ids=[2], stop=["\n"]))
    assert req.WhichOneof("prompt") == "text"
    req.token_ids.ids.extend([1, 2])
    assert req.WhichOneof("prompt") == "token_ids"
    resp = pb.GenerateResponse(request_id="r", token_ids=[5], text="x")
    assert resp.finish_reason == pb.FINISH_REASON_UNSPECIFIED

"""The committed generated Python matches the .proto files."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The generators stamp their own release into the code (grpcio-tools 1.85.1 and 1.85.4 differ only
# there); the committed stamps are what pyproject's minimum versions accept at run time.
_GENERATOR_STAMPS = (
    re.compile(r"^GRPC_GENERATED_VERSION = '[^']*'$", re.M),
    re.compile(r"^# Protobuf Python Version: .*$", re.M),
    re.compile(r"(ValidateProtobufRuntimeVersion\(\s*\S+,)\s*\d+,\s*\d+,\s*\d+,"),
)


def _without_generator_stamps(code: str) -> str:
    for stamp in _GENERATOR_STAMPS:
        code = stamp.sub(lambda m: m.group(1) if m.groups() else "", code)
    return code


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
        assert _without_generator_stamps(committed.read_text()) == _without_generator_stamps(path.read_text()), \
            f"{committed} is stale: run python proto/generate.py"


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


def test_generator_stamps_are_all_that_is_ignored():
    committed = (ROOT / "proto/splitserve/v1/inference_pb2_grpc.py").read_text()
    other_release = committed.replace("GRPC_GENERATED_VERSION = '1.85.1'", "GRPC_GENERATED_VERSION = '9.9.9'")
    assert other_release != committed
    assert _without_generator_stamps(other_release) == _without_generator_stamps(committed)
    pb2 = (ROOT / "proto/splitserve/v1/inference_pb2.py").read_text()
    assert "ValidateProtobufRuntimeVersion" in _without_generator_stamps(pb2)
    changed = pb2.replace("splitserve.v1.TokenIds", "splitserve.v1.TokenIdz", 1)
    assert _without_generator_stamps(changed) != _without_generator_stamps(pb2)


def _release(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def test_committed_stamps_run_on_the_minimum_versions_pyproject_allows():
    # Code stamped by a newer generator refuses to import on an older runtime; pyproject's floors
    # must accept what is committed.
    pyproject = (ROOT / "pyproject.toml").read_text()
    grpc_floor = re.search(r'"grpcio>=([\d.]+)"', pyproject).group(1)
    protobuf_floor = re.search(r'"protobuf>=([\d.]+)"', pyproject).group(1)
    grpc_code = (ROOT / "proto/splitserve/v1/inference_pb2_grpc.py").read_text()
    pb2 = (ROOT / "proto/splitserve/v1/inference_pb2.py").read_text()
    grpc_stamp = re.search(r"^GRPC_GENERATED_VERSION = '([^']*)'$", grpc_code, re.M).group(1)
    protobuf_stamp = re.search(r"^# Protobuf Python Version: (\S+)$", pb2, re.M).group(1)
    assert _release(grpc_stamp) <= _release(grpc_floor)
    assert _release(protobuf_stamp) <= _release(protobuf_floor)

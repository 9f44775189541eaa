"""Regenerate the committed Python for every .proto here: `python proto/generate.py`.

The output is committed so that users need no protoc; tests/unit/test_proto_fresh.py fails when
it is stale. Imports in the generated files are rewritten to be package-relative (`proto.splitserve.v1`).
"""
from __future__ import annotations

import sys
from pathlib import Path

import grpc_tools
from grpc_tools import protoc

HERE = Path(__file__).resolve().parent


def generate(out_dir: Path = HERE) -> list[Path]:
    include = Path(grpc_tools.__file__).parent / "_proto"
    protos = sorted(HERE.rglob("*.proto"))
    for proto in protos:
        rel = proto.relative_to(HERE)
        code = protoc.main(["protoc", f"-I{HERE}", f"-I{include}", f"--python_out={out_dir}",
                            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", str(rel)])
        if code:
            raise RuntimeError(f"protoc failed on {rel}")
    written = sorted(out_dir.rglob("*_pb2*.py")) + sorted(out_dir.rglob("*_pb2.pyi"))
    for path in written:
        text = path.read_text()
        text = text.replace("from splitserve.v1 import", "from proto.splitserve.v1 import")
        path.write_text(text)
    return written


if __name__ == "__main__":
    for p in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE):
        print(p)

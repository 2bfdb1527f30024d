"""Generates the Python gRPC stubs for worker.proto (`make proto`, or `python -m pdserve.proto.generate [OUT]`)."""

from __future__ import annotations

import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def generate(out_dir: str = HERE) -> list[str]:
    from grpc_tools import protoc

    os.makedirs(out_dir, exist_ok=True)
    code = protoc.main(["protoc", f"-I{HERE}", f"--python_out={out_dir}", f"--grpc_python_out={out_dir}",
                        os.path.join(HERE, "worker.proto")])
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code}")
    grpc_file = os.path.join(out_dir, "worker_pb2_grpc.py")
    with open(grpc_file) as f:
        text = f.read()
    # protoc writes an absolute-style import; make it relative to this package.
    text = re.sub(r"^import worker_pb2 as", "from . import worker_pb2 as", text, flags=re.M)
    with open(grpc_file, "w") as f:
        f.write(text)
    return [os.path.join(out_dir, n) for n in ("worker_pb2.py", "worker_pb2_grpc.py")]


if __name__ == "__main__":
    for path in generate(sys.argv[1] if len(sys.argv) > 1 else HERE):
        print(path)

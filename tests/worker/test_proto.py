"""The committed gRPC stubs are what `make proto` generates from worker.proto."""

import os

import pytest

from pdserve.proto import generate


def test_committed_stubs_are_current(tmp_path):
    pytest.importorskip("grpc_tools")
    for path in generate.generate(str(tmp_path)):
        name = os.path.basename(path)
        with open(path) as fresh, open(os.path.join(generate.HERE, name)) as committed:
            assert fresh.read() == committed.read(), f"{name} is stale: run `make proto`"

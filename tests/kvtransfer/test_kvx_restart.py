"""A receiver that restarts at the same address (kill -9, a new process on the same port) while
the sender holds endpoints to the old one: the sender neither crashes nor hangs, transfers meant
for the old process fail cleanly and land nothing in the new one (its incarnation differs), and
the first transfer to the new process works."""

from __future__ import annotations

import os
import time

import pytest
import torch

from pdserve import kvtransfer
from pdserve.kvtransfer import KVTransferError
from pdserve.kvtransfer.ucx_runtime import address_incarnation, parse_address
from kvx_peer import CacheSpec, Peer, make_caches
from pdserve.loadgen.launcher import free_port

SPEC = CacheSpec(num_layers=3, num_blocks=16, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")



def send(sender, address, tid, src_ids, dst_ids):
    for layer in range(SPEC.num_layers):
        sender.send_layer(address, tid, layer, src_ids, dst_ids)
    return sender.finish(tid, timeout=15)


def landed(peer, block_ids):
    after = peer.call("read_all")
    return [torch.frombuffer(bytearray(after[layer][pool]), dtype=torch.float32).view(16, 4, 2, 8)[block_ids]
            for layer in range(SPEC.num_layers) for pool in range(2)]


@pytest.mark.timeout(180)
def test_restart_at_the_same_address():
    port = free_port()
    src = make_caches(SPEC, seed=3)
    old = Peer()
    new = None
    try:
        old_address = old.call("open_receiver", SPEC, port=port)
        assert parse_address(old_address) == ("127.0.0.1", port) and address_incarnation(old_address)
        with kvtransfer.create_sender("ucx", src) as sender:
            old.call("expect", "before", [1, 2], SPEC.num_layers, 20.0)
            send(sender, old_address, "before", [4, 5], [1, 2])
            old.call("wait", "before", 20.0)

            old.process.kill()  # kill -9: no BYE, the sender still holds its endpoints
            old.process.join(10)
            new = Peer()
            # the dead process's connections may hold the port in TIME_WAIT: the runtime's listener
            # binds with SO_REUSEADDR (UCX_TCP_CM_REUSEADDR=y), so it listens at once (without it,
            # the receiver waits them out, about 60 s)
            new_address = new.call("open_receiver", SPEC, port=port, timeout=120)
            assert new_address != old_address and new_address.partition("#")[0] == old_address.partition("#")[0]

            # a transfer addressed to the old process (a reservation made before the restart)
            new.call("expect", "stale", [7, 8], SPEC.num_layers, 20.0)  # even if the ids collide
            t0 = time.monotonic()
            with pytest.raises(KVTransferError, match="restarted|went away|failed|cannot connect"):
                send(sender, old_address, "stale", [4, 5], [7, 8])
            assert time.monotonic() - t0 < 12  # no hang
            zeros = make_caches(SPEC, seed=None)
            assert all(torch.equal(got, zeros[0][0][[7, 8]]) for got in landed(new, [7, 8]))
            new.call("cancel", "stale")

            # the first transfer to the new process works
            new.call("expect", "after", [3, 9], SPEC.num_layers, 20.0)
            send(sender, new_address, "after", [6, 0], [3, 9])
            new.call("wait", "after", 20.0)
            want = [src[layer][pool][[6, 0]] for layer in range(SPEC.num_layers) for pool in range(2)]
            assert all(torch.equal(a, b) for a, b in zip(landed(new, [3, 9]), want))
            assert sender.metrics()["transfers_completed"] == 2
    finally:
        if old.process.is_alive():
            old.process.kill()
        if new is not None:
            assert new.stop() == 0


def test_the_runtime_listens_with_reuseaddr_unless_told_otherwise(monkeypatch):
    from pdserve.kvtransfer import ucx_runtime

    pytest.importorskip("ucxx")
    monkeypatch.delenv("UCX_TCP_CM_REUSEADDR", raising=False)
    ucx_runtime._import_ucxx()
    assert ucx_runtime.os.environ["UCX_TCP_CM_REUSEADDR"] == "y"
    monkeypatch.setenv("UCX_TCP_CM_REUSEADDR", "n")  # a user's setting stays
    ucx_runtime._import_ucxx()
    assert ucx_runtime.os.environ["UCX_TCP_CM_REUSEADDR"] == "n"


@pytest.mark.parametrize("preset", [None, "16384"])
def test_host_pools_send_eagerly_unless_told_otherwise(preset):
    """A process whose KV pools are host memory makes its UCX runtime with UCX_RNDV_THRESH=inf
    (ucx_runtime's docstring: under rendezvous a receiver could crash in its progress thread
    when its sender died mid-message); a user's setting stays. A fresh process: UCX reads the
    variable once."""
    import subprocess
    import sys

    pytest.importorskip("ucxx")
    code = (
        "import os\n"
        "from tests.kvtransfer.kvx_peer import CacheSpec, make_caches\n"
        "from pdserve.kvtransfer.ucx import UcxReceiver\n"
        "r = UcxReceiver(make_caches(CacheSpec(), seed=None))\n"
        "print('RNDV', os.environ.get('UCX_RNDV_THRESH'))\n"
        "r.close()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "UCX_RNDV_THRESH"}
    if preset is not None:
        env["UCX_RNDV_THRESH"] = preset
    out = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"RNDV {preset or 'inf'}" in out.stdout

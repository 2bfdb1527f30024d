"""Namespaces, veths and qdiscs: created as asked, removed completely on every exit path."""

import signal
import subprocess
import sys
import textwrap

import pytest

from pdserve.launcher.emulation import EmulatedCluster, EmulationError, LinkSpec, cleanup
from pdserve.launcher.emulation.netns import NODE_DEVICE, list_links, list_namespaces
from pdserve.launcher.emulation.shaping import class_rates, qdiscs
from tests.emulation.conftest import assert_gone, needs_netns

pytestmark = needs_netns


def test_create_shapes_each_pair_and_cleans_up(run_id):
    links = {("a", "b"): LinkSpec(1), ("c", "a"): LinkSpec(5)}
    prefix = f"pds-{run_id}-"
    with EmulatedCluster(["a", "b", "c"], links, run_id=run_id) as cluster:
        assert list_namespaces(prefix) == [f"{prefix}hub", f"{prefix}n0", f"{prefix}n1", f"{prefix}n2"]
        assert list_links(prefix) == [f"{prefix}rt"]
        assert [cluster.ns(n) for n in "abc"] == [f"{prefix}n0", f"{prefix}n1", f"{prefix}n2"]
        ips = [cluster.ip(n) for n in "abc"]
        assert len(set(ips)) == 3 and cluster.root_ip.endswith(".254")
        # a: one class per shaped peer (b at 1, c at 5) plus the unshaped default
        assert sorted(class_rates(cluster.ns("a"), NODE_DEVICE).values()) == [1.0, 5.0, 1000.0]
        assert sorted(class_rates(cluster.ns("b"), NODE_DEVICE).values()) == [1.0, 1000.0]  # b-c unshaped
        assert sorted(class_rates(cluster.ns("c"), NODE_DEVICE).values()) == [5.0, 1000.0]
        assert any("htb 1: dev pds0 root" in q for q in qdiscs(cluster.ns("a")))
        # lo is up, and every node reaches every other node and the root namespace
        out = subprocess.run(["ip", "-n", cluster.ns("b"), "-o", "link", "show", "lo"], capture_output=True, text=True)
        assert "UP" in out.stdout
        probe = "import socket,sys; s=socket.create_connection((sys.argv[1], 9), timeout=2)"
        for node in "bc":  # a refused connection (port 9 closed) proves the route works
            p = cluster.run_in(node, [sys.executable, "-c", probe, cluster.ip("a")], stderr=subprocess.PIPE, text=True)
            assert "ConnectionRefused" in p.communicate(timeout=20)[1]
        p = subprocess.run([sys.executable, "-c", probe, cluster.ip("c")], capture_output=True, text=True, timeout=20)
        assert "ConnectionRefused" in p.stderr
        assert cluster.env("a")["UCX_TLS"] == "tcp" and cluster.env("a")["UCX_NET_DEVICES"] == NODE_DEVICE
    assert_gone(prefix)
    assert not any(prefix in q for q in qdiscs(None))


def test_exception_inside_block_cleans_up_and_stops_processes(run_id):
    prefix = f"pds-{run_id}-"
    with pytest.raises(RuntimeError, match="boom"):
        with EmulatedCluster(["a", "b"], {("a", "b"): LinkSpec(2)}, run_id=run_id) as cluster:
            proc = cluster.run_in("a", [sys.executable, "-c", "import time; time.sleep(600)"])
            raise RuntimeError("boom")
    assert proc.poll() is not None
    assert_gone(prefix)


def test_failure_while_creating_cleans_up(run_id, monkeypatch):
    import pdserve.launcher.emulation.shaping as shaping

    def broken(*args, **kwargs):
        raise EmulationError("tc exploded")

    monkeypatch.setattr(shaping, "shape_node", broken)
    with pytest.raises(EmulationError, match="tc exploded"):
        with EmulatedCluster(["a", "b"], {("a", "b"): LinkSpec(1)}, run_id=run_id):
            pass
    assert_gone(f"pds-{run_id}-")


def test_signal_handlers_restored(run_id):
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with EmulatedCluster(["a"], run_id=run_id):
        assert signal.getsignal(signal.SIGTERM) is not before[0]
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


_HOLDER = textwrap.dedent("""
    import sys, time
    from pdserve.launcher.emulation import EmulatedCluster, LinkSpec
    with EmulatedCluster(["a", "b"], {("a", "b"): LinkSpec(1)}, run_id=sys.argv[1]) as c:
        c.run_in("b", [sys.executable, "-c", "import time; time.sleep(600)"])
        print("ready", flush=True)
        time.sleep(600)
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_cleans_up(run_id, sig):
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, run_id], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    assert list_namespaces(f"pds-{run_id}-")
    proc.send_signal(sig)
    proc.wait(30)
    assert_gone(f"pds-{run_id}-")


def test_cleanup_command_removes_leftovers_of_a_killed_run(run_id):
    prefix = f"pds-{run_id}-"
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, run_id], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.kill()  # SIGKILL: no handler runs, everything is left behind, a sleeper inside too
    proc.wait()
    assert list_namespaces(prefix) and list_links(prefix)
    out = subprocess.run([sys.executable, "-m", "pdserve.launcher.emulation", "cleanup", "--prefix", prefix],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"{prefix}n0" in out.stdout
    assert_gone(prefix)


def test_cleanup_refuses_foreign_prefix():
    with pytest.raises(ValueError, match="pds-"):
        cleanup("eth")


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown node"):
        EmulatedCluster(["a"], {("a", "b"): LinkSpec(1)})
    with pytest.raises(ValueError, match="gbps"):
        LinkSpec(0)
    with pytest.raises(ValueError, match="run_id"):
        EmulatedCluster(["a"], run_id="Bad_Id!")
    with pytest.raises(EmulationError, match="not created"):
        EmulatedCluster(["a"]).ip("a")


def test_impair_and_restore_a_link(run_id):
    from pdserve.launcher.emulation.shaping import impair_link, netem_available, restore_link

    if not netem_available():
        pytest.skip("this kernel has no tc netem (sch_netem)")

    links = {("a", "b"): LinkSpec(10), ("a", "c"): LinkSpec(1, latency_ms=5)}
    with EmulatedCluster(["a", "b", "c"], links, run_id=run_id) as cluster:
        impair_link(cluster, "a", "b", loss_pct=1, delay_ms=20)
        impair_link(cluster, "c", "a", loss_pct=2, delay_ms=0)
        for ns in (cluster.ns("a"), cluster.ns("b")):
            netem = [q for q in qdiscs(ns, NODE_DEVICE) if "netem" in q and "delay 20ms" in q]
            assert len(netem) == 1 and "loss 1%" in netem[0], qdiscs(ns, NODE_DEVICE)
        assert any("delay 5ms" in q and "loss 2%" in q for q in qdiscs(cluster.ns("c"), NODE_DEVICE))
        restore_link(cluster, "a", "b")
        restore_link(cluster, "a", "c")
        assert not any("netem" in q for q in qdiscs(cluster.ns("b"), NODE_DEVICE))
        a = [q for q in qdiscs(cluster.ns("a"), NODE_DEVICE) if "netem" in q]
        assert len(a) == 1 and "delay 5ms" in a[0] and "loss" not in a[0]  # a<->c keeps its own latency
        with pytest.raises(EmulationError, match="not shaped"):
            impair_link(cluster, "b", "c", loss_pct=1, delay_ms=1)

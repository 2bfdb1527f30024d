"""pdserve.loadgen.launcher.free_port: ports for servers the tools start, outside the kernel's ephemeral range."""

from __future__ import annotations

import socket

from pdserve.loadgen import launcher


def test_ports_are_below_the_ephemeral_range_bindable_and_never_handed_twice():
    low, _ = launcher._ephemeral_range()
    ports = [launcher.free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    if low - launcher.FIRST_PORT >= 1000:  # the usual Linux range (32768-60999): room below it
        assert all(launcher.FIRST_PORT <= p < low for p in ports)
    with socket.socket() as s:  # what it returned binds
        s.bind(("127.0.0.1", ports[-1]))


def test_a_taken_port_is_never_returned(monkeypatch):
    low, _ = launcher._ephemeral_range()
    if low - launcher.FIRST_PORT < 1000:
        return
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", launcher.FIRST_PORT))
        taken.listen()
        picks = iter([launcher.FIRST_PORT, launcher.FIRST_PORT + 7])

        class Pick:
            def randrange(self, a, b):
                return next(picks)

        monkeypatch.setattr(launcher.random, "Random", Pick)
        launcher._handed.discard(launcher.FIRST_PORT + 7)
        assert launcher.free_port() == launcher.FIRST_PORT + 7

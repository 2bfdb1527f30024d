"""A layer's KV goes out once its own compute is done, not once the whole forward is.

The engine queues a forward's layers well before the GPU runs them; a sender that waits for
the newest queued layer holds every earlier one until the forward ends (on one H200 at
25 Gbit/s that put up to 45 ms of wire behind the prefill). Events here are host stand-ins
for CUDA events: ``synchronize`` blocks until the test completes them."""

from __future__ import annotations

import collections
import queue
import threading
import time

import pytest

from pdserve.kvtransfer.staging import ready_prefix
from pdserve.kvtransfer.ucx import UcxSender


class Event:
    def __init__(self, done: bool = False):
        self._done = threading.Event()
        if done:
            self._done.set()

    def complete(self) -> None:
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        if not self._done.wait(5):
            raise TimeoutError("event never completed")


def test_ready_prefix_hands_on_the_oldest_with_every_later_one_already_done():
    a, b, c, d = Event(True), Event(True), Event(False), Event(True)
    pending = collections.deque([("a", a), ("b", b), ("c", c), ("d", d)])
    assert [k for k, _ in ready_prefix(pending, lambda item: item[1])] == ["a", "b"]
    assert [k for k, _ in pending] == ["c", "d"]  # d is done but stays behind c: order holds
    c.complete()
    assert [k for k, _ in ready_prefix(pending, lambda item: item[1])] == ["c", "d"]
    assert not pending


def test_ready_prefix_waits_for_the_oldest_only():
    first, last = Event(False), Event(False)
    pending = collections.deque([(0, first), (1, last)])
    threading.Timer(0.05, first.complete).start()
    t0 = time.monotonic()
    out = ready_prefix(pending, lambda item: item[1])
    assert [k for k, _ in out] == [0] and time.monotonic() - t0 < 2
    assert len(pending) == 1 and not last.query()


class _Msg:
    def __init__(self, key: int, ready: Event):
        self.key, self.ready, self.ready_at = key, ready, None


class _Ledger:
    def __init__(self):
        self.staged, self.failed = [], []

    def on_staged(self, key):
        self.staged.append(key)

    def fail_key(self, key, error):
        self.failed.append((key, str(error)))


class _Runtime:
    def __init__(self):
        self.calls: queue.SimpleQueue = queue.SimpleQueue()

    def call_soon(self, fn, batch):
        self.calls.put([msg.key for _, msg in batch])


def _waiter():
    sender = UcxSender.__new__(UcxSender)  # only the waiter's collaborators: ledger, pacer, loop
    sender._ledger, sender._pacer, sender._rt = _Ledger(), None, _Runtime()
    todo: queue.SimpleQueue = queue.SimpleQueue()
    thread = threading.Thread(target=sender._wait_gathers, args=(todo,), daemon=True)
    thread.start()
    return sender, todo, thread


def test_the_ucx_sender_sends_computed_layers_while_later_ones_compute():
    sender, todo, thread = _waiter()
    events = [Event() for _ in range(4)]
    for key, event in enumerate(events):  # the whole forward queued before any layer is computed
        todo.put(("peer", _Msg(key, event)))
    events[0].complete()
    assert sender._rt.calls.get(timeout=5) == [0]  # layer 0 goes while 1-3 compute
    events[1].complete()
    events[2].complete()
    got = sender._rt.calls.get(timeout=5)
    assert got in ([1, 2], [1])
    if got == [1]:
        assert sender._rt.calls.get(timeout=5) == [2]
    with pytest.raises(queue.Empty):
        sender._rt.calls.get(timeout=0.1)  # layer 3 is not done: nothing goes for it
    events[3].complete()
    assert sender._rt.calls.get(timeout=5) == [3]
    assert sender._ledger.staged == [0, 1, 2, 3]
    todo.put(None)
    thread.join(5)
    assert not thread.is_alive()


def test_the_ucx_waiter_fails_what_it_holds_when_a_wait_fails_and_goes_on():
    sender, todo, thread = _waiter()

    class Broken(Event):
        def synchronize(self):
            raise RuntimeError("CUDA error: an illegal memory access")

    todo.put(("peer", _Msg(7, Broken())))
    deadline = time.monotonic() + 5
    while not sender._ledger.failed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sender._ledger.failed and sender._ledger.failed[0][0] == 7
    assert "KV gather failed" in sender._ledger.failed[0][1]
    todo.put(("peer", _Msg(8, Event(True))))  # the thread is still there for the next one
    assert sender._rt.calls.get(timeout=5) == [8]
    todo.put(None)
    thread.join(5)
    assert not thread.is_alive()


class _NixlLedger(_Ledger):
    def should_skip(self, key):
        return False

    def on_posted(self, key, **_):
        pass


def test_nixl_direct_posts_the_computed_layers_before_waiting_for_the_next():
    from pdserve.kvtransfer.nixl import NixlSender
    from pdserve.kvtransfer.nixl.sender_posting import _Link

    sender = NixlSender.__new__(NixlSender)  # only what _post_direct touches: ledger, pacer, the WRITE
    sender._ledger, sender._pacer = _NixlLedger(), None
    writes = []
    sender._write_direct = lambda link, ready: writes.append(([k for k, *_ in ready], time.monotonic()))
    link = _Link("peer")
    link.fences, link.fenced, link.remote_blocks = collections.deque(), {}, 1 << 20
    events = [Event(True), Event(True), Event(False), Event(False)]
    batch = [(key, key, [key], [key], 64, event, False, 0.0) for key, event in enumerate(events)]
    # One timer ends both layers, the later first: two timers raced, and the sender, woken by
    # layer 2, could look at layer 3 before its own timer had fired (seen once in CI).
    threading.Timer(0.2, lambda: (events[3].complete(), events[2].complete())).start()
    t0 = time.monotonic()
    sender._post_direct(link, batch)
    assert [keys for keys, _ in writes] == [[0, 1], [2, 3]]
    assert writes[0][1] - t0 < 0.15  # layers 0 and 1 went before layer 2's compute ended
    assert sender._ledger.staged == [0, 1, 2, 3]

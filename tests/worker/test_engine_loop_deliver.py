"""EngineLoop.deliver_many: one loop callback per step for asyncio subscribers, order kept."""

import asyncio
from types import SimpleNamespace

from pdserve.sampling_params import RequestOutput
from pdserve.worker.engine_loop import EngineLoop


def out(rid: str, token: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(rid, [token], str(token), finished, "length" if finished else None, 3, token)


class CountingLoop:
    """Stands in for an asyncio loop: records call_soon_threadsafe calls, runs them later."""

    def __init__(self) -> None:
        self.calls = []

    def call_soon_threadsafe(self, fn, *args):
        self.calls.append((fn, args))

    def run(self):
        for fn, args in self.calls:
            fn(*args)
        self.calls.clear()


def test_one_callback_per_loop_per_step_and_order_kept():
    loop = EngineLoop(SimpleNamespace())
    aio = CountingLoop()
    streams = {rid: SimpleNamespace(loop=aio, queue=asyncio.Queue()) for rid in ("a", "b")}
    plain = []
    for rid, s in streams.items():
        loop.subscribe(rid, SimpleNamespace(loop=aio, put_nowait=s.queue.put_nowait))
    loop.subscribe("c", plain.append)
    loop.deliver_many([out("a", 1), out("b", 1), out("c", 1), out("x", 1)])  # x: nobody subscribed
    loop.deliver_many([out("a", 2, finished=True), out("b", 2)])
    assert len(aio.calls) == 2  # one per step, not one per request
    assert [o.new_token_ids for o in plain] == [[1]]  # a plain callback is called directly
    aio.run()
    got = {rid: [s.queue.get_nowait().new_token_ids[0] for _ in range(s.queue.qsize())] for rid, s in streams.items()}
    assert got == {"a": [1, 2], "b": [1, 2]}
    loop.deliver_many([out("a", 3)])  # a finished: unsubscribed
    assert not aio.calls
    loop.deliver_many([])
    assert not aio.calls


def test_engine_thread_sets_an_indexed_device_for_a_bare_cuda(monkeypatch):
    """`pdserve worker --device cuda` gives the engine a device without an index; recent torch's
    set_device refuses that (it once failed every standalone GPU worker at start)."""
    import threading

    import torch

    seen = []
    ran = threading.Event()
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.append(d))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    class Engine:
        device = torch.device("cuda")
        requests = {}

        def has_unfinished_requests(self):
            ran.set()
            return False

    loop = EngineLoop(Engine())
    loop.start()
    try:
        assert ran.wait(5)
    finally:
        loop.stop()
    assert len(seen) == 1
    index = seen[0].index if isinstance(seen[0], torch.device) else seen[0]
    assert isinstance(index, int)


def test_a_step_call_that_runs_nothing_is_idle_time_not_a_step():
    """A request waiting for its KV keeps the engine "unfinished" while a step has nothing to run:
    those calls are idle time. Calls that launch a step, or hand out tokens (an overlapped step
    collected), are steps."""
    import threading

    done = threading.Event()

    class Engine:
        device = None
        requests = {}
        scheduler = SimpleNamespace(running=[])

        def __init__(self):
            self.num_steps = 0
            self.calls = 0

        def has_unfinished_requests(self):
            return not done.is_set()

        def step(self):
            self.calls += 1
            if self.calls == 5:  # launches one step
                self.num_steps += 1
                return []
            if self.calls == 6:  # collects it: its token, nothing launched
                return [out("a", 7)]
            if self.calls >= 10:
                done.set()
            return []  # nothing to run

    engine = Engine()
    loop = EngineLoop(engine)
    loop.start()
    try:
        assert done.wait(5)
    finally:
        loop.stop()
    assert engine.calls >= 10
    assert loop.num_steps == 2
    assert loop.idle_seconds > 0

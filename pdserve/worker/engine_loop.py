"""The engine in its own thread.

Only this thread touches the engine. Others send it commands (callables run between steps)
and subscribe to a request's outputs; a subscriber is a thread-safe callback, usually one
that hands the output to an asyncio queue with `call_soon_threadsafe`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from typing import Any, Callable

from pdserve.engine import LLMEngine
from pdserve.parallel.errors import TPRankError
from pdserve.sampling_params import RequestOutput

logger = logging.getLogger(__name__)

Subscriber = Callable[[RequestOutput | BaseException], None]


def _put_all(items: list) -> None:
    for put, item in items:
        put(item)


class EngineLoop:
    def __init__(self, engine: LLMEngine, name: str = "pdserve-engine") -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._subscribers: dict[str, Subscriber] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.num_generated_tokens = 0
        # steps and their wall time (decode-only ones apart), and time waiting for work:
        # set against a bare engine's step times, they show what the serving process adds
        self.num_steps = 0
        self.step_seconds = 0.0
        self.num_decode_only_steps = 0
        self.decode_only_seconds = 0.0
        self.num_prefill_graph_steps = 0  # steps with prefill rows through the piecewise graphs
        self.prefill_graph_seconds = 0.0
        self.idle_seconds = 0.0
        self.cpu_seconds = 0.0  # the engine thread's CPU time in its steps
        self.started_at = time.monotonic()
        # called (on the engine thread) when a tensor-parallel rank died and the loop stopped
        self.on_fatal: Callable[[BaseException], None] | None = None
        self.last_error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    # ---- API for other threads -------------------------------------------------------------
    def submit(self, fn: Callable[[LLMEngine], Any]) -> concurrent.futures.Future:
        """Runs `fn(engine)` on the engine thread between steps."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._stop.is_set():
            future.set_exception(RuntimeError("engine loop is stopped"))
            return future
        self._commands.put((fn, future))
        self._wake.set()
        return future

    def subscribe(self, request_id: str, callback: Subscriber) -> None:
        with self._lock:
            self._subscribers[request_id] = callback

    def unsubscribe(self, request_id: str) -> None:
        with self._lock:
            self._subscribers.pop(request_id, None)

    def deliver(self, output: RequestOutput) -> None:
        self.deliver_many([output])

    def deliver_many(self, outputs: list[RequestOutput]) -> None:
        """Hands outputs to their subscribers (a finished one ends its subscription).
        Subscribers that hand outputs to an asyncio loop (with a `loop` attribute and a
        `put_nowait` method to call on it) get them in one `call_soon_threadsafe` per loop,
        not one each: the loop thread wakes once a step instead of once per request, and takes
        the GIL from this thread once."""
        if not outputs:
            return
        by_loop: dict[Any, list] = {}
        direct = []
        with self._lock:
            for out in outputs:
                callback = self._subscribers.get(out.request_id)
                if out.finished:
                    self._subscribers.pop(out.request_id, None)
                if callback is None:
                    continue
                loop, put = getattr(callback, "loop", None), getattr(callback, "put_nowait", None)
                if loop is not None and put is not None:
                    by_loop.setdefault(loop, []).append((put, out))
                else:
                    direct.append((callback, out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)
        for callback, out in direct:
            callback(out)

    def end_aborted(self, request_id: str) -> None:
        """Ends an aborted request's stream with a final `abort` output."""
        self.deliver(RequestOutput(request_id, [], "", True, "abort", 0, 0))

    # ---- the thread ------------------------------------------------------------------------
    def _drain(self) -> None:
        while True:
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(self.engine))
            except BaseException as exc:  # handed to the caller
                future.set_exception(exc)

    def _run(self) -> None:
        engine = self.engine
        device = getattr(engine, "device", None)
        if device is not None and getattr(device, "type", None) == "cuda":
            # the current CUDA device is per thread: kernels launched here (Triton uses the
            # current device) must go to the engine's GPU when the process sees several
            import torch

            # a bare "cuda" (no index: `pdserve worker --device cuda`) is the current device;
            # recent torch refuses set_device without an index
            torch.cuda.set_device(device if device.index is not None else torch.cuda.current_device())
        runner = getattr(engine, "runner", None)
        clock = time.perf_counter
        while not self._stop.is_set():
            self._drain()
            if not engine.has_unfinished_requests():
                group = getattr(engine, "tp_group", None)
                if group is not None:  # a rank that dies while idle takes the worker out too
                    try:
                        group.check_alive()
                    except TPRankError as exc:
                        self._fatal(exc)
                        return
                t = clock()
                self._wake.wait(0.05)
                self._wake.clear()
                self.idle_seconds += clock() - t
                continue
            launched = getattr(engine, "num_steps", None)
            decode_only = getattr(runner, "num_decode_only_steps", 0)
            prefill_graph = getattr(runner, "num_prefill_graph_steps", 0)
            t = clock()
            cpu = time.thread_time()
            try:
                outputs = engine.step()
            except TPRankError as exc:  # a rank died: the engine cannot step again
                self._fatal(exc)
                return
            except Exception as exc:  # a failed step fails its requests, not the worker
                logger.exception("engine step failed")
                self.last_error = exc
                self._fail_all(exc)
                continue
            seconds = clock() - t
            self.cpu_seconds += time.thread_time() - cpu
            if outputs or launched is None or engine.num_steps > launched:
                self.num_steps += 1
                self.step_seconds += seconds
            else:  # nothing to run yet (a request waiting for its KV, say): not a step
                self.idle_seconds += seconds
            if getattr(runner, "num_decode_only_steps", 0) > decode_only:
                self.num_decode_only_steps += 1
                self.decode_only_seconds += seconds
            if getattr(runner, "num_prefill_graph_steps", 0) > prefill_graph:
                self.num_prefill_graph_steps += 1
                self.prefill_graph_seconds += seconds
            if not outputs and not engine.scheduler.running:
                t = clock()
                self._wake.wait(0.005)  # waiting requests that can't be admitted yet
                self._wake.clear()
                self.idle_seconds += clock() - t
            for out in outputs:
                self.num_generated_tokens += len(out.new_token_ids)
            self.deliver_many(outputs)
        self._drain()
        self._fail_all(RuntimeError("worker is shutting down"))

    def _fatal(self, exc: TPRankError) -> None:
        """A tensor-parallel rank died: fail every request, stop, and tell `on_fatal` (the
        worker then exits: its peers are stopped, the router sees a dead worker, Ray restarts it)."""
        logger.error("engine stopped: %s", exc)
        self.last_error = exc
        self._stop.set()
        self._fail_all(exc)
        if self.on_fatal is not None:
            self.on_fatal(exc)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            subscribers, self._subscribers = self._subscribers, {}
        for request_id, callback in subscribers.items():
            self.engine.abort_request(request_id)
            callback(exc)
        for request_id in list(self.engine.requests):
            self.engine.abort_request(request_id)

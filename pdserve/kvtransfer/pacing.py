"""Token-bucket pacing of emulated links, for transports that bypass the kernel's
traffic control (CUDA IPC, RDMA, shared memory). Real bytes move; they are only delayed.

A bucket holds up to ``burst_bytes`` tokens and refills at ``rate_gbps``. A message of
``n`` bytes takes ``n`` tokens; when that leaves the bucket in debt, the sender waits
until the debt is repaid. Debt (rather than waiting for ``n`` tokens up front) lets a
message larger than the burst through at exactly the link rate, and lets concurrent
senders reserve their slots without holding the lock while they sleep.

A sender may say when a message's bytes became ready (``ready_at``, e.g. when the layer
was enqueued). The link could have started on them then, so time the sender itself spent
between messages (posting the previous one, waking late from its sleep) is not lost to the
burst cap: a backlogged link runs at its rate however slow the sender's loop, which at the
fastest emulated rates with MB-sized messages is what holds the rate (docs/history.md, the
pacing row of the earlier GPU session). Without ``ready_at`` the bucket is the classic one.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Callable


_EPSILON_S = 1e-9


class TokenBucket:
    def __init__(
        self,
        rate_gbps: float,
        burst_bytes: int = 1 << 20,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ):
        if not rate_gbps > 0:
            raise ValueError(f"rate_gbps must be > 0, got {rate_gbps!r}")
        if not burst_bytes > 0:
            raise ValueError(f"burst_bytes must be > 0, got {burst_bytes!r}")
        self.rate_gbps = float(rate_gbps)
        self.burst_bytes = int(burst_bytes)
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._free_at = clock() - self.burst_bytes / self.bytes_per_second  # starts full
        self.delayed_seconds = 0.0

    @property
    def bytes_per_second(self) -> float:
        return self.rate_gbps * 1e9 / 8

    def reserve(self, nbytes: int, ready_at: float | None = None) -> float:
        """Take ``nbytes`` tokens; returns the seconds to wait before sending (0 if none).
        ``ready_at`` (clock time, default now): when the bytes were ready to go."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        with self._lock:
            now = self._clock()
            at = now if ready_at is None else min(ready_at, now)
            rate = self.bytes_per_second
            window = self.burst_bytes / rate
            # Virtual time: the bucket holds (t - free_at) * rate tokens at time t, capped at
            # the burst. The bytes start on the link when they were ready or when the link is
            # done with earlier ones; the burst lets them go that much earlier.
            self._free_at = max(self._free_at, at - window) + nbytes / rate
            delay = self._free_at - now
            delay = delay if delay > _EPSILON_S else 0.0  # float rounding, not a wait
            self.delayed_seconds += delay
            return delay

    def acquire(self, nbytes: int, ready_at: float | None = None) -> float:
        """Block (via ``sleep``) until ``nbytes`` may go; returns the seconds slept."""
        delay = self.reserve(nbytes, ready_at)
        if delay > 0:
            self._sleep(delay)
        return delay


class LinkPacer:
    """Buckets by link name. Senders pace by destination address: an address maps onto a
    link through ``route`` (several addresses may share one link), else onto the link of
    the same name, else onto the default bucket if one is set, else is not paced."""

    def __init__(
        self,
        default_gbps: float | None = None,
        burst_bytes: int = 1 << 20,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self._burst = burst_bytes
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._links: dict[str, TokenBucket] = {}
        self._routes: dict[str, str] = {}
        self._default = None if default_gbps is None else self._bucket(default_gbps, burst_bytes)

    def _bucket(self, rate_gbps: float, burst_bytes: int | None) -> TokenBucket:
        return TokenBucket(rate_gbps, burst_bytes or self._burst, self._clock, self._sleep)

    def set_link(self, link: str, rate_gbps: float, burst_bytes: int | None = None) -> None:
        """Create or replace the bucket of ``link``."""
        with self._lock:
            self._links[link] = self._bucket(rate_gbps, burst_bytes)

    def route(self, address: str, link: str) -> None:
        """Traffic to ``address`` crosses ``link``."""
        with self._lock:
            if link not in self._links:
                raise ValueError(f"unknown link {link!r}; call set_link first")
            self._routes[address] = link

    def bucket_for(self, address: str) -> TokenBucket | None:
        """The bucket of ``address``'s link; an address with an incarnation (``...#id``) that is
        not routed itself is looked up without it."""
        with self._lock:
            link = self._routes.get(address, address)
            if link not in self._links and "#" in address:
                base = address.partition("#")[0]
                link = self._routes.get(base, base)
            return self._links.get(link, self._default)

    def now(self) -> float:
        """The pacer's clock, for ``ready_at`` stamps."""
        return self._clock()

    def reserve(self, address: str, nbytes: int, ready_at: float | None = None) -> float:
        bucket = self.bucket_for(address)
        return 0.0 if bucket is None else bucket.reserve(nbytes, ready_at)

    def acquire(self, address: str, nbytes: int, ready_at: float | None = None) -> float:
        bucket = self.bucket_for(address)
        return 0.0 if bucket is None else bucket.acquire(nbytes, ready_at)

    def rates(self) -> dict[str, float]:
        with self._lock:
            return {name: bucket.rate_gbps for name, bucket in self._links.items()}


class LinkHolds:
    """A sender's record, per token bucket, of its latest post: which messages the link itself
    held back (phase ``link`` of kvtransfer.base, ``TransferResult.link_bytes``).

    A message posted at ``now`` was held by the link when it was ready before the bucket's
    previous message was posted (it queued behind earlier bytes) and waited for the bucket, as
    did that previous message: both were posted when the bucket let them go, so the link carried
    it from that post to its own. Messages the bucket let through at once (its burst, or a
    sender behind its schedule) are left out: they would make the figure the rate plus the
    burst. Every such interval belongs to one message, so the sums are the link-bound bytes and
    seconds, whose ratio is the rate the bucket delivered while it was the bottleneck: its SET
    rate when pacing holds. Buckets are held weakly (a reloaded pacer drops its old ones)."""

    def __init__(self) -> None:
        self._last: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # bucket -> (post time, waited)
        self._lock = threading.Lock()

    def posted(self, bucket: TokenBucket, now: float, waited: bool, ready_at: float) -> float | None:
        """A message ready at ``ready_at`` went through ``bucket`` at ``now`` (``waited``: the
        bucket delayed it): the link's seconds on it when the link held it back, else None."""
        with self._lock:
            last = self._last.get(bucket)
            self._last[bucket] = (now, waited)
        if last is not None and waited and last[1] and ready_at <= last[0]:
            return now - last[0]
        return None

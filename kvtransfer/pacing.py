"""Token-bucket pacing of emulated links, for transports that bypass the kernel's
traffic control (CUDA IPC, RDMA, shared memory). Real bytes move; they are only delayed.

A bucket holds up to ``burst_bytes`` tokens and refills at ``rate_gbps``. A message of
``n`` bytes takes ``n`` tokens; when that leaves the bucket in debt, the sender waits
until the debt is repaid. Debt (rather than waiting for ``n`` tokens up front) lets a
message larger than the burst through at exactly the link rate, and lets concurrent
senders reserve their slots without holding the lock while they sleep.
"""

from __future__ import annotations

import threading
import time
from typing import Callable


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
        self._tokens = float(self.burst_bytes)
        self._last = clock()
        self.delayed_seconds = 0.0

    @property
    def bytes_per_second(self) -> float:
        return self.rate_gbps * 1e9 / 8

    def reserve(self, nbytes: int) -> float:
        """Take ``nbytes`` tokens now; returns the seconds to wait before sending (0 if none)."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        with self._lock:
            now = self._clock()
            self._tokens = min(float(self.burst_bytes), self._tokens + (now - self._last) * self.bytes_per_second)
            self._last = now
            self._tokens -= nbytes
            delay = -self._tokens / self.bytes_per_second if self._tokens < 0 else 0.0
            self.delayed_seconds += delay
            return delay

    def acquire(self, nbytes: int) -> float:
        """Block (via ``sleep``) until ``nbytes`` may go; returns the seconds slept."""
        delay = self.reserve(nbytes)
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
        with self._lock:
            link = self._routes.get(address, address)
            return self._links.get(link, self._default)

    def reserve(self, address: str, nbytes: int) -> float:
        bucket = self.bucket_for(address)
        return 0.0 if bucket is None else bucket.reserve(nbytes)

    def acquire(self, address: str, nbytes: int) -> float:
        bucket = self.bucket_for(address)
        return 0.0 if bucket is None else bucket.acquire(nbytes)

    def rates(self) -> dict[str, float]:
        with self._lock:
            return {name: bucket.rate_gbps for name, bucket in self._links.items()}

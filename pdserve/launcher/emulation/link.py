"""`LinkSpec`: one emulated link's rate and latency, as the spec file, the namespaces and the
shaping read it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LinkSpec:
    """One emulated link between two nodes: ``gbps`` in each direction (None: unshaped)
    and ``latency_ms`` added one way in each direction (the round trip gains twice that)."""

    gbps: float | None = None
    latency_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.gbps is not None and (isinstance(self.gbps, bool) or not self.gbps > 0):
            raise ValueError(f"gbps must be > 0 (or None for unshaped), got {self.gbps!r}")
        if isinstance(self.latency_ms, bool) or not self.latency_ms >= 0:
            raise ValueError(f"latency_ms must be >= 0, got {self.latency_ms!r}")

    @property
    def shaped(self) -> bool:
        return self.gbps is not None or self.latency_ms > 0

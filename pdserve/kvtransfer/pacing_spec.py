"""Per-destination pacing of a KV sender, from one option string.

Format (entries separated by commas; spaces ignored)::

    SPEC   := ENTRY ("," ENTRY)*
    ENTRY  := TARGET "=" GBPS  |  "burst=" BYTES
    TARGET := "default"                   every destination no other entry matches
            | "ucx://" HOST ":" PORT      HOST and PORT may be globs: ucx://10.0.0.2:*
            | "nixl://" HOST ":" PORT     a NIXL receiver's control address (kvtransfer.nixl;
                                          its "/agent" suffix, like a "#id", is not matched)
            | HOST                        shorthand for ucx://HOST:*
    GBPS   := a number > 0 (Gbit/s)
    BYTES  := an integer, optionally with k, M, G (x1000) or KiB, MiB, GiB (x1024)

Examples: ``default=10`` (all destinations through one 10 Gbit/s link),
``ucx://10.0.0.2:*=1,10.0.0.3=25`` (two links; other destinations not paced),
``10.0.0.2=1,default=100,burst=4MiB``.

Semantics: each entry is one emulated link with one token bucket. A destination address
takes the first entry whose pattern matches it (in the order written), else ``default``,
else it is not paced. All addresses matching one entry share its bucket (two decode
workers on one node share that node's link), and so do all destinations that fall to
``default``. ``burst`` (default 1 MiB) is the bucket depth of every link.

A worker gets it through ``WorkerConfig.kv_options`` under the key ``"pacer"``, either
as this string or as ``"file:PATH"`` (a file holding such a string, re-read whenever it
changes: the rates of a running worker can be switched between experiment runs) -- the
worker builds the pacer in its own process: strings survive Ray and the command line, a
LinkPacer with its lock does not pickle -- or as a built LinkPacer;
``create_sender(backend, caches, pacer=<LinkPacer>)`` is what kvtransfer receives.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import re
from dataclasses import dataclass

from pdserve.kvtransfer.pacing import LinkPacer
from pdserve.kvtransfer.ucx_runtime import SCHEME

NIXL_SCHEME = "nixl://"  # kvtransfer.nixl.control.SCHEME (not imported: the nixl package imports both of its roles)

logger = logging.getLogger(__name__)

PACER_OPTION = "pacer"  # the key in WorkerConfig.kv_options and create_sender(**opts)
DEFAULT_BURST_BYTES = 1 << 20

_SIZE = re.compile(r"^(\d+)\s*(k|M|G|KiB|MiB|GiB)?$")
_MULT = {None: 1, "k": 10**3, "M": 10**6, "G": 10**9, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
_HOST = re.compile(r"^[A-Za-z0-9.\-*?\[\]:]+$")


@dataclass(frozen=True)
class PacingSpec:
    links: tuple[tuple[str, float], ...]  # (pattern "ucx://host:port" with globs, gbps), in match order
    default_gbps: float | None = None
    burst_bytes: int = DEFAULT_BURST_BYTES

    def __str__(self) -> str:
        parts = [f"{p}={g:g}" for p, g in self.links]
        if self.default_gbps is not None:
            parts.append(f"default={self.default_gbps:g}")
        if self.burst_bytes != DEFAULT_BURST_BYTES:
            parts.append(f"burst={self.burst_bytes}")
        return ",".join(parts)


def parse_pacing(text: str) -> PacingSpec:
    """Parse a pacing spec; ValueError names the bad entry."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"pacing spec must be a non-empty string like 'default=10', got {text!r}")
    links: list[tuple[str, float]] = []
    default = None
    burst = DEFAULT_BURST_BYTES
    seen: set[str] = set()
    for raw in text.split(","):
        entry = raw.replace(" ", "")
        target, sep, value = entry.rpartition("=")
        if not sep or not target or not value:
            raise ValueError(f"pacing entry {raw.strip()!r}: expected TARGET=GBPS (e.g. default=10, 10.0.0.2=1)")
        if target in seen:
            raise ValueError(f"pacing entry {raw.strip()!r}: {target!r} is given twice")
        seen.add(target)
        if target == "burst":
            match = _SIZE.match(value)
            if not match or int(match[1]) <= 0:
                raise ValueError(f"pacing entry {raw.strip()!r}: burst must be a byte count > 0 like 1MiB")
            burst = int(match[1]) * _MULT[match[2]]
            continue
        try:
            gbps = float(value)
        except ValueError:
            raise ValueError(f"pacing entry {raw.strip()!r}: rate {value!r} is not a number of Gbit/s") from None
        if not gbps > 0 or gbps != gbps or gbps == float("inf"):
            raise ValueError(f"pacing entry {raw.strip()!r}: rate must be > 0 Gbit/s")
        if target == "default":
            default = gbps
        else:
            links.append((_pattern(target, raw.strip()), gbps))
    return PacingSpec(tuple(links), default, burst)


def _pattern(target: str, entry: str) -> str:
    scheme = next((x for x in (SCHEME, NIXL_SCHEME) if target.startswith(x)), None)
    if scheme is not None:
        host, sep, port = target[len(scheme):].rpartition(":")
        if not sep or not host or not port:
            raise ValueError(f"pacing entry {entry!r}: expected {scheme}HOST:PORT (PORT may be *)")
        if not (port.isdigit() or set(port) <= set("0123456789*?[]-")):
            raise ValueError(f"pacing entry {entry!r}: bad port {port!r}")
    else:
        if "/" in target or (":" in target and not target.startswith("[")):
            raise ValueError(f"pacing entry {entry!r}: a target is default, {SCHEME}HOST:PORT or a bare HOST")
        host = target
        target = f"{SCHEME}{target}:*"
    if not _HOST.match(host.strip("[]")):
        raise ValueError(f"pacing entry {entry!r}: bad host {host!r}")
    return target


class PatternPacer(LinkPacer):
    """A LinkPacer whose links are address patterns: the first pattern matching a new
    destination routes it onto that pattern's bucket (once; later lookups are exact)."""

    def __init__(self, spec: PacingSpec, **kwargs):
        super().__init__(spec.default_gbps, spec.burst_bytes, **kwargs)
        self._apply(spec)

    def _apply(self, spec: PacingSpec) -> None:
        with self._lock:
            self._links.clear()
            self._routes.clear()
            self._default = None if spec.default_gbps is None else self._bucket(spec.default_gbps, spec.burst_bytes)
        self.spec = spec
        self._burst = spec.burst_bytes
        self._seen: set[str] = set()
        for pattern, gbps in spec.links:
            self.set_link(pattern, gbps)

    def bucket_for(self, address: str):
        if address not in self._seen:
            self._seen.add(address)
            bases = (address, address.partition("#")[0], link_address(address))
            for pattern, _ in self.spec.links:
                if any(fnmatch.fnmatchcase(base, pattern) for base in bases):
                    self.route(address, pattern)
                    break
        return super().bucket_for(address)


def link_address(address: str) -> str:
    """A KV receiver's address without what changes when it restarts: the incarnation (``#id``)
    and, for NIXL, the agent's name (``nixl://HOST:PORT/AGENT``): what a pacing entry names."""
    base = address.partition("#")[0]
    if base.startswith(NIXL_SCHEME):
        base = NIXL_SCHEME + base[len(NIXL_SCHEME):].partition("/")[0]
    return base


FILE_PREFIX = "file:"


def read_pacing_file(path: str) -> PacingSpec:
    """The pacing spec held in ``path`` (one spec string; ``#`` lines are comments)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
    except OSError as e:
        raise ValueError(f"pacing file {path}: cannot read: {e.strerror or e}") from None
    try:
        return parse_pacing(",".join(lines))
    except ValueError as e:
        raise ValueError(f"pacing file {path}: {e}") from None


class FilePacer(PatternPacer):
    """A PatternPacer whose spec lives in a file, re-read when the file changes (its mtime
    or size), checked at most every ``check_s`` seconds on the sender's path. Changing the
    file changes the rates of the running sender: new buckets start full at the new rate.
    A file that goes bad keeps the last good rates (logged once per change)."""

    def __init__(self, path: str, check_s: float = 0.05, **kwargs):
        self.path = path
        self.check_s = check_s
        self._stamp = self._stat()
        super().__init__(read_pacing_file(path), **kwargs)
        self._checked_at = self._clock()
        self.reloads = 0

    def _stat(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size)

    def _maybe_reload(self) -> None:
        now = self._clock()
        if now - self._checked_at < self.check_s:
            return
        self._checked_at = now
        stamp = self._stat()
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            spec = read_pacing_file(self.path)
        except ValueError as e:
            logger.error("%s; keeping %s", e, self.spec)
            return
        self._apply(spec)
        self.reloads += 1
        logger.warning("KV pacing now %s (from %s)", spec, self.path)

    def bucket_for(self, address: str):
        self._maybe_reload()
        return super().bucket_for(address)


def build_pacer(spec: str | PacingSpec, **kwargs) -> PatternPacer:
    """A pacer for ``create_sender(..., pacer=...)`` from a spec string, or ``file:PATH``
    (see module doc). ``kwargs`` (clock, sleep) go to LinkPacer, for tests."""
    if isinstance(spec, str) and spec.startswith(FILE_PREFIX):
        return FilePacer(spec[len(FILE_PREFIX):], **kwargs)
    return PatternPacer(parse_pacing(spec) if isinstance(spec, str) else spec, **kwargs)


def sender_options(kv_options) -> dict:
    """``WorkerConfig.kv_options`` -> keyword options of ``create_sender``: a pacing spec
    string under ``"pacer"`` becomes a PatternPacer; everything else passes through."""
    opts = dict(kv_options)
    if isinstance(opts.get(PACER_OPTION), (str, PacingSpec)):
        opts[PACER_OPTION] = build_pacer(opts[PACER_OPTION])
    return opts


def pacing_for_node(node_links: dict[str, float]) -> str:
    """The spec of a sender on one node: ``{peer address: gbps}`` -> ``"peer=gbps,..."``."""
    return ",".join(f"{host}={gbps:g}" for host, gbps in node_links.items())

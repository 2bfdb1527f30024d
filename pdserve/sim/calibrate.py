"""The speed of a shared host during one real run, measured from the run's own token times.

A `pdserve profile` times the engine alone, at one moment. On a shared host the same engine
steps at other speeds at other moments: in the committed CPU runs (one session, same
workers), the decode step of a request that had its decode worker to itself, with no other
request decoding anywhere, differed from run to run and from the profile's (docs/experiments.md,
"Fidelity against the committed CPU runs"). No model of the workload can predict that; it is
the host's phase.

`host_factor(profile, records)` measures it: the gaps between consecutive tokens of every
request whose decode span (first to last token) overlaps no other request's decode span are
single-request decode steps; the factor is their mean over the profile's step for one
request at their mean context. `scale_profile(profile, time_factor=factor)` then gives the
run's profile. It uses the run's own timestamps, so a simulation with it agrees on isolated
decode steps by construction; what it predicts on its own is everything else (batched
steps, prefill, queueing, TTFT, the tails), from that one number.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from pdserve.router.placement.profiles import Profile


def isolated_gaps(records: Iterable[Mapping]) -> list[tuple[float, int]]:
    """[(gap seconds, context tokens)] between consecutive tokens of each streamed request
    (status 200) whose decode span overlaps no other streamed request's decode span; the
    context of a gap is the prompt plus the tokens before it."""
    spans = []
    for r in records:
        times = r.get("token_times_s") or []
        if r.get("status") == 200 and len(times) >= 2:
            absolute = [r["sent_s"] + t for t in times]
            spans.append((absolute[0], absolute[-1], absolute, int(r["prompt_tokens"])))
    spans.sort(key=lambda s: s[0])
    gaps = []
    for i, (start, end, times, prompt) in enumerate(spans):
        if any(j != i and s < end and e > start for j, (s, e, _, _) in enumerate(spans)):
            continue
        gaps.extend((b - a, prompt + k + 1) for k, (a, b) in enumerate(zip(times, times[1:])))
    return gaps


def host_factor(profile: Profile, records: Iterable[Mapping], min_gaps: int = 30) -> tuple[float, int]:
    """(mean isolated gap / the profile's one-request step at their mean context, gaps used).
    ValueError when fewer than `min_gaps` isolated gaps exist (a run too busy to measure)."""
    gaps = isolated_gaps(records)
    if len(gaps) < min_gaps:
        raise ValueError(f"only {len(gaps)} isolated decode gaps (at least {min_gaps} needed)")
    mean_gap = sum(g for g, _ in gaps) / len(gaps)
    mean_context = sum(c for _, c in gaps) / len(gaps)
    return mean_gap / profile.decode_step_seconds(1, round(mean_context)), len(gaps)

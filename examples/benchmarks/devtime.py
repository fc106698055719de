"""Device time of jitted calls from the profiler's GPU activity records (CUPTI), not the host clock.

Why: on the lent H200 machine a synchronised call pays ~0.1-4 ms of host round trip that varies from call
to call, more than the kernels being compared (10-200 us). The profiler timestamps every kernel on the
GPU, so the device span of a call (first kernel start -> last kernel end, launch gaps inside the program
included) and the time of named kernels are exact to the microsecond.

    spans, kernels = profile_calls(f, args, calls=20)
    span_us = median(spans) / 1e3            # device time of one call, ns -> us
    kernels[0]                               # [(kernel name, start ns, duration ns)] of the first call

Calls are told apart by kernel count (every call runs the same program, so the events split into equal
runs), else by the host sync between them (a gap of > `gap_ns` with no kernel running). On a
host without a GPU plane (CPU), `profile_calls` returns None and callers fall back to host timing.
"""
from __future__ import annotations

import jax
from jax.profiler import ProfileData

GAP_NS = 100_000  # a pause this long between kernels = the host sync between two calls


def _gpu_kernel_events(xspace: bytes):
    """[(start_ns, end_ns, name)] of kernel / memcpy activity on the first GPU, sorted by start."""
    data = ProfileData.from_serialized_xspace(xspace)
    plane = next((p for p in data.planes if p.name.startswith("/device:GPU:0")), None)
    if plane is None:
        return None
    ev = []
    for line in plane.lines:
        if line.name.startswith("XLA") or "Modules" in line.name or "Ops" in line.name:
            continue  # derived lines repeat the kernels' time ranges
        ev += [(e.start_ns, e.start_ns + e.duration_ns, e.name) for e in line.events]
    return sorted(ev)


def profile_calls(f, args, *, calls: int, gap_ns: int = GAP_NS):
    """Run `f(*args)` (jitted, already compiled) `calls` times under the profiler.

    Returns (spans_ns [per call], kernels [per call: [(name, start_ns, dur_ns)]]) or None without a GPU plane.
    """
    from jax._src.lib import _profiler  # the profiler session API behind jax.profiler.trace

    jax.block_until_ready(f(*args))
    session = _profiler.ProfilerSession(_profiler.ProfileOptions())
    for _ in range(calls):
        jax.block_until_ready(f(*args))
    events = _gpu_kernel_events(session.stop())
    if not events:
        return None
    if len(events) % calls == 0:  # every call runs the same program: equal runs of kernels
        n = len(events) // calls
        groups = [events[c * n:(c + 1) * n] for c in range(calls)]
        return _spans(groups)
    groups, cur, end = [], [], 0
    for s, e, name in events:
        if cur and s - end > gap_ns:
            groups.append(cur)
            cur = []
        end = max(end, e) if cur else e
        cur.append((s, e, name))
    groups.append(cur)
    return _spans(groups)


def _spans(groups):
    spans = [max(e for _, e, _ in g) - g[0][0] for g in groups]
    kernels = [[(name, s, e - s) for s, e, name in g] for g in groups]
    return spans, kernels

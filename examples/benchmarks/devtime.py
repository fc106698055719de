"""Device time of jitted calls from the profiler's GPU activity records (CUPTI), not the host clock.

Why: a synchronised call pays a host round trip (0.1-4 ms on a shared GPU host, varying from call to call), more
than the kernels being compared (10-200 us). The profiler timestamps every kernel on the GPU, so the device span of
a call (first kernel start -> last kernel end, launch gaps inside the program included) and the time of named
kernels are exact to the microsecond.

    spans, kernels = profile_calls(f, args, calls=20)
    span_us = median(spans) / 1e3            # device time of one call, ns -> us
    kernels[0]                               # [(kernel name, start ns, duration ns)] of the first call
    kernel_groups(kernels, top=10)           # [(name, ns per call, launches per call)], the most time first

Public APIs only: `jax.profiler.start_trace` / `stop_trace` write an XSpace file, read back with
`jax.profiler.ProfileData.from_file`. Calls are told apart by kernel count (every call runs the same program, so
the events split into equal runs), else by the host sync between them (a gap of > `gap_ns` with no kernel
running). Without a GPU plane (CPU) `profile_calls` returns None and callers fall back to host timing.
"""
from __future__ import annotations

import collections
import re
import tempfile
from pathlib import Path

import jax
from jax.profiler import ProfileData

GAP_NS = 100_000  # a pause this long between kernels = the host sync between two calls


def gpu_kernel_events(data: ProfileData):
    """[(start_ns, end_ns, name)] of kernel / memcpy activity on the first GPU, sorted by start; None without one."""
    plane = next((p for p in data.planes if p.name.startswith("/device:GPU:0")), None)
    if plane is None:
        return None
    ev = []
    for line in plane.lines:
        if line.name.startswith("XLA") or "Modules" in line.name or "Ops" in line.name:
            continue  # derived lines repeat the kernels' time ranges
        ev += [(e.start_ns, e.start_ns + e.duration_ns, e.name) for e in line.events]
    return sorted(ev)


def trace_calls(f, args, calls: int) -> ProfileData:
    """Run `f(*args)` (already compiled) once to warm up, then `calls` times under the profiler; the trace."""
    jax.block_until_ready(f(*args))
    with tempfile.TemporaryDirectory() as log_dir:
        jax.profiler.start_trace(log_dir)
        try:
            for _ in range(calls):
                jax.block_until_ready(f(*args))
        finally:
            jax.profiler.stop_trace()
        files = sorted(Path(log_dir).rglob("*.xplane.pb"))
        if not files:
            raise RuntimeError(f"jax.profiler wrote no .xplane.pb trace under {log_dir}")
        return ProfileData.from_file(str(files[-1]))


def profile_calls(f, args, *, calls: int, gap_ns: int = GAP_NS):
    """Run `f(*args)` (jitted, already compiled) `calls` times under the profiler.

    Returns (spans_ns [per call], kernels [per call: [(name, start_ns, dur_ns)]]) or None without a GPU plane.
    """
    events = gpu_kernel_events(trace_calls(f, args, calls))
    if not events:
        return None
    if len(events) % calls == 0:  # every call runs the same program: equal runs of kernels
        n = len(events) // calls
        return _spans([events[c * n:(c + 1) * n] for c in range(calls)])
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


def kernel_groups(kernels, top: int):
    """[(name, ns per call, launches per call)] of the `top` kernel names taking the most time, averaged over the
    calls of `profile_calls`'s kernels, numeric suffixes folded (one group per kind of fusion or kernel)."""
    groups = collections.defaultdict(lambda: [0, 0])
    for name, _, duration_ns in (k for call in kernels for k in call):
        g = groups[re.sub(r"[_.]\d+", "", name)[:90]]
        g[0] += duration_ns
        g[1] += 1
    n = len(kernels)
    return [(name, t / n, c / n) for name, (t, c) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]]


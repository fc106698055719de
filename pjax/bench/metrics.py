"""The benchmark's metrics, defined as `vllm bench serve` defines them.

- output_tokens_per_s (OTPS) = total output tokens / duration of the run (wall time, compilation excluded).
- TPOT per request = (e2e - TTFT) / (output tokens - 1), over requests with more than one output token;
  TTFT and end-to-end latency (e2el) per request from the moment it started; mean / median / p99 of each, in ms.
- mean_acceptance_length = 1 + accepted tokens / drafts (the bonus token included), acceptance_rates[i] = rounds
  whose draft i was accepted / drafts, acceptance_rate = accepted / drafted tokens; None without drafts.
- Beyond vllm: acceptance_length_p10 / _p90, the 10th / 90th percentile over requests of each request's own
  acceptance length: how much acceptance varies from one request to the next (the slowest rows set a static batch's
  time).
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from pjax.bench.backend import RequestResult

__all__ = ["acceptance", "by_category", "latency", "summarize"]


def _stats(values: Sequence[float], name: str) -> dict:
    """{name_ms_mean, name_ms_median, name_ms_p99} of seconds (None when there are no values)."""
    if not len(values):
        return {f"{name}_ms_mean": None, f"{name}_ms_median": None, f"{name}_ms_p99": None}
    ms = 1e3 * np.asarray(values, np.float64)
    return {f"{name}_ms_mean": float(ms.mean()), f"{name}_ms_median": float(np.median(ms)),
            f"{name}_ms_p99": float(np.percentile(ms, 99))}


def latency(requests: Sequence[RequestResult]) -> dict:
    """TTFT, TPOT and end-to-end latency statistics of `requests` (ms)."""
    return {**_stats([r.ttft_s for r in requests], "ttft"),
            **_stats([r.tpot_s for r in requests if r.tpot_s is not None], "tpot"),
            **_stats([r.e2e_s for r in requests], "e2el")}


def acceptance(requests: Sequence[RequestResult], k) -> dict:
    """Acceptance of the drafts of `requests` (K drafts per round; "auto": a budget that varies, whose requests
    carry their drafts verified and tested per position: the rates per position are then the products of the
    conditional rates, `pjax.decode.engine.acceptance_stats`)."""
    auto = k == "auto"
    if auto:
        k = max((len(r.accepted_per_position) for r in requests), default=0)
    drafts = sum(r.num_drafts for r in requests)
    accepted = sum(r.num_accepted_tokens for r in requests)
    per_pos, tested = np.zeros(k, np.int64), np.zeros(k, np.int64)
    for r in requests:
        per_pos += np.asarray(r.accepted_per_position[:k], np.int64)
        if auto:
            tested += np.asarray(r.tested_per_position[:k], np.int64)
    draft_tokens = sum(r.num_draft_tokens for r in requests) if auto else drafts * k
    rounds = sum(r.rounds for r in requests)
    out = {"num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
           "mean_budget": draft_tokens / rounds if rounds else None}
    if k == 0 or drafts == 0:
        return {**out, "mean_acceptance_length": None, "acceptance_rate": None, "acceptance_rates": None,
                "acceptance_length_p10": None, "acceptance_length_p90": None}
    each = [1.0 + r.num_accepted_tokens / r.num_drafts for r in requests if r.num_drafts]
    rates = (np.cumprod(np.where(tested > 0, per_pos / np.maximum(tested, 1), 0.0)) if auto else per_pos / drafts)
    return {**out, "mean_acceptance_length": 1.0 + accepted / drafts, "acceptance_rate": accepted / draft_tokens,
            "acceptance_rates": [float(x) for x in rates],
            "acceptance_length_p10": float(np.percentile(each, 10)),
            "acceptance_length_p90": float(np.percentile(each, 90))}


def summarize(requests: Sequence[RequestResult], duration_s: float, k: int) -> dict:
    """Every metric of one run: throughput over `duration_s`, latencies, acceptance, rounds and stop reasons."""
    out_tokens = sum(r.output_tokens for r in requests)
    reasons: dict[str, int] = {}
    for r in requests:
        reasons[r.stop_reason] = reasons.get(r.stop_reason, 0) + 1
    rounds = [r.rounds for r in requests]
    return {
        "num_prompts": len(requests),
        "output_tokens": out_tokens,
        "duration_s": duration_s,
        "output_tokens_per_s": out_tokens / duration_s if duration_s > 0 else None,
        "request_throughput": len(requests) / duration_s if duration_s > 0 else None,
        **latency(requests),
        **acceptance(requests, k),
        "rounds": int(sum(rounds)),
        "rounds_per_request_mean": float(np.mean(rounds)) if rounds else None,
        "stop_reasons": dict(sorted(reasons.items())),
    }


def by_category(requests: Sequence[RequestResult], categories: Sequence[Optional[str]], k: int) -> dict:
    """Per category: prompts, output tokens, acceptance and latency of its requests (throughput is a property of
    the whole run, not of a category)."""
    groups: dict[str, list[RequestResult]] = {}
    for r, c in zip(requests, categories):
        if c is not None:
            groups.setdefault(c, []).append(r)
    return {c: {"num_prompts": len(rs), "output_tokens": sum(r.output_tokens for r in rs),
                **acceptance(rs, k), **latency(rs)} for c, rs in groups.items()}

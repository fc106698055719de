"""The server's Prometheus metrics, under vLLM's names and labels (`model_name`, `engine`) so its dashboards work:

    vllm:num_requests_running / vllm:num_requests_waiting          gauges, read from the engine at each scrape
    vllm:prompt_tokens_total / vllm:generation_tokens_total        counters of finished requests' tokens
    vllm:request_success_total{finished_reason}                    finished requests, by OpenAI finish reason
    vllm:spec_decode_num_drafts_total, ..._num_draft_tokens_total, ..._num_accepted_tokens_total,
    vllm:spec_decode_num_accepted_tokens_per_pos_total{position}   speculative decoding (only with drafting)
    vllm:time_to_first_token_seconds, vllm:time_per_output_token_seconds, vllm:e2e_request_latency_seconds
                                                                   histograms (vLLM's buckets)
    pjax:spec_decode_budget                                        gauge: the drafts per round of the engine's last
                                                                   device chunk (with drafting; it varies with --k auto)

Each `Metrics` owns its `CollectorRegistry` (several apps in one process do not collide); `observe(stats,
finish_reason)` records one finished request from its engine statistics (thread-safe: called on the engine thread).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

__all__ = ["CONTENT_TYPE", "Metrics"]

CONTENT_TYPE = CONTENT_TYPE_LATEST
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


class Metrics:
    """Prometheus metrics of one served model. running / waiting: zero-argument callables (the engine's counts);
    num_speculative_tokens: K (K_max for a budget that follows the load), 0 without drafting (no spec_decode metrics
    then); budget: a zero-argument callable, the K of the engine's last chunk (None: K)."""

    def __init__(self, model_name: str, num_speculative_tokens: int, running, waiting, budget=None):
        self.registry = CollectorRegistry(auto_describe=True)
        names, values = ["model_name", "engine"], [model_name, "0"]

        def make(kind, name, doc, extra=(), **kw):
            return kind(name, doc, labelnames=names + list(extra), registry=self.registry, **kw)

        make(Gauge, "vllm:num_requests_running", "Number of requests in model execution batches.").labels(
            *values).set_function(running)
        make(Gauge, "vllm:num_requests_waiting", "Number of requests waiting to be processed.").labels(
            *values).set_function(waiting)
        self.prompt_tokens = make(Counter, "vllm:prompt_tokens", "Number of prefill tokens processed.").labels(*values)
        self.generation_tokens = make(Counter, "vllm:generation_tokens",
                                      "Number of generation tokens processed.").labels(*values)
        success = make(Counter, "vllm:request_success", "Count of successfully processed requests.",
                       ["finished_reason"])
        self.success = {r: success.labels(*values, r) for r in FINISH_REASONS}
        self.ttft = make(Histogram, "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         buckets=TTFT_BUCKETS).labels(*values)
        self.tpot = make(Histogram, "vllm:time_per_output_token_seconds",
                         "Histogram of time per output token in seconds.", buckets=TPOT_BUCKETS).labels(*values)
        self.e2e = make(Histogram, "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                        buckets=E2E_BUCKETS).labels(*values)
        self.k = num_speculative_tokens
        if self.k:
            self.drafts = make(Counter, "vllm:spec_decode_num_drafts", "Number of spec decoding drafts.").labels(
                *values)
            self.draft_tokens = make(Counter, "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.").labels(
                *values)
            self.accepted = make(Counter, "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.").labels(
                *values)
            per_pos = make(Counter, "vllm:spec_decode_num_accepted_tokens_per_pos",
                           "Accepted tokens per draft position.", ["position"])
            self.accepted_per_pos = [per_pos.labels(*values, str(i)) for i in range(self.k)]
            make(Gauge, "pjax:spec_decode_budget", "Draft tokens per round of the last device chunk.").labels(
                *values).set_function(budget or (lambda: self.k))

    def observe(self, stats: dict, finish_reason: str):
        """One finished request: its engine statistics (`Event.stats`) and OpenAI finish reason."""
        self.prompt_tokens.inc(stats["prompt_tokens"])
        self.generation_tokens.inc(stats["output_tokens"])
        if finish_reason in self.success:
            self.success[finish_reason].inc()
        if stats.get("ttft_s") is not None:
            self.ttft.observe(stats["ttft_s"])
        if stats.get("tpot_s") is not None:
            self.tpot.observe(stats["tpot_s"])
        self.e2e.observe(stats["e2e_s"])
        if self.k:
            self.drafts.inc(stats["num_drafts"])
            self.draft_tokens.inc(stats["num_draft_tokens"])
            self.accepted.inc(stats["num_accepted_tokens"])
            for counter, n in zip(self.accepted_per_pos, stats["accepted_per_position"]):
                counter.inc(n)

    def exposition(self) -> bytes:
        """The registry in Prometheus' text format."""
        return generate_latest(self.registry)

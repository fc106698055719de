"""What the benchmark times: a `Backend` runs a list of requests under one setting (drafting mode, K, concurrency,
...) and returns what each request produced and when. The benchmark's metrics, tables and exactness checks are
computed from these results only, so the scheduling is the backend's choice.

`EngineBackend` (continuous batching, `pjax.serve.Engine`): concurrency c = an engine of c slots; every request of
the run is submitted at once and waits in the engine's queue until a slot frees (vLLM's `--max-concurrency c`).
`BatchBackend` (static batches, `pjax.decode.Generation`): c requests decoded as one ragged batch; the next c start
when all of them have finished.
"""
from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Mapping, Optional, Protocol, Sequence

from pjax.bench.errors import BenchError
from pjax.decode import Generation, precompile
from pjax.decode.compiled import COMPILE_THREADS
from pjax.decode.inputs import bucket_capacity, prefill_buckets
from pjax.serve.engine import STOP_WIDTH, Engine, EngineConfig, RequestParams

__all__ = ["SCHEDULING", "Backend", "BatchBackend", "EngineBackend", "Request", "RequestResult", "RunResult",
           "RunSettings"]

SCHEDULING = ("continuous", "static")


@dataclasses.dataclass(frozen=True)
class Request:
    """One request: `tokens` its rendered prompt ids, `seed` its sampling seed."""
    id: str
    tokens: tuple[int, ...]
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """One benchmark configuration.

    drafting: "parallel" | "sequential" | "none"; k: drafts per round (0 for "none"); concurrency: requests in
    flight; max_positions: KV positions the longest request can need (prompt + new tokens + drafting slack), the
    same for every configuration of a dataset so that every mode reads the same cache size; eos_token_ids: ids
    that end a request (empty: every request runs max_new_tokens); simulate_acceptance: K probabilities (the
    engine's simulated verdicts) or None.
    """
    drafting: str
    k: int
    concurrency: int
    max_new_tokens: int
    max_positions: int
    temperature: float = 0.0
    eos_token_ids: tuple[int, ...] = ()
    simulate_acceptance: Optional[tuple[float, ...]] = None


@dataclasses.dataclass
class RequestResult:
    """What one request produced: tokens (generated ids), ttft_s / e2e_s (from the moment it was started, i.e. got
    a slot: its batch started or it was admitted into an engine slot, to its first token / its last), rounds (target
    verify passes), num_drafts (rounds with drafts), accepted_per_position [K] (rounds whose draft i was accepted),
    stop_reason (the engine's)."""
    tokens: list[int]
    ttft_s: float
    e2e_s: float
    rounds: int
    num_drafts: int
    accepted_per_position: list[int]
    stop_reason: str

    @property
    def output_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_accepted_tokens(self) -> int:
        return int(sum(self.accepted_per_position))

    @property
    def tpot_s(self) -> Optional[float]:
        """Time per output token after the first, (e2e - ttft) / (out - 1) (vLLM); None for one token or fewer."""
        n = self.output_tokens
        return (self.e2e_s - self.ttft_s) / (n - 1) if n > 1 else None


@dataclasses.dataclass
class RunResult:
    """requests: one result per request, in the order given; duration_s: wall time of the whole run (the
    throughput's denominator), compilation excluded; compile_s: compilation that still happened inside the run
    (already subtracted from duration_s; 0 after a complete `prepare`)."""
    requests: list[RequestResult]
    duration_s: float
    compile_s: float


class Backend(Protocol):
    """Runs requests under one setting. `scheduling` is one line, shown with the results, saying how requests in
    flight are scheduled."""
    scheduling: str

    def prepare(self, requests: Sequence[Request], settings: RunSettings) -> float:
        """Compile and warm up everything `run(requests, settings)` will execute; returns the compile seconds."""

    def run(self, requests: Sequence[Request], settings: RunSettings,
            on_progress: Optional[Callable[[int], None]] = None) -> RunResult:
        """Run every request; `on_progress(n)` after each n more requests finished."""


class BatchBackend:
    """`pjax.decode.Generation` in static batches of `concurrency` requests.

    drafters: the head of each drafting mode ({"parallel": head, "sequential": head}; "none" needs none).
    implementation / cache_dtype / prefill / draft_sampling: passed to the engine. The KV cache of every batch holds
    `bucket_capacity(settings.max_positions)` positions, so programs depend on the batch's rows, prompt-length and
    packed-row buckets only and `prepare` can compile each of them with a short generation.
    """
    scheduling = ("static batches: concurrency c = c requests decoded as one ragged batch (one "
                  "pjax.decode.Generation, its default device loop in bounded chunks); the next c start when all of "
                  "them finish (no continuous batching)")

    def __init__(self, target, drafters: Mapping[str, object], *, implementation: str = "auto", cache_dtype=None,
                 prefill: str = "auto", draft_sampling: str = "argmax"):
        self.target, self.drafters = target, dict(drafters)
        self.implementation, self.cache_dtype, self.prefill = implementation, cache_dtype, prefill
        self.draft_sampling = draft_sampling

    @staticmethod
    def batches(requests: Sequence[Request], concurrency: int) -> list[Sequence[Request]]:
        return [requests[i:i + concurrency] for i in range(0, len(requests), concurrency)]

    def _generation(self, batch: Sequence[Request], settings: RunSettings, max_new_tokens: int, *,
                    compile_only: bool = False):
        """The Generation of `batch`; compile_only: its programs' compile seconds instead (`precompile`)."""
        s = settings
        return (precompile if compile_only else Generation)(
            self.target, self.drafters.get(s.drafting), [list(r.tokens) for r in batch],
            max_new_tokens=max_new_tokens, num_speculative_tokens=max(s.k, 1), drafting=s.drafting,
            temperature=s.temperature, seed=[r.seed for r in batch], eos_token_id=list(s.eos_token_ids) or None,
            cache_capacity=bucket_capacity(s.max_positions), implementation=self.implementation,
            cache_dtype=self.cache_dtype, simulate_acceptance=s.simulate_acceptance, prefill=self.prefill,
            draft_sampling=self.draft_sampling)

    def prepare(self, requests: Sequence[Request], settings: RunSettings) -> float:
        """The programs of every distinct batch of the run compiled in threads (`pjax.decode.precompile`: XLA
        compiles them in parallel, nothing runs), then one short generation (K + 2 new tokens: prefill and a few
        rounds) per distinct batch, one after another; returns the compile seconds (summed over programs)."""
        firsts = {}
        for batch in self.batches(requests, settings.concurrency):
            firsts.setdefault(prefill_buckets([len(r.tokens) for r in batch], bucket_capacity(settings.max_positions),
                                              self.prefill), batch)
        new_tokens = min(settings.max_new_tokens, settings.k + 2)
        with ThreadPoolExecutor(max_workers=min(len(firsts), COMPILE_THREADS)) as pool:
            compile_s = sum(pool.map(lambda batch: self._generation(batch, settings, new_tokens, compile_only=True),
                                     firsts.values()))
        return compile_s + sum(self._generation(batch, settings, new_tokens).result().stats["compile_time_s"]
                               for batch in firsts.values())

    def run(self, requests: Sequence[Request], settings: RunSettings,
            on_progress: Optional[Callable[[int], None]] = None) -> RunResult:
        out: list[RequestResult] = []
        compile_s = 0.0
        t0 = time.perf_counter()
        for batch in self.batches(requests, settings.concurrency):
            res = self._generation(batch, settings, settings.max_new_tokens).result()
            compile_s += res.stats["compile_time_s"]
            for tokens, r in zip(res.tokens, res.stats["requests"]):
                nd = r["num_drafts"]
                out.append(RequestResult(
                    tokens=list(tokens), ttft_s=r["ttft_s"], e2e_s=r["e2e_s"], rounds=r["rounds"], num_drafts=nd,
                    accepted_per_position=[int(round(a * nd)) for a in r["acceptance_rates"]][:settings.k],
                    stop_reason=r["stop_reason"]))
            if on_progress is not None:
                on_progress(len(batch))
        duration = time.perf_counter() - t0 - compile_s
        return RunResult(out, duration, compile_s)


class EngineBackend:
    """`pjax.serve.Engine` (continuous batching) with `concurrency` requests in flight: the run's requests are fed in
    order, the next one as soon as one finishes, into an engine of `concurrency` slots (rounded up to a power of two:
    a power of two of device rows, never more than `concurrency` requests). A request's TTFT and end-to-end latency
    count from its admission into a slot (the moment vLLM's client would send it).

    drafters: as `BatchBackend`. rounds_per_step: rounds per device chunk (admission, streaming between chunks);
    prefill / draft_sampling / max_admit_rows: the admissions' prefill layout, the drafts' sampling and the requests
    one admission program prefills at most (`EngineConfig`; None: its default).
    Every slot's KV cache holds `bucket_capacity(settings.max_positions)` positions (as `BatchBackend`). One engine
    is kept (the last configuration's, reused by its `run`).
    """
    scheduling = ("continuous batching: concurrency c = c requests in flight in one pjax.serve.Engine (c slots, "
                  "rounded up to a power of two); the next request joins as soon as one finishes, between device "
                  "chunks (vLLM's --max-concurrency c); TTFT and end-to-end latency count from a request's admission")

    def __init__(self, target, drafters: Mapping[str, object], *, implementation: str = "auto", cache_dtype=None,
                 rounds_per_step: int = 8, prefill: str = "padded", draft_sampling: str = "argmax",
                 max_admit_rows: Optional[int] = None):
        self.target, self.drafters = target, dict(drafters)
        self.implementation, self.cache_dtype, self.rounds_per_step = implementation, cache_dtype, rounds_per_step
        self.prefill, self.draft_sampling = prefill, draft_sampling
        self.admit = {} if max_admit_rows is None else {"max_admit_rows": max_admit_rows}
        self._engine: Optional[tuple[tuple, Engine]] = None

    def engine(self, settings: RunSettings) -> Engine:
        """The engine of `settings` (built once per configuration)."""
        s = settings
        key = (s.drafting, s.k, s.concurrency, s.max_positions, s.simulate_acceptance)
        if self._engine is None or self._engine[0] != key:
            self._engine = None  # release the previous engine's device state first
            cfg = EngineConfig(max_slots=s.concurrency, max_len=bucket_capacity(s.max_positions),
                               num_speculative_tokens=max(s.k, 1), drafting=s.drafting,
                               implementation=self.implementation, cache_dtype=self.cache_dtype,
                               rounds_per_step=self.rounds_per_step, simulate_acceptance=s.simulate_acceptance,
                               prefill=self.prefill, draft_sampling=self.draft_sampling, **self.admit)
            self._engine = (key, Engine(self.target, self.drafters.get(s.drafting), cfg))
        return self._engine[1]

    @staticmethod
    def admissions(requests: Sequence[Request], concurrency: int, capacity: int,
                   prefill: str) -> dict[tuple[int, int, Optional[int]], tuple[int, ...]]:
        """The admission programs the run can use, (rows bucket, prompt-length bucket, packed row or None:
        `pjax.decode.inputs.prefill_buckets` for KV capacity `capacity` and layout `prefill`) -> the prompt lengths of
        one admission that uses it: requests are fed in order, so an admission program takes a run of at most
        `concurrency` consecutive requests (pass min(concurrency, the engine's max_admit_rows): a larger admission
        runs as groups of that many; a superset of those made)."""
        lengths = [len(r.tokens) for r in requests]
        out: dict[tuple[int, int, Optional[int]], tuple[int, ...]] = {}
        for i in range(len(lengths)):
            for n in range(1, min(concurrency, len(lengths) - i) + 1):
                run = tuple(lengths[i:i + n])
                out.setdefault(prefill_buckets(run, capacity, prefill), run)
        return out

    def _params(self, r: Request, settings: RunSettings, max_new_tokens: int) -> RequestParams:
        if len(settings.eos_token_ids) > STOP_WIDTH:
            raise BenchError(f"{len(settings.eos_token_ids)} EOS ids: the engine takes {STOP_WIDTH} at most")
        return RequestParams(max_new_tokens, temperature=settings.temperature, seed=r.seed,
                             stop_token_ids=tuple(settings.eos_token_ids))

    def _serve(self, eng: Engine, requests: Sequence[Request], settings: RunSettings, max_new_tokens: int,
               on_progress=None) -> list[tuple[list[int], object]]:
        """Keep `concurrency` requests in the engine (its slots are a power of two, possibly more), submitting the
        next one as one finishes; returns each request's (tokens, final event) in order."""
        params = [self._params(r, settings, max_new_tokens) for r in requests]
        ids: list[int] = []
        tokens: dict[int, list[int]] = {}
        finals: dict[int, object] = {}
        while len(ids) < len(requests) or eng.has_work:
            while len(ids) < len(requests) and eng.num_running + eng.num_waiting < settings.concurrency:
                rid = eng.submit(list(requests[len(ids)].tokens), params[len(ids)])
                ids.append(rid)
                tokens[rid] = []
            done = 0
            for ev in eng.step():
                tokens[ev.request_id] += ev.new_tokens
                if ev.finished:
                    finals[ev.request_id] = ev
                    done += 1
            if done and on_progress is not None:
                on_progress(done)
        return [(tokens[i], finals[i]) for i in ids]

    def prepare(self, requests: Sequence[Request], settings: RunSettings) -> float:
        """Compile and run once the chunk program and every admission program the run can use (`admissions`), then
        serve the first `concurrency` requests for K + 2 new tokens (warm-up)."""
        eng = self.engine(settings)
        before = eng.compile_s
        runs = self.admissions(requests, min(settings.concurrency, eng.max_admit_rows), eng.max_len, eng.prefill)
        eng.precompile_admissions(runs.values(), warm=True)
        self._serve(eng, requests[:settings.concurrency], settings, min(settings.max_new_tokens, settings.k + 2))
        return eng.compile_s - before

    def run(self, requests: Sequence[Request], settings: RunSettings,
            on_progress: Optional[Callable[[int], None]] = None) -> RunResult:
        eng = self.engine(settings)
        compile_before = eng.compile_s
        t0 = time.perf_counter()
        done = self._serve(eng, requests, settings, settings.max_new_tokens, on_progress)
        compile_s = eng.compile_s - compile_before
        duration = time.perf_counter() - t0 - compile_s
        out = []
        for tokens, ev in done:
            st = ev.stats
            nd = st["num_drafts"]
            out.append(RequestResult(
                tokens=tokens, ttft_s=st["ttft_s"] - st["queue_s"], e2e_s=st["e2e_s"] - st["queue_s"],
                rounds=st["rounds"], num_drafts=nd,
                accepted_per_position=[int(round(a * nd)) for a in st["acceptance_rates"]][:settings.k],
                stop_reason=ev.stop_reason))
        return RunResult(out, duration, compile_s)

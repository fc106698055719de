"""What the benchmark times: a `Backend` runs a list of requests under one setting (drafting mode, K, concurrency,
...) and returns what each request produced and when. The benchmark's metrics, tables and exactness checks are
computed from these results only, so the scheduling is the backend's choice.

Both backends run the one engine (`pjax.decode.Engine`) of c slots for concurrency c, with the settings of one
`EngineConfig` (drafting and K per configuration):
`EngineBackend` (continuous batching): the next request joins as soon as one finishes (vLLM's `--max-concurrency c`).
`BatchBackend` (static batches): c requests admitted at once (one prefill of the batch); the next c start when all of
them have finished.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Mapping, Optional, Protocol, Sequence, Union

from pjax.bench.errors import BenchError
from pjax.bench.simulate import SimulatedAcceptance
from pjax.decode.engine import STOP_WIDTH, Engine, RequestParams
from pjax.decode.inputs import bucket_capacity, prefill_buckets
from pjax.decode.settings import EngineConfig
from pjax.decode.state import sampling_modes

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

    drafting: "parallel" | "sequential" | "none"; k: drafts per round (0 for "none"), or "auto" (the engine's
    budget that follows the load, `pjax.decode.budget`); concurrency: requests in
    flight; max_positions: KV positions the longest request can need (prompt + new tokens + drafting slack), the
    same for every configuration of a dataset so that every mode reads the same cache size; eos_token_ids: ids
    that end a request (empty: every request runs max_new_tokens); simulate_acceptance: K probabilities (the
    engine's simulated verdicts; K_max of them with "auto") or None; tree_budget: a tree of N draft tokens per
    round, or None (a chain).
    """
    drafting: str
    k: Union[int, str]
    concurrency: int
    max_new_tokens: int
    max_positions: int
    temperature: float = 0.0
    eos_token_ids: tuple[int, ...] = ()
    simulate_acceptance: Optional[tuple[float, ...]] = None
    tree_budget: Optional[int] = None


@dataclasses.dataclass
class RequestResult:
    """What one request produced: tokens (generated ids), ttft_s / e2e_s (from the moment it was started, i.e. got
    a slot: its batch started or it was admitted into an engine slot, to its first token / its last), rounds (target
    verify passes), num_drafts (rounds with drafts), accepted_per_position [K] (rounds whose draft i was accepted),
    stop_reason (the engine's); num_draft_tokens (drafts verified) and tested_per_position [K] (rounds that verified
    draft i with drafts 0..i-1 accepted) where the budget varies (None: K drafts every drafting round)."""
    tokens: list[int]
    ttft_s: float
    e2e_s: float
    rounds: int
    num_drafts: int
    accepted_per_position: list[int]
    stop_reason: str
    num_draft_tokens: Optional[int] = None
    tested_per_position: Optional[list[int]] = None

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


def _acceptance(settings: RunSettings) -> Optional[SimulatedAcceptance]:
    """The engine's acceptance hook for `settings`: simulated verdicts, or None (the target's)."""
    p = settings.simulate_acceptance
    return None if p is None else SimulatedAcceptance(tuple(p))


class Backend(Protocol):
    """Runs requests under one setting. `scheduling` is one line, shown with the results, saying how requests in
    flight are scheduled."""
    scheduling: str

    def prepare(self, requests: Sequence[Request], settings: RunSettings) -> float:
        """Compile and warm up everything `run(requests, settings)` will execute; returns the compile seconds."""

    def run(self, requests: Sequence[Request], settings: RunSettings,
            on_progress: Optional[Callable[[int], None]] = None) -> RunResult:
        """Run every request; `on_progress(n)` after each n more requests finished."""


class EngineBackend:
    """The engine with `concurrency` requests in flight: the run's requests are queued in order in an engine of
    `max_slots` = `concurrency` (device rows rounded up to a power of two, never more than `concurrency` requests
    running), which admits the next one as soon as one finishes. A request's TTFT and end-to-end latency count from
    its admission into a slot (the moment vLLM's client would send it).

    drafters: the head of each drafting mode ({"parallel": head, "sequential": head}; "none" needs none). config: the
    engine's settings (kernels, cache dtype, prefill layout, draft sampling, rounds per chunk, admission rows); the
    drafting, K, slots and KV positions are each configuration's. Every slot's KV cache holds
    `bucket_capacity(settings.max_positions)` positions. One engine is kept (the last configuration's, reused by its
    `run`). mesh: the engines' (`pjax.decode.Engine`; None: one device).
    """
    scheduling = ("continuous batching: concurrency c = c requests in flight in one pjax.decode.Engine (c slots); "
                  "the next request joins as soon as one finishes, between device chunks (vLLM's --max-concurrency "
                  "c); TTFT and end-to-end latency count from a request's admission")
    static = False

    def __init__(self, target, drafters: Mapping[str, object], config: EngineConfig = EngineConfig(), mesh=None):
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be a pjax.decode.EngineConfig, got {type(config).__name__}")
        self.target, self.drafters, self.config, self.mesh = target, dict(drafters), config, mesh
        self._engine: Optional[tuple[tuple, Engine]] = None

    def engine(self, settings: RunSettings) -> Engine:
        """The engine of `settings` (built once per configuration)."""
        s = settings
        key = (s.drafting, s.k, s.concurrency, s.max_positions, s.simulate_acceptance, s.tree_budget)
        if self._engine is None or self._engine[0] != key:
            self._engine = None  # release the previous engine's device state first
            cfg = dataclasses.replace(self.config, max_slots=s.concurrency, max_len=bucket_capacity(s.max_positions),
                                      num_speculative_tokens=s.k if s.k == "auto" else max(s.k, 1),
                                      drafting=s.drafting,
                                      tree_budget=s.tree_budget,
                                      **({"max_admit_rows": None} if self.static else {}))
            self._engine = (key, Engine(self.target, self.drafters.get(s.drafting), cfg, acceptance=_acceptance(s),
                                        mesh=self.mesh))
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

    def _admission_runs(self, eng: Engine, requests: Sequence[Request], settings: RunSettings):
        """The prompt lengths of admissions that use every admission program the run can use: with no more requests
        than slots, the one admission of them all at the start (run as groups of max_admit_rows); otherwise any run
        of consecutive requests, as earlier ones finish."""
        if 0 < len(requests) <= settings.concurrency:
            return [tuple(len(r.tokens) for r in requests)]
        return self.admissions(requests, min(settings.concurrency, eng.max_admit_rows), eng.max_len,
                               eng.prefill).values()

    def _params(self, r: Request, settings: RunSettings, max_new_tokens: int) -> RequestParams:
        if len(settings.eos_token_ids) > STOP_WIDTH:
            raise BenchError(f"{len(settings.eos_token_ids)} EOS ids: the engine takes {STOP_WIDTH} at most")
        return RequestParams(max_new_tokens, temperature=settings.temperature, seed=r.seed,
                             stop_token_ids=tuple(settings.eos_token_ids))

    def _serve(self, eng: Engine, requests: Sequence[Request], settings: RunSettings, max_new_tokens: int,
               on_progress=None) -> list[tuple[list[int], object]]:
        """Run `concurrency` requests at once: every request queued in the engine (`max_slots` = concurrency: it
        admits the next one as one finishes), or, static, the next `concurrency` submitted when all have finished;
        returns each request's (tokens, final event) in order."""
        params = [self._params(r, settings, max_new_tokens) for r in requests]
        ids: list[int] = []
        tokens: dict[int, list[int]] = {}
        finals: dict[int, object] = {}
        batch = settings.concurrency if self.static else len(requests)
        while len(ids) < len(requests) or eng.has_work:
            room = not eng.has_work if self.static else True
            while room and len(ids) < len(requests) and eng.num_running + eng.num_waiting < batch:
                rid = eng.submit(list(requests[len(ids)].tokens), params[len(ids)])
                ids.append(rid)
                tokens[rid] = []
            done = 0
            for ev in eng.step(final=self.static):
                tokens[ev.request_id] += ev.new_tokens
                if ev.finished:
                    finals[ev.request_id] = ev
                    done += 1
            if done and on_progress is not None:
                on_progress(done)
        return [(tokens[i], finals[i]) for i in ids]

    def prepare(self, requests: Sequence[Request], settings: RunSettings) -> float:
        """Compile and run once the chunk program and every admission program the run can use, then serve the first
        `concurrency` requests for K + 2 new tokens (warm-up; K_max + 2 with "auto")."""
        eng = self.engine(settings)
        before = eng.compile_s
        eng.precompile_admissions(self._admission_runs(eng, requests, settings), warm=True, pipelined=not self.static,
                                  sampling=sampling_modes([(settings.temperature, 0, 1.0)]))  # no top-k / top-p
        self._serve(eng, requests[:settings.concurrency], settings, min(settings.max_new_tokens, eng.spec.k + 2))
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
        auto = settings.k == "auto"
        for tokens, ev in done:
            st = ev.stats
            out.append(RequestResult(
                tokens=tokens, ttft_s=st["ttft_s"] - st["queue_s"], e2e_s=st["e2e_s"] - st["queue_s"],
                rounds=st["rounds"], num_drafts=st["num_drafts"],
                accepted_per_position=list(st["accepted_per_position"])[:eng.spec.k], stop_reason=ev.stop_reason,
                num_draft_tokens=st["num_draft_tokens"] if auto else None,
                tested_per_position=list(st["tested_per_position"]) if auto else None))
        return RunResult(out, duration, compile_s)


class BatchBackend(EngineBackend):
    """Static batches on the same engine: `concurrency` requests admitted at once (one prefill of the whole batch,
    packed where it computes fewer positions under prefill "auto"), decoded until all of them have finished; then
    the next `concurrency` (no continuous batching). Arguments as `EngineBackend`."""
    scheduling = ("static batches: concurrency c = c requests admitted at once into one pjax.decode.Engine of c slots "
                  "(one prefill of the batch) and decoded together; the next c start when all of them finish (no "
                  "continuous batching)")
    static = True

    @staticmethod
    def batches(requests: Sequence[Request], concurrency: int) -> list[Sequence[Request]]:
        return [requests[i:i + concurrency] for i in range(0, len(requests), concurrency)]

    def _admission_runs(self, eng: Engine, requests: Sequence[Request], settings: RunSettings):
        return [tuple(len(r.tokens) for r in batch) for batch in self.batches(requests, settings.concurrency)]

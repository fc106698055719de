"""The continuous-batching engine: requests join and leave a fixed device batch between device chunks.

Slot model. The device holds one `DecodeState` and one `Sampling` of `max_slots` rows (slots; a power of two), each
row with a KV cache of `max_len` positions; at most `max_running` (the config's max_slots) requests run at once. A
free slot is a row marked done: every round computes it (rounds have static shapes) but masks it, so it writes no KV
and emits nothing. A request waits in a FIFO queue until a slot is free, is prefilled into it, decodes together with
whatever else runs, and frees the slot when it stops (EOS, its max_new_tokens, cancellation).

A step (`step`) dispatches device work, then reads a result on the host. The work: (a) an admission, when requests
wait and slots are free: up to (free slots) queued requests, oldest first, are prefilled in groups of at most
`max_admit_rows`, each group as one batch (rows bucketed to a power of two, prompt positions to
`inputs.bucket_length`, and with `EngineConfig.prefill` "auto" / "packed" the prompts packed into one row of a
power-of-two length, `pjax.decode.prefill_target`; padding rows hold one token and stop at prefill) and scattered
into the big state and the big Sampling at their slots, in one jitted program call (`admit`; padding rows carry slot
index max_slots and are dropped); then (b) one device chunk of `rounds_per_step` rounds if anything runs (a step
right after an admission always runs one, so admissions never starve running requests). Every program also returns
a fresh `host_view` of the rows (outputs and counters in one array: one transfer), which the host turns into
`Event`s (the tokens each request produced since its previous event) and the statistics of the requests that
finished, whose slots are freed. Cancellation ends a row on the device state between steps.

Pipelining. While some running request surely outlives the chunk in flight and the next one (its max_new_tokens and
its cache allow more tokens than two chunks can emit), the chunk runs a fixed trip count of rounds (no per-round
read of a loop condition) and is dispatched before the host reads the previous program's view; a step then reports
what the device finished one program earlier, and a slot freed in a chunk is refilled after the next one. (On an H200
the call handing a chunk the donated state returns only about when the chunk before it ends, so the host's work
between two calls is device idle time: `docs/performance.md`.) Rows that stop inside a fixed-trip chunk are masked
for its remaining rounds (no token past a stop). Otherwise (the tail of the work) a step waits for its own chunk,
which ends early once every row is done. `step(final=True)` (a static batch: no arrival expected) always waits for
its own chunk, sized to about FINAL_CHUNK_S of device time (from the rounds per second of the previous final chunk):
few chunk boundaries, and still progress and Ctrl-C between them.

Cost model. Every round computes all max_slots rows (target verify of K + 1 positions per row, drafter pass(es)),
running or not, so a round costs what a batch of max_slots costs whatever the occupancy; an admission costs a
prefill of its rows bucket times its prompt bucket (or of its packed row) plus the scatter (the K/V are written in
place into the slots' rows, so an admission of every slot needs no second cache); a waiting step costs one host round
trip (dispatch, view), a pipelined one none. Programs: two chunk programs (a fixed trip count; ending early) per
sampling mode the running requests need ("greedy", "sampled", "filtered": `EngineSpec.sampling`, chosen on the host
per chunk, so a request's temperature / top-k / top-p can build a program on its first use unless precompiled), plus
one admission program per (rows bucket up to max_admit_rows, prompt-length bucket, packed row bucket) used; with
num_speculative_tokens "auto", those chunk programs for every candidate budget, one of which each chunk runs
(`pjax.decode.budget`: the chooser reads each view's acceptance counters and the chunks' times; no recompilation).
Sampling values within a mode, stop ids (a fixed-width table) and per-request limits are runtime data and never
recompile. Every random draw is keyed on (seed, position), so a request's output does not depend on which slot it
took or on the other requests.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from pjax.decode import inputs as I
from pjax.decode.budget import BudgetChooser, TreeBudget, candidates, label, tree_candidates
from pjax.decode.compiled import COMPILE_THREADS, compiled, matmul_precision, register_program
from pjax.decode.settings import DEFAULT_MAX_LEN, EngineConfig, make_spec
from pjax.decode.state import SAMPLING_MODES, STOP_HOST, STOP_NAMES, DecodeState, EngineSpec, Sampling, sampling_need
from pjax.decode.step import decode_loop, prefill, spec_round
from pjax.dtypes import parse_dtype
from pjax.models.drafter import consistent_drafter
from pjax.models import sharding as SH
from pjax.models.pairing import pair_warnings
from pjax.models.per_shard import traced_on
from pjax.models.target import consistent_target

__all__ = ["Engine", "EngineConfig", "Event", "RequestParams", "STOP_WIDTH", "acceptance_stats", "admit", "mesh_config",
           "state_shardings"]

STOP_WIDTH = 8  # stop ids per request: the width of the device's stop table (fixed: it never recompiles)
FINAL_CHUNK_S = 0.5  # seconds of device work a final step (a static batch) aims for


@dataclasses.dataclass(frozen=True)
class RequestParams:
    """One request's limits and sampling: temperature 0 = greedy; top_k 0 and top_p 1 = off; seed in [0, 2**32);
    stop_token_ids: up to STOP_WIDTH ids that end the request (the stop token is part of the output)."""
    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()


@dataclasses.dataclass
class Event:
    """What one step produced for one request: new_tokens since its previous event (the first event holds the token
    sampled at prefill); when finished, stop_reason ("eos" | "length" | "capacity" | "nonfinite" | "stop") and
    stats: prompt_tokens, output_tokens, rounds, num_drafts, num_draft_tokens, mean_budget (draft tokens verified
    per round), num_accepted_tokens, mean_acceptance_length, acceptance_rates [K] (per draft position),
    accepted_per_position / tested_per_position [K] (`acceptance_stats`), queue_s, ttft_s, e2e_s, tpot_s (seconds
    from `submit`)."""
    request_id: int
    new_tokens: list[int]
    finished: bool
    stop_reason: Optional[str] = None
    stats: Optional[dict] = None


def admit(target, drafter, state: DecodeState, sampling: Sampling, prompts, lengths, new_sampling: Sampling, slots,
          *, spec: EngineSpec, capacity: int, cache_dtype=None, packed_len=None) -> tuple[DecodeState, Sampling]:
    """Prefill a batch of requests and write it into the big state at `slots`.

    state / sampling: B slots; prompts [b, Lp] i32 (right-padded), lengths [b] i32, new_sampling [b]; slots [b] i32
    (B = a padding row, dropped); packed_len: the prefill's layout (`pjax.decode.prefill`: target and drafter). The
    K/V go straight into the big caches' rows (no [b, capacity] copy of a cache: an admission of every slot needs
    no second cache's memory), except a sequential drafter's (built for the b rows, then scattered: its later
    drafting passes read the cache by batch row); the other fields are built for the b rows and scattered. Returns
    the big (state, sampling) with rows `slots` replaced. Pure."""
    in_place = {"target_cache": state.target_cache}
    if spec.drafting.one_pass:
        in_place["drafter_cache"] = state.drafter_cache
    new = prefill(target, drafter, prompts, lengths, new_sampling, spec=spec, capacity=capacity,
                  cache_dtype=cache_dtype, packed_len=packed_len, rows=slots, **in_place)
    put = lambda big, small: big.at[slots].set(small.astype(big.dtype), mode="drop")  # noqa: E731
    rest = lambda s: dataclasses.replace(s, **dict.fromkeys(in_place))  # noqa: E731
    merged = dataclasses.replace(jax.tree.map(put, rest(state), rest(new)), **{k: getattr(new, k) for k in in_place})
    return merged, jax.tree.map(put, sampling, new_sampling)


_HOST_FIELDS = ("out", "num_out", "done", "stop", "rounds", "num_drafts", "num_draft_tokens", "accepted",
                "accepted_at")


def host_view(state: DecodeState):
    """What the host reads of the rows, as one array (one transfer): [B, N + 7 + K] i32, the columns of out [B, N],
    then num_out, done, stop, rounds, num_drafts, num_draft_tokens, accepted, then accepted_at [B, K] (and tested_at
    [B, K] where the state has it: [B, N + 7 + 2 K]). A fresh array: it stays readable while the next program takes
    over the (donated) state."""
    cols = [state.out] + [getattr(state, k).astype(jnp.int32)[:, None] for k in _HOST_FIELDS[1:-1]]
    cols += [state.accepted_at] + ([] if state.tested_at is None else [state.tested_at])
    return jnp.concatenate(cols, axis=1).astype(jnp.int32)


def unpack_view(view: np.ndarray, out_len: int, tested: bool = False) -> dict:
    """`host_view`'s array (on the host) -> {field: writable [B, ...] array}; tested: the view holds tested_at."""
    n = out_len
    host = {"out": view[:, :n]}
    for i, k in enumerate(_HOST_FIELDS[1:-1]):
        host[k] = view[:, n + i]
    host["done"] = host["done"].astype(bool)
    rest = view[:, n + len(_HOST_FIELDS) - 2:]
    if tested:
        host["accepted_at"], host["tested_at"] = np.split(rest, 2, axis=1)
    else:
        host["accepted_at"] = rest
    return host


def state_shardings(tree, mesh):
    """The shardings of a `DecodeState` (or a `Sampling`) on `mesh`: every leaf's rows on "data", the target's KV
    cache also by KV heads on "model" (`pjax.models.sharding.kv_spec`); the drafter is replicated over "model"."""
    rows = lambda x: NamedSharding(mesh, SH.rows_spec(x.shape, mesh))  # noqa: E731
    sh = jax.tree.map(rows, tree)
    if isinstance(tree, DecodeState):
        heads = lambda x: NamedSharding(mesh, SH.kv_spec(x.shape, mesh))  # noqa: E731
        sh = dataclasses.replace(sh, target_cache=jax.tree.map(heads, tree.target_cache))
    return sh


def _on_mesh(mesh, state, *rest):
    """The outputs of a program on `mesh` (None: as they are): the state and sampling with their planned shardings
    (so the next program takes them as compiled), the host view replicated (every process reads it whole)."""
    if mesh is None:
        return (state, *rest)
    out = [jax.lax.with_sharding_constraint(x, state_shardings(x, mesh)) for x in (state, *rest[:-1])]
    return (*out, jax.lax.with_sharding_constraint(rest[-1], NamedSharding(mesh, P())))


def admit_viewed(target, drafter, state, sampling, prompts, lengths, new_sampling, slots, *, mesh=None, **statics):
    """`admit`, and the admitted state's `host_view`; mesh: the engine's (None: one device)."""
    with traced_on(mesh, target.experts):
        state, sampling = admit(target, drafter, state, sampling, prompts, lengths, new_sampling, slots, **statics)
    return _on_mesh(mesh, state, sampling, host_view(state))


def fixed_chunk(target, drafter, state: DecodeState, sampling: Sampling, *, spec: EngineSpec, rounds: int, mesh=None):
    """Exactly `rounds` rounds (a fixed trip count: on a GPU the call returns before the rounds run, so the host
    dispatches the next chunk and reads this one's view while the device works; rows that stop inside the chunk are
    masked for the rest of it, a no-op), then the state's `host_view`."""
    with traced_on(mesh, target.experts):
        state = jax.lax.fori_loop(0, rounds, lambda i, s: spec_round(target, drafter, s, sampling, spec=spec), state)
    return _on_mesh(mesh, state, host_view(state))


def ending_chunk(target, drafter, state: DecodeState, sampling: Sampling, max_rounds, *, spec: EngineSpec,
                 mesh=None):
    """Rounds until every row is done, at most `max_rounds` (i32, runtime data; the loop reads its condition back
    every round, so the call returns when the chunk ends), then the state's `host_view`."""
    with traced_on(mesh, target.experts):
        state = decode_loop(target, drafter, state, sampling, max_rounds, spec=spec)[0]
    return _on_mesh(mesh, state, host_view(state))


register_program("admit", admit_viewed, static_argnames=("spec", "capacity", "cache_dtype", "packed_len", "mesh"),
                 donate_argnames=("state", "sampling"))
register_program("chunk", fixed_chunk, static_argnames=("spec", "rounds", "mesh"), donate_argnames=("state",))
register_program("chunk_ending", ending_chunk, static_argnames=("spec", "mesh"), donate_argnames=("state",))


@dataclasses.dataclass
class _Request:
    id: int
    prompt: np.ndarray  # [L] i32
    params: RequestParams
    stops: np.ndarray  # [STOP_WIDTH] i32, -1 padded
    t_submit: float
    t_admit: Optional[float] = None
    t_first: Optional[float] = None
    slot: Optional[int] = None
    seq: int = -1  # sequence number of its admission's view (views before it do not hold its row)
    sent: int = 0  # tokens already handed out in events


def acceptance_stats(num_drafts: int, accepted: int, accepted_at, tested_at=None) -> dict:
    """num_drafts (rounds that verified >= 1 draft), num_accepted_tokens, mean_acceptance_length (1 + accepted /
    num_drafts, as vLLM), acceptance_rates [K] (the share of drafting rounds whose draft i was accepted),
    accepted_per_position (accepted_at [K]: rounds whose draft i was accepted) and tested_per_position [K] (rounds
    that verified draft i with drafts 0..i-1 accepted). A fixed K (tested_at None): every drafting round verifies
    K drafts, so tested = (num_drafts, accepted_at[0], .., accepted_at[K-2]) and the rates are accepted_at /
    num_drafts (vLLM's). A budget that varies (tested_at given): the rates are the products of the conditional
    rates accepted_at[j] / tested_at[j], j <= i (vLLM's numbers for a fixed K, and unbiased by rounds that drafted
    fewer than i + 1 tokens)."""
    acc = [int(x) for x in accepted_at]
    if tested_at is None:
        tested = [num_drafts] + acc[:-1]
        rates = [float(x) / num_drafts if num_drafts else 0.0 for x in acc]
    else:
        tested = [int(x) for x in tested_at]
        rates = np.cumprod([a / t if t else 0.0 for a, t in zip(acc, tested)]).tolist()
    return {"num_drafts": num_drafts, "num_accepted_tokens": accepted,
            "mean_acceptance_length": 1.0 + accepted / num_drafts if num_drafts else 1.0,
            "acceptance_rates": rates, "accepted_per_position": acc, "tested_per_position": tested[:len(acc)]}


def _check_int(v, name: str, low: int):
    if not I.is_int(v) or v < low:
        raise ValueError(f"EngineConfig.{name} must be an integer >= {low}, got {v!r}")
    return int(v)


def mesh_config(c: EngineConfig, mesh) -> EngineConfig:
    """The config under `mesh` (checked: a mesh with axes "data" and "model"), as it is: the programs trace under
    the mesh and the kernels run per shard (`pjax.models.per_shard`)."""
    if not isinstance(mesh, jax.sharding.Mesh) or set(mesh.axis_names) != {SH.DATA_AXIS, SH.MODEL_AXIS}:
        raise TypeError(f"mesh must be a jax.sharding.Mesh with axes {SH.DATA_AXIS!r} and {SH.MODEL_AXIS!r} "
                        f"(pjax.models.make_mesh), got {mesh!r}")
    return c


def _placed(model, mesh, place):
    """`model` on `mesh` by `place`, unless every leaf already lies on it (as a mesh-aware loader placed it)."""
    if mesh is None or model is None:
        return model
    on = lambda x: isinstance(getattr(x, "sharding", None), NamedSharding) and x.sharding.mesh == mesh  # noqa
    return model if all(on(x) for x in jax.tree.leaves(model)) else place(model, mesh)


class Engine:
    """Continuous batching over `max_slots` device rows: `submit` requests, call `step` while `has_work`, read the
    `Event`s. Not thread-safe: one thread calls submit / cancel / step.

    target / drafter: as `pjax.generate` (drafter None for drafting "none"). compile_s: compilation seconds so far.
    mesh: None (one device), or a `jax.sharding.Mesh` with axes "data" and "model" (`pjax.models.make_mesh`): the
    target's weights are split over "model" (`pjax.models.sharding`; a target already placed on the mesh, e.g. by
    `load_target(..., mesh=)`, is kept as placed), the drafter replicated, the slots' rows split over "data" (which
    must divide max_slots, rounded up to a power of two) and the KV caches by KV heads over "model". Under a mesh of
    several devices the kernels run per shard (`pjax.models.per_shard`), chosen by `implementation` as on one device.
    num_speculative_tokens "auto": `budgets` are the candidate K (0 .. K_max; with tree_budget "auto" also trees,
    `pjax.decode.budget.TreeBudget`), each chunk runs the one `chooser` (a `pjax.decode.budget.BudgetChooser`; given
    one, e.g. a scripted one in a test, it is used as it is, and its budgets, some of the candidates, are the ones
    compiled) picks; their round times are measured once before the first admission (`precompile`, or the first
    `step`). `budget`: the budget of the last chunk dispatched; `budget_stats()`: the chooser's view.
    """

    def __init__(self, target, drafter, config: EngineConfig = EngineConfig(), *, acceptance=None, mesh=None,
                 chooser=None):
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be a pjax.decode.EngineConfig, got {type(config).__name__}")
        c = config
        slots = _check_int(c.max_slots, "max_slots", 1)
        if mesh is not None:
            c = mesh_config(c, mesh)
            slots = max(slots, SH.axis_size(mesh, SH.DATA_AXIS))
        if c.max_len is None:
            mpe = getattr(getattr(target, "config", None), "max_position_embeddings", None)
            self.max_len = min(DEFAULT_MAX_LEN, mpe) if mpe else DEFAULT_MAX_LEN
        else:
            self.max_len = _check_int(c.max_len, "max_len", 2)
        self.rounds_per_step = _check_int(c.rounds_per_step, "rounds_per_step", 1)
        self.prefill = I.check_prefill(c.prefill, "EngineConfig.prefill")
        if c.compiler_options is not None and not isinstance(c.compiler_options, dict):
            raise TypeError(f"EngineConfig.compiler_options must be a dict or None, got "
                            f"{type(c.compiler_options).__name__}")
        spec = make_spec(target, drafter, c, max_new_tokens=self.max_len, acceptance=acceptance)
        auto = spec.state_k is not None
        if chooser is not None and not auto:
            raise ValueError("chooser: only an engine with num_speculative_tokens='auto' chooses budgets")
        self.budgets = candidates(spec.state_k) if auto else (spec.k,)
        if spec.state_tree is not None:
            self.budgets += tree_candidates(spec.k, spec.state_tree)
        if chooser is not None:
            extra = [label(k) for k in chooser.budgets if k not in self.budgets]
            if extra:
                raise ValueError(f"chooser: budgets {extra} are not among the engine's candidates "
                                 f"{[label(k) for k in self.budgets]}")
            self.budgets = chooser.budgets
        self.mesh = mesh
        self._target = _placed(consistent_target(target), mesh, SH.place_target)
        self._drafter = _placed(consistent_drafter(drafter), mesh, SH.place_drafter) if spec.drafting.speculative \
            else None
        self.warnings = [] if self._drafter is None else pair_warnings(self._target.config, self._drafter.config)
        mpe = self._target.config.max_position_embeddings
        if mpe and self.max_len > mpe:
            self.warnings.append(f"max_len={self.max_len} is beyond the target's max_position_embeddings={mpe} "
                                 "(fine only if its RoPE scaling covers it)")
        for w in self.warnings:
            warnings.warn(w, stacklevel=2)
        self.config, self.spec, self.max_slots, self.max_running = c, spec, I.bucket_batch(slots), slots
        data = SH.axis_size(mesh, SH.DATA_AXIS)
        if self.max_slots % data:
            raise ValueError(f"EngineConfig.max_slots: the mesh's {data} data-parallel rows must divide the "
                             f"{self.max_slots} slots")
        admit_rows = self.max_slots if c.max_admit_rows is None else _check_int(c.max_admit_rows, "max_admit_rows", 1)
        self.max_admit_rows = min(I.bucket_batch(admit_rows), self.max_slots)
        self._cache_dtype = None if c.cache_dtype is None else parse_dtype(c.cache_dtype, what="cache_dtype")
        self._options = tuple(sorted((c.compiler_options or {}).items()))
        self._precision = matmul_precision(self._target, self._drafter, c.allow_tf32)
        self._vocab = self._target.config.vocab_size
        self._state, self._sampling = self._empty()
        self._host: Optional[dict] = None  # host copy of the rows' outputs and counters (the last view read)
        self._host_seq = -1  # sequence number of the view self._host came from
        self._views: list[tuple[int, object]] = []  # (sequence number, device view) dispatched, not read yet
        self._seq = itertools.count()  # sequence numbers of the device programs that return a view
        self._queue: dict[int, _Request] = {}  # FIFO (insertion order)
        self._slots: dict[int, _Request] = {}  # slot -> running request
        self._ended: list[tuple[_Request, Optional[dict], float]] = []  # cancelled (row, when), reported next step
        self._admitted_last = False  # the previous step admitted (the next one runs a chunk)
        self._ids = itertools.count()
        self._admit_exe: dict[tuple[int, int, Optional[int]], object] = {}
        self._chunk_exe: dict[tuple, object] = {}  # (fixed, budget, sampling mode) -> program
        self._round_specs = {k: dataclasses.replace(spec, num_speculative_tokens=spec.k, tree_budget=k.nodes)
                             if isinstance(k, TreeBudget) else dataclasses.replace(spec, num_speculative_tokens=k)
                             for k in self.budgets}
        self.chooser = (chooser or BudgetChooser(self.budgets)) if auto else None
        self.budget = spec.k
        self._timed = not auto  # the budgets' round times are measured (before the first admission)
        self._host_fields = _HOST_FIELDS + (("tested_at",) if auto else ())
        self._dispatched: dict[int, tuple] = {}  # view seq -> (a chunk's budget or None, rounds if fixed-trip else 0)
        self._last_end: Optional[tuple[int, float]] = None  # (view seq, when its blocking read returned)
        self._owner = np.full(self.max_slots, -1)  # request whose counters the last view read held, by slot
        self._seen = None  # those counters (accepted_at, tested_at [B, K_max], accepted, rounds [B])
        self.compile_s = 0.0
        self.chunks = 0  # device chunks run so far
        self._final_rounds = 4 * self.rounds_per_step  # rounds of the next final chunk (sized by the last one)
        self._compile_lock = threading.Lock()  # precompile's threads add to compile_s

    # -- device state ------------------------------------------------------------------------------------------
    def _blank_sampling(self, b: int) -> dict:
        """Host arrays of b rows of neutral sampling (greedy, no filters, no stop ids, max_new 1)."""
        return dict(temperature=np.zeros(b, np.float32), top_k=np.zeros(b, np.int32), top_p=np.ones(b, np.float32),
                    seed=np.zeros(b, np.uint32), eos=np.full((b, STOP_WIDTH), -1, np.int32),
                    max_new=np.ones(b, np.int32))

    def _empty(self) -> tuple[DecodeState, Sampling]:
        """Every slot free: zeros shaped like a prefill of max_slots rows (no model runs), done everywhere (with a
        stop code: a round recomputes `done` from `stop` for every row)."""
        b = self.max_slots
        sampling = Sampling(**{k: jnp.asarray(v) for k, v in self._blank_sampling(b).items()})
        fn = functools.partial(prefill, spec=self.spec, capacity=self.max_len, cache_dtype=self._cache_dtype)
        shapes = jax.eval_shape(fn, self._target, self._drafter, jax.ShapeDtypeStruct((b, 1), jnp.int32),
                                jax.ShapeDtypeStruct((b,), jnp.int32), sampling)
        def empty():
            state = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
            return dataclasses.replace(state, done=jnp.ones((b,), bool), stop=jnp.full((b,), STOP_HOST, jnp.int32))
        if self.mesh is None:
            return empty(), sampling
        state = jax.jit(empty, out_shardings=state_shardings(shapes, self.mesh))()  # built in place on every device
        return state, jax.device_put(sampling, state_shardings(sampling, self.mesh))

    def _admission_args(self, reqs: Sequence[_Request], slots: Sequence[int], rows: int, lp: int):
        prompts = np.zeros((rows, lp), np.int32)
        lengths = np.ones((rows,), np.int32)
        where = np.full((rows,), self.max_slots, np.int32)
        s = self._blank_sampling(rows)
        for i, (r, slot) in enumerate(zip(reqs, slots)):
            p = r.params
            prompts[i, :len(r.prompt)] = r.prompt
            lengths[i], where[i] = len(r.prompt), slot
            s["temperature"][i], s["top_k"][i], s["top_p"][i] = p.temperature, p.top_k, p.top_p
            s["seed"][i], s["eos"][i], s["max_new"][i] = p.seed, r.stops, p.max_new_tokens
        put = jnp.asarray if self.mesh is None else functools.partial(jax.device_put,
                                                                       device=NamedSharding(self.mesh, P()))
        new = Sampling(**{k: put(v) for k, v in s.items()})
        return (self._target, self._drafter, self._state, self._sampling, put(prompts), put(lengths), new, put(where))

    def _buckets(self, n: int, longest: int) -> tuple[int, int]:
        """(rows, prompt positions) of the admission program for n requests whose longest prompt has `longest`."""
        return I.prefill_buckets([longest] * n, self.max_len, "padded")[:2]

    def _packed_options(self, rows: int, lp: int) -> list[Optional[int]]:
        """The layouts (`inputs.packed_length`: a packed row length, or None for padded) that an admission into the
        (rows, lp) buckets can take: its prompts (padding rows: one token each) hold from (the bucket's shortest
        longest prompt) + rows - 1 to rows * lp tokens, and each power of two in between is a bucket."""
        half = I.next_pow2(lp) // 2
        lo, hi = (half + 1 if half >= I.MIN_PROMPT_BUCKET else 1) + rows - 1, rows * lp
        totals = {lo, hi} | {1 << e for e in range(lo.bit_length(), hi.bit_length()) if lo < 1 << e < hi}
        return sorted({I.packed_length(t, rows, lp, self.prefill) for t in totals}, key=lambda x: x or 0)

    def _admit_program(self, rows: int, lp: int, packed_len: Optional[int], args):
        key = (rows, lp, packed_len)
        exe = self._admit_exe.get(key)
        if exe is None:
            # the first token's top-k / top-p truncation always runs (a vocabulary sort per row of the bucket, and per
            # first-draft position with draft_sampling="sample"; exact for rows without filters): no branch, which
            # would stop the host until the prefill is done
            spec = dataclasses.replace(self.spec, sampling="filtered")
            exe, c = compiled("admit", args, dict(spec=spec, capacity=self.max_len, cache_dtype=self._cache_dtype,
                                                  packed_len=packed_len, mesh=self.mesh), self._options,
                              self._precision)
            with self._compile_lock:
                self.compile_s += c
                self._admit_exe[key] = exe
        return exe

    def _chunk_args(self, fixed: bool, rounds: int = 0):
        args = (self._target, self._drafter, self._state, self._sampling)
        return args if fixed else args + (np.int32(rounds),)

    def _chunk_program(self, fixed: bool, k: Optional[int] = None, sampling: Optional[str] = None):
        """The chunk program of budget k (None: the engine's K): a fixed trip count of rounds_per_step rounds
        (pipelined), or ending early; sampling: its rounds' `EngineSpec.sampling` (None: what the running requests
        need, `_needs`)."""
        k = self.spec.k if k is None else k
        mode = self._mode(k, self._needs() if sampling is None else sampling)
        exe = self._chunk_exe.get((fixed, k, mode))
        if exe is None:
            spec = dataclasses.replace(self._round_specs[k], sampling=mode)
            name, statics = ("chunk", dict(spec=spec, rounds=self.rounds_per_step, mesh=self.mesh)) if fixed \
                else ("chunk_ending", dict(spec=spec, mesh=self.mesh))
            exe, c = compiled(name, self._chunk_args(fixed), statics, self._options, self._precision)
            with self._compile_lock:
                self.compile_s += c
                self._chunk_exe[(fixed, k, mode)] = exe
        return exe

    def _needs(self, requests=None) -> str:
        """The sampling mode `requests` (default: the running ones) need (`sampling_need`). The host picks each chunk's
        program by it: a branch on it inside the round would stop the host in every round on a GPU (XLA reads a
        conditional's predicate back before it runs a branch), so a chunk could not be queued ahead of the device."""
        requests = self._slots.values() if requests is None else requests
        return sampling_need((r.params.temperature, r.params.top_k, r.params.top_p) for r in requests)

    def _mode(self, k, mode: str) -> str:
        """`mode` as budget k's rounds compile it: a chain round takes greedy rows without a branch ("sampled")."""
        return "sampled" if mode == "greedy" and self._round_specs[k].tree_budget is None else mode

    def _time_budgets(self, mode: str, chunks: int = 4):
        """Seconds per round of every budget's fixed-trip chunk in sampling `mode`, run on the empty state (a round
        computes every slot whatever the occupancy, so this is its cost at max_slots; attention over longer contexts
        costs more, which the chooser learns from the chunks it sees): after one untimed chunk, `chunks` chunks
        dispatched back to back, as the pipelined steps run them, from the first one's dispatch to the last one's
        end. The slots hold distinct random tokens while timed (a MoE layer reads the experts its tokens choose:
        slots of one token would choose the same few at any K), the empty state's zeros again after."""
        rng = np.random.default_rng(0)
        random = lambda x: rng.integers(0, self._vocab, x.shape, np.int32)  # noqa: E731
        self._state = self._with_tokens(random)
        times = {}
        for k in self.budgets:
            exe = self._chunk_program(True, k, mode)
            self._state, view = exe(*self._chunk_args(True))
            jax.block_until_ready(view)
            t0 = time.perf_counter()
            for _ in range(chunks):
                self._state, view = exe(*self._chunk_args(True))
            jax.block_until_ready(view)
            times[k] = (time.perf_counter() - t0) / (chunks * self.rounds_per_step)
        self.chooser.set_warm_times(times)
        self._state = self._with_tokens(lambda x: np.zeros(x.shape, np.int32))
        self._timed = True

    def _with_tokens(self, values) -> DecodeState:
        """The state with every slot's tokens (last, drafts, tree nodes) replaced by values(array) (host arrays placed
        as the state's)."""
        s = self._state
        put = lambda x: jax.device_put(values(x), x.sharding)  # noqa: E731
        tree = None if s.tree is None else dataclasses.replace(s.tree, tokens=put(s.tree.tokens))
        return dataclasses.replace(s, last=put(s.last), drafts=put(s.drafts), tree=tree)

    def budget_stats(self) -> dict:
        """budget (the K of the last chunk), budgets (the candidates), chunks_by_budget {K: chunks run}; with "auto"
        also alpha [K_max] (the conditional acceptance per draft position as estimated now) and round_seconds {K:
        t(K)} (`pjax.decode.budget`). A tree budget is named "tree N" (`pjax.decode.budget.label`)."""
        out = {"budget": label(self.budget), "budgets": [label(k) for k in self.budgets]}
        if self.chooser is None:
            return {**out, "chunks_by_budget": {self.spec.k: self.chunks}}
        return {**out, "chunks_by_budget": {label(k): self.chooser.chunks[k] for k in self.budgets
                                            if self.chooser.chunks[k]},
                "alpha": [round(float(a), 4) for a in self.chooser.alpha],
                "round_seconds": {label(k): self.chooser.round_seconds(k) for k in self.budgets}}

    def precompile(self, rows: Sequence[int], prompt_lengths: Sequence[int], *, warm: bool = False,
                   sampling: Sequence[str] = SAMPLING_MODES) -> float:
        """Compile the chunk programs and the admission programs of every admission in the buckets of n in `rows`
        requests whose longest prompt has a length in `prompt_lengths` (with a packing `prefill`, every packed row
        such an admission can take); returns the compile seconds this took (summed over programs, which compile in
        parallel threads). warm: also run each once (admissions of padding rows only and, when nothing runs, a chunk
        of no rounds: no slot changes), so that a timed first use pays no first-run costs. sampling: the chunk
        programs of these sampling modes (`_needs`: "greedy", "sampled", "filtered"; another compiles on first
        use)."""
        keys = []
        for n, length in itertools.product(sorted(set(rows)), sorted(set(prompt_lengths))):
            if not 1 <= n <= self.max_slots or not 1 <= length <= self.max_len:
                raise ValueError(f"precompile: {n} rows of {length} tokens do not fit {self.max_slots} slots of "
                                 f"{self.max_len} positions")
            for group in {min(n, self.max_admit_rows), n % self.max_admit_rows} - {0}:
                b, lp = self._buckets(group, length)
                keys += [(b, lp, packed_len) for packed_len in self._packed_options(b, lp)]
        return self._precompile(keys, warm, sampling=sampling)

    def precompile_admissions(self, admissions: Iterable[Sequence[int]], *, warm: bool = False,
                              max_new_tokens: Optional[int] = None, pipelined: bool = True,
                              sampling: Sequence[str] = ("greedy", "sampled")) -> float:
        """`precompile` for given admissions, each the prompt lengths of its requests (in queue order): the chunk
        programs and exactly the admission programs these admissions run, one per group of max_admit_rows
        (`precompile` builds every program of their buckets). max_new_tokens: the most tokens any of these requests
        may emit, if known: requests too short to outlive a chunk never run the fixed-trip chunk, which is then not
        built (it would still compile on first use); nor is it with pipelined=False (only final steps will run).
        sampling: the sampling modes whose chunk programs to build (`precompile`; by default not "filtered")."""
        keys = []
        for lengths in admissions:
            if not 1 <= len(lengths) <= self.max_slots or not all(1 <= n <= self.max_len for n in lengths):
                raise ValueError(f"precompile_admissions: prompts of {list(lengths)} tokens do not fit "
                                 f"{self.max_slots} slots of {self.max_len} positions")
            a = self.max_admit_rows
            keys += [I.prefill_buckets(lengths[i:i + a], self.max_len, self.prefill)
                     for i in range(0, len(lengths), a)]
        fixed = pipelined and (max_new_tokens is None or max_new_tokens > self.rounds_per_step * (self.spec.k + 1)) \
            or not self._timed  # (an "auto" engine times its budgets' fixed-trip chunks)
        return self._precompile(keys, warm, fixed, sampling)

    def _precompile(self, keys: Sequence[tuple[int, int, Optional[int]]], warm: bool, fixed: bool = True,
                    sampling: Sequence[str] = SAMPLING_MODES) -> float:
        """The chunk programs (the fixed-trip one if `fixed`) of the `sampling` modes and the admission programs of
        `keys` ((rows, lp, packed_len) buckets), compiled in threads, then (warm) each run once in order."""
        sampling = (sampling,) if isinstance(sampling, str) else tuple(sampling)
        if not sampling:
            raise ValueError(f"precompile: sampling needs one of {SAMPLING_MODES} at least")
        for mode in sampling:
            if mode not in SAMPLING_MODES:
                raise ValueError(f"precompile: sampling modes are {SAMPLING_MODES}, got {mode!r}")
        before = self.compile_s
        keys = list(dict.fromkeys(keys))
        chunks = list(dict.fromkeys((f, k, self._mode(k, m)) for f in ((True, False) if fixed else (False,))
                                    for k in self.budgets for m in sampling))
        jobs = [lambda chunk=chunk: self._chunk_program(*chunk) for chunk in chunks]
        jobs += [lambda key=key: self._admit_program(*key, self._admission_args([], [], *key[:2]))
                 for key in keys if key not in self._admit_exe]
        with ThreadPoolExecutor(max_workers=min(len(jobs), COMPILE_THREADS)) as pool:
            list(pool.map(lambda job: job(), jobs))
        if not self._timed and not self._slots:  # in the mode most requests of the precompiled ones run
            self._time_budgets("sampled" if "sampled" in sampling else sampling[0])
        for f, k, m in chunks if warm and not self._slots else ():
            self._state = self._chunk_program(f, k, m)(*self._chunk_args(f, 1))[0]
        for key in keys if warm else ():
            args = self._admission_args([], [], *key[:2])
            self._state, self._sampling = self._admit_program(*key, args)(*args)[:2]
        jax.block_until_ready((self._state, self._sampling))
        return self.compile_s - before

    # -- requests ----------------------------------------------------------------------------------------------
    def submit(self, prompt: Sequence[int], params: RequestParams, *, stop_at_capacity: bool = False) -> int:
        """Queue a request (prompt: token ids); returns its id. Every bad value is a ValueError (TypeError for a
        wrong type) naming the field. stop_at_capacity: accept a request whose prompt + max_new_tokens + slack
        exceed max_len (its prompt must fit): it stops with reason "capacity" when its cache fills."""
        if not isinstance(params, RequestParams):
            raise TypeError(f"params must be a pjax.serve.RequestParams, got {type(params).__name__}")
        if isinstance(prompt, (str, bytes)):
            raise TypeError("prompt is text; it must be token ids (tokenize it first, e.g. with pjax.text)")
        p = np.asarray(prompt)
        if p.ndim != 1 or p.size == 0:
            raise ValueError(f"prompt must be a non-empty 1-D sequence of token ids (got shape {p.shape})")
        if not np.issubdtype(p.dtype, np.integer):
            raise ValueError(f"prompt must hold integer token ids (got {p.dtype})")
        if p.min() < 0 or p.max() >= self._vocab:
            raise ValueError(f"prompt has token ids outside the vocabulary [0, {self._vocab})")
        one = lambda v, name, **kw: I.per_row(v, 1, name, default=None, **kw)[0]  # noqa: E731
        max_new = int(one(params.max_new_tokens, "max_new_tokens", kind="int", low=1))
        temperature, top_k, top_p, seed = (v[0].item() for v in I.check_sampling(
            1, params.temperature, params.top_k, params.top_p, params.seed, defaults=(None,) * 4))
        stops = params.stop_token_ids
        if not isinstance(stops, (list, tuple, np.ndarray)):
            raise TypeError(f"stop_token_ids must be a tuple of token ids, got {stops!r}")
        for t in stops:
            if not I.is_int(t):
                raise TypeError(f"stop_token_ids: {t!r} is not an integer token id")
            if not 0 <= t < self._vocab:
                raise ValueError(f"stop_token_ids: {t} is outside the vocabulary [0, {self._vocab})")
        if len(stops) > STOP_WIDTH:
            raise ValueError(f"stop_token_ids: {len(stops)} ids, more than the engine's {STOP_WIDTH}")
        slack = self.slack
        if stop_at_capacity and p.size > self.max_len:
            raise ValueError(f"prompt has {p.size} tokens, longer than max_len={self.max_len}")
        if not stop_at_capacity and p.size + max_new + slack > self.max_len:
            raise ValueError(f"prompt ({p.size} tokens) + max_new_tokens ({max_new}) + drafting slack ({slack}) = "
                             f"{p.size + max_new + slack} positions exceed max_len={self.max_len}")
        params = RequestParams(max_new, temperature, top_k, top_p, seed, tuple(int(t) for t in stops))
        rid = next(self._ids)
        self._queue[rid] = _Request(rid, p.astype(np.int32), params,
                                    I.stop_table(list(params.stop_token_ids), 1, self._vocab, STOP_WIDTH)[0],
                                    time.perf_counter())
        return rid

    def cancel(self, request_id: int, *, keep: Optional[int] = None) -> None:
        """End a request before the next chunk; the next `step` reports it finished (stop reason "stop"). keep: cut
        its output to its first `keep` tokens (e.g. where a stop string ends). A queued request is dropped (finished
        with no tokens); an unknown or finished id is a no-op. Its e2e time ends here, not when the step reports it."""
        if keep is not None and (not I.is_int(keep) or keep < 0):
            raise ValueError(f"keep must be an integer >= 0, got {keep!r}")
        t_end = time.perf_counter()  # the request ends now: its times do not count the next step's device work
        req = self._queue.pop(request_id, None)
        if req is not None:
            self._ended.append((req, None, t_end))
            return
        slot = next((s for s, r in self._slots.items() if r.id == request_id), None)
        if slot is None:
            return
        req = self._slots.pop(slot)
        s = self._state
        self._state = dataclasses.replace(s, done=s.done.at[slot].set(True), stop=s.stop.at[slot].set(STOP_HOST))
        if req.seq > self._host_seq:  # admitted after the last view read: nothing of it was read, none is reported
            self._ended.append((req, None, t_end))
            return
        row = {k: np.array(self._host[k][slot]) for k in self._host_fields}  # (the device may be a chunk ahead)
        if keep is not None:
            row["num_out"] = np.minimum(row["num_out"], keep)
        row["done"], row["stop"] = np.True_, np.int32(STOP_HOST)
        self._ended.append((req, row, t_end))

    @property
    def slack(self) -> int:
        """Positions a request keeps free beyond prompt + max_new_tokens: a last round's drafts and their
        verification may write past the final token (`pjax.decode.state.drafting_slack`)."""
        return self.spec.slack

    def admission_shapes(self, longest_prompt: int) -> list[tuple[int, int]]:
        """(requests, prompt length) pairs, one per admission program that requests of up to `longest_prompt` tokens
        can need (each rows bucket x each prompt-length bucket, the bucket's longest length): `precompile` them all
        and no admission compiles while serving."""
        if not I.is_int(longest_prompt) or not 1 <= longest_prompt <= self.max_len:
            raise ValueError(f"longest_prompt must be an integer in [1, {self.max_len}], got {longest_prompt!r}")
        rows = sorted({I.bucket_batch(n) for n in range(1, self.max_admit_rows + 1)})
        lengths = sorted({min(I.bucket_length(n), longest_prompt) for n in range(1, longest_prompt + 1)})
        return [(n, length) for n in rows for length in lengths]

    @property
    def has_work(self) -> bool:
        """Queued or running requests, or cancelled ones the next step still reports."""
        return bool(self._queue or self._slots or self._ended)

    @property
    def num_running(self) -> int:
        return len(self._slots)

    @property
    def num_waiting(self) -> int:
        return len(self._queue)

    # -- the step ------------------------------------------------------------------------------------------------
    def _admit(self, now: float) -> list[_Request]:
        """Queued requests into free slots, oldest first: one admission program per group of max_admit_rows (their
        calls queue on the device one after the other; the step reads the result once)."""
        free = [s for s in range(self.max_slots) if s not in self._slots][:self.max_running - len(self._slots)]
        reqs = list(itertools.islice(self._queue.values(), len(free)))
        a = self.max_admit_rows
        for i in range(0, len(reqs), a):
            group, slots = reqs[i:i + a], free[i:i + a]
            rows, lp, packed_len = I.prefill_buckets([len(r.prompt) for r in group], self.max_len, self.prefill)
            args = self._admission_args(group, slots, rows, lp)
            self._state, self._sampling, view = self._admit_program(rows, lp, packed_len, args)(*args)
            seq = self._push(view, None, 0)
            for r, slot in zip(group, slots):
                del self._queue[r.id]
                r.slot, r.t_admit, r.seq = slot, now, seq
                self._slots[slot] = r
        return reqs

    def _push(self, view, k, rounds: int) -> int:
        """Queue a dispatched program's view for reading (its copy to the host starts when the program ends); k: a
        chunk's budget (None: an admission), rounds: a fixed-trip chunk's rounds (0 otherwise)."""
        seq = next(self._seq)
        view.copy_to_host_async()
        self._views.append((seq, view))
        if self.chooser is not None:
            self._dispatched[seq] = (k, rounds)
        return seq

    def _read(self, upto: int):
        """Read the newest view dispatched up to index `upto` of the queue (one transfer; it waits for its program);
        the older ones are dropped (a later view holds everything an earlier one does)."""
        i = upto % len(self._views)
        seq, view = self._views[i]
        del self._views[:i + 1]
        waited = self.chooser is not None and not view.is_ready()
        self._host = unpack_view(np.array(view), self.spec.out_len, self.chooser is not None)
        if self.chooser is not None:
            self._observe(seq, waited, time.perf_counter())
        self._host_seq = seq

    def _observe(self, seq: int, waited: bool, now: float):
        """Feed the chooser what view `seq` (just read) tells of the chunks since the previous view read: the drafts
        tested and accepted (per slot: the counters' growth, or all of them for a request admitted since) where
        they were all chains, their tokens per row and round where they were all one tree budget, and, for a
        fixed-trip chunk whose read waited for it and whose program before it was read the same way, its seconds
        per round: the time between the two reads' returns (its share of the pipeline, the host's part included
        where the host is slower than the device, as in the warm-up timing)."""
        k, rounds = self._dispatched[seq]
        ran = set()
        for s in [s for s in self._dispatched if s <= seq]:
            ran.add(self._dispatched.pop(s)[0])
        ran.discard(None)
        if waited and rounds and self._last_end is not None and self._last_end[0] == seq - 1:
            self.chooser.observe_time(k, (now - self._last_end[1]) / rounds)
        self._last_end = (seq, now) if waited else None
        owner = self._owner.copy()
        for slot, r in self._slots.items():
            if r.seq <= seq:
                owner[slot] = r.id
        h = self._host
        counters = (h["accepted_at"], h["tested_at"], h["accepted"], h["rounds"])
        if self._seen is None:
            self._seen = tuple(np.zeros_like(c) for c in counters)
        same = owner == self._owner
        grown = [np.where(same.reshape((-1,) + (1,) * (c.ndim - 1)), c - seen, c).sum(axis=0)
                 for c, seen in zip(counters, self._seen)]
        trees = {b for b in ran if isinstance(b, TreeBudget)}
        if not trees:
            self.chooser.observe_acceptance(grown[0], grown[1])
        elif len(ran) == 1 and grown[3] > 0:
            self.chooser.observe_tokens(trees.pop(), 1.0 + grown[2] / grown[3])
        self._owner, self._seen = owner, tuple(c.copy() for c in counters)

    def _can_pipeline(self) -> bool:
        """Whether a fixed-trip chunk may be dispatched before the host reads the chunk in flight: some running
        request surely outlives both (its tokens still allowed, by its max_new_tokens and its cache, exceed what the
        chunks can emit), so the chunk computes no rounds for nothing unless rows end early (EOS, host stops)."""
        in_flight = 1 + sum(1 for seq, _ in self._views if seq > self._host_seq)
        most = in_flight * self.rounds_per_step * (self.spec.k + 1)
        h = self._host
        for slot, r in self._slots.items():
            out = int(h["num_out"][slot]) if h is not None and r.seq <= self._host_seq else 0
            left = min(r.params.max_new_tokens, self.max_len - len(r.prompt)) - out
            if left > most:
                return True
        return False

    def _dispatch(self, fixed: bool, final: bool):
        """Queue one chunk of rounds on the device (fixed trip count, or ending early: every round left when
        `final`, rows' limits ending it sooner) and its view."""
        rounds = self._final_rounds if final else self.rounds_per_step
        if self.chooser is not None:
            self.budget = self.chooser.choose()
        self._state, view = self._chunk_program(fixed, self.budget)(*self._chunk_args(fixed, rounds))
        self.chunks += 1
        self._push(view, self.budget, self.rounds_per_step if fixed else 0)

    def step(self, *, final: bool = False) -> list[Event]:
        """One step of device work, then this step's events: one per request with new tokens or that finished
        (cancelled ones first, then by request id).

        The device work: an admission of queued requests into free slots (one batched prefill), then one chunk of
        rounds_per_step rounds if anything runs. While some running request surely outlives two chunks, the chunk
        has a fixed trip count and is dispatched before the host reads the previous chunk's outputs, and a step
        reports what the device finished one chunk earlier (an admission's first tokens right away). Otherwise the
        step waits for its own chunk, which ends once every row is done (a step that admits then runs no chunk: its
        first tokens come back at once). final: no request will be submitted before the running ones finish (a
        static batch): the step waits for its own chunk, of about FINAL_CHUNK_S of device time."""
        if not self._timed and not self._slots:  # in the mode the queued requests need
            self._time_budgets(self._needs(self._queue.values()))
        t0 = time.perf_counter()
        starved = self._admitted_last and self._slots  # a step after an admission runs a chunk
        admitted = self._admit(t0) if self._queue and len(self._slots) < self.max_running and not starved else []
        self._admitted_last = bool(admitted)
        pipelined = bool(self._slots) and not final and self._can_pipeline()
        sized = final and self._slots and not admitted and self._host is not None
        before = (time.perf_counter(), self._host["rounds"]) if sized else None
        if self._slots and (pipelined or not admitted):
            self._dispatch(pipelined, final)
            if pipelined and len(self._views) == 1:  # nothing older to read: run one more ahead, or wait for this one
                pipelined = self._can_pipeline()
                if pipelined:
                    self._dispatch(True, final)
        if self._views:
            self._read(-2 if pipelined else -1)
        now = time.perf_counter()
        if before is not None:  # the next final chunk: about FINAL_CHUNK_S at this one's rounds per second
            ran = int(np.max(self._host["rounds"] - before[1], initial=0))
            if ran and ran >= self._final_rounds:
                per_round = (now - before[0]) / ran
                self._final_rounds = int(min(self.max_len, max(self.rounds_per_step, FINAL_CHUNK_S / per_round)))
        events = [self._finished(r, row, t_end) for r, row, t_end in self._ended]
        self._ended = []
        h, seen = self._host, self._host_seq if self._host is not None else -1
        for slot, r in sorted(self._slots.items(), key=lambda kv: kv[1].id):
            if r.seq > seen:
                continue  # admitted after the view read: its row is not in it yet
            if r.t_first is None:
                r.t_first = now
            num = int(h["num_out"][slot])
            new = h["out"][slot, r.sent:num].tolist()
            r.sent = num
            if h["done"][slot]:
                self._slots.pop(slot)
                events.append(self._finished(r, {k: h[k][slot] for k in self._host_fields}, now, new))
            elif new:
                events.append(Event(r.id, new, False))
        return events

    def _finished(self, r: _Request, row: Optional[dict], now: float, new: Optional[list[int]] = None) -> Event:
        """The final event of request r, which ended at `now`; row: its slot's host values (None: never admitted)."""
        e2e = now - r.t_submit
        k = self.spec.k
        if row is None:
            stats = {"prompt_tokens": len(r.prompt), "output_tokens": 0, "rounds": 0, "num_draft_tokens": 0,
                     "mean_budget": 0.0, **acceptance_stats(0, 0, [0] * k),
                     "queue_s": e2e, "ttft_s": None, "e2e_s": e2e, "tpot_s": None}
            return Event(r.id, [], True, STOP_NAMES[STOP_HOST], stats)
        num = int(row["num_out"])
        if new is None:  # cancelled: what the snapshot holds beyond the tokens sent (and within `keep`)
            new = row["out"][r.sent:num].tolist()
        ttft = r.t_first - r.t_submit
        rounds, drafted = int(row["rounds"]), int(row["num_draft_tokens"])
        stats = {"prompt_tokens": len(r.prompt), "output_tokens": num, "rounds": rounds, "num_draft_tokens": drafted,
                 "mean_budget": drafted / rounds if rounds else 0.0,
                 **acceptance_stats(int(row["num_drafts"]), int(row["accepted"]), row["accepted_at"],
                                    row.get("tested_at")),
                 "queue_s": r.t_admit - r.t_submit, "ttft_s": ttft, "e2e_s": e2e,
                 "tpot_s": (e2e - ttft) / (num - 1) if num > 1 else None}
        return Event(r.id, new, True, STOP_NAMES[int(row["stop"])], stats)

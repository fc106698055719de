"""`generate` and `Generation`: the user-facing speculative decoding entry points (host side: validation, shape
buckets, the compilation cache, the device loop in bounded chunks, progress, Ctrl-C, timing and statistics).

The device work is `prefill` + `decode_loop` (pjax.decode.step). A generation runs its rounds in chunks of one
jitted `lax.while_loop` each, sized to about `chunk_seconds` of device time, so a long generation shows progress,
streams, can be stopped per row from the host (stop strings) and answers Ctrl-C within a chunk; `chunk_seconds=None`
runs every round in one device call.
"""
from __future__ import annotations

import dataclasses
import time
import warnings
import weakref
from typing import Any, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from pjax.decode import inputs as I
from pjax.decode.compiled import compile_count, jitted
from pjax.decode.compiled import compiled as _compiled
from pjax.decode.compiled import matmul_precision as _precision
from pjax.decode.step import target_spec
from pjax.decode.state import (DRAFT_SAMPLING, DRAFTING_MODES, STOP_HOST, STOP_INTERRUPTED, STOP_NAMES, EngineSpec,
                               Sampling)
from pjax.dtypes import parse_dtype
from pjax.kernels import IMPLEMENTATIONS
from pjax.models.drafter import Drafter, consistent_drafter, no_parallel_reason
from pjax.models.pairing import check_pair, pair_warnings
from pjax.models.target import Target, consistent_target

__all__ = ["Chunk", "GenerateResult", "Generation", "GenerationInterrupted", "acceptance_stats", "compile_count",
           "generate", "make_spec", "precompile"]


@dataclasses.dataclass
class GenerateResult:
    """tokens: per prompt, the generated ids only (stop token included if hit); stats: see `generate`."""
    tokens: list[list[int]]
    stats: dict[str, Any]


@dataclasses.dataclass
class Chunk:
    """What one device chunk produced: new_tokens[i] = prompt i's tokens since the previous chunk (the first chunk
    holds the token sampled at prefill); done[i] = prompt i has stopped; stop_reasons[i] = why (None if running)."""
    new_tokens: list[list[int]]
    done: list[bool]
    stop_reasons: list[Optional[str]]


class GenerationInterrupted(KeyboardInterrupt):
    """Ctrl-C during a generation: `.result` holds what was generated so far (unfinished rows: "interrupted")."""

    def __init__(self, result: GenerateResult):
        super().__init__("generation interrupted; partial output in .result")
        self.result = result


_jitted = jitted  # the single jitted programs (tests step prefill / round by hand)


# ------------------------------------------------------------------------------------------ settings

def check_engine_pair(target, drafter, k: int, drafting: str) -> tuple[int, ...]:
    """Host-side checks of a (target, drafter) pair for `drafting` with K drafts (`pjax.models.pairing`, plus the
    parallel-drafting needs); returns the aux layer ids the drafter reads."""
    if drafter is None:
        raise ValueError(f"drafting={drafting!r} needs a drafter (pass drafting='none' for plain decoding)")
    if not isinstance(drafter, Drafter):
        raise TypeError(f"drafter must be a pjax Drafter (load one with pjax.load_drafter), got "
                        f"{type(drafter).__name__}")
    dcfg = drafter.config
    aux = check_pair(target.config, dcfg)
    if drafting == "parallel" and k > 1 and no_parallel_reason(dcfg):
        raise ValueError(no_parallel_reason(dcfg) + "; use drafting='sequential'")
    if dcfg.num_depths is not None and drafting == "parallel" and k > dcfg.num_depths:
        warnings.warn(f"num_speculative_tokens={k} exceeds the depth the head was trained for "
                      f"({dcfg.num_depths}); the drafts past it are extrapolated: check their acceptance per position",
                      stacklevel=4)
    return aux


def make_spec(target, drafter, *, max_new_tokens: int, num_speculative_tokens: int, drafting: str,
              draft_sampling: str = "argmax", implementation: str = "auto",
              simulate_acceptance: Optional[Sequence[float]] = None) -> EngineSpec:
    """Validate the settings and the (target, drafter) pair; returns the static EngineSpec."""
    if not isinstance(target, Target):
        raise TypeError(f"target must be a pjax Target (load one with pjax.load_target(path)), got "
                        f"{type(target).__name__}" + (" (a path? use pjax.load_target)" if isinstance(target, str)
                                                        else ""))
    if drafting not in DRAFTING_MODES:
        raise ValueError(f"drafting={drafting!r}: expected one of {DRAFTING_MODES}")
    if draft_sampling not in DRAFT_SAMPLING:
        raise ValueError(f"draft_sampling={draft_sampling!r}: expected one of {DRAFT_SAMPLING}")
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}: expected one of {IMPLEMENTATIONS}")
    if not I.is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1 (got {max_new_tokens!r})")
    aux, mask_id, k = (), 0, 0
    if drafting != "none":
        if not I.is_int(num_speculative_tokens) or num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1 for drafting={drafting!r} "
                             f"(got {num_speculative_tokens!r})")
        k = int(num_speculative_tokens)
        aux = check_engine_pair(target, drafter, k, drafting)
        mask_id = drafter.config.mask_token_id if drafter.config.mask_token_id is not None else 0
    sim = None
    if simulate_acceptance is not None:
        if drafting == "none":
            raise ValueError("simulate_acceptance needs drafting='parallel' or 'sequential'")
        sim = tuple(float(p) for p in simulate_acceptance)
        if len(sim) != k or not all(0.0 <= p <= 1.0 for p in sim):
            raise ValueError(f"simulate_acceptance must give {k} probabilities in [0, 1] (one per draft position), "
                             f"got {list(simulate_acceptance)}")
    return EngineSpec(num_speculative_tokens=k, drafting=drafting, max_new_tokens=int(max_new_tokens),
                      draft_sampling=draft_sampling, aux_layer_ids=tuple(aux), mask_token_id=int(mask_id),
                      implementation=implementation, simulate_acceptance=sim)


# ------------------------------------------------------------------------------------------ the generation

class Generation:
    """A running batch of requests: prefill happens on construction; iterate for `Chunk`s as device chunks
    complete (streaming), end rows from the host with `finish`, and call `result()` for the outputs and statistics.

    Arguments as `generate` (which is `Generation(...).result()`)."""

    def __init__(self, target, drafter, prompts: Sequence[Sequence[int]], *, max_new_tokens, num_speculative_tokens=3,
                 drafting: str = "parallel", temperature=0.0, top_k=None, top_p=None, seed=0, eos_token_id=None,
                 cache_capacity: Optional[int] = None, draft_sampling: str = "argmax",
                 implementation: str = "auto", cache_dtype=None, compiler_options: Optional[dict] = None,
                 chunk_seconds: Optional[float] = 1.0, progress: bool = False, allow_tf32: bool = False,
                 simulate_acceptance: Optional[Sequence[float]] = None, loop: str = "device", prefill: str = "auto",
                 _compile_only: bool = False):
        t_start = time.perf_counter()
        if not isinstance(target, Target):
            raise TypeError(f"target must be a pjax Target (load one with pjax.load_target(path)), got "
                            f"{type(target).__name__}")
        if loop not in ("device", "host"):
            raise ValueError(f"loop={loop!r}: expected 'device' or 'host'")
        I.check_prefill(prefill)
        if chunk_seconds is not None and (not I.is_real(chunk_seconds) or chunk_seconds <= 0):
            raise ValueError(f"chunk_seconds must be a positive number or None (one device call), got "
                             f"{chunk_seconds!r}")
        rows = I.check_prompts(prompts, target.config.vocab_size)
        n = len(rows)
        limits = I.per_row(max_new_tokens, n, "max_new_tokens", kind="int", default=None, low=1)
        spec = make_spec(target, drafter, max_new_tokens=int(limits.max()), num_speculative_tokens=num_speculative_tokens,
                         drafting=drafting, draft_sampling=draft_sampling, implementation=implementation,
                         simulate_acceptance=simulate_acceptance)
        target = consistent_target(target)
        drafter = consistent_drafter(drafter) if spec.drafting != "none" else None
        self._warnings = [] if drafter is None else pair_warnings(target.config, drafter.config)
        vocab = target.config.vocab_size
        temp, tk, tp, seeds = I.check_sampling(n, temperature, top_k, top_p, seed)
        stops = I.stop_table(eos_token_id, n, vocab)
        cdtype = None if cache_dtype is None else parse_dtype(cache_dtype, what="cache_dtype")

        lengths = np.array([len(r) for r in rows], np.int32)
        longest = int(lengths.max())
        k = spec.k
        need = longest + int(limits.max()) + 2 * k
        if cache_capacity is None:
            capacity = I.bucket_capacity(need)
        else:
            if not I.is_int(cache_capacity) or cache_capacity < 1:
                raise ValueError(f"cache_capacity must be a positive integer, got {cache_capacity!r}")
            capacity = int(cache_capacity)
            if longest > capacity:
                i = int(lengths.argmax())
                raise ValueError(f"prompts[{i}] has {longest} tokens, longer than cache_capacity={capacity}")
        mpe = target.config.max_position_embeddings
        if mpe and longest + int(limits.max()) > mpe:
            self._warnings.append(f"prompt + new tokens reach {longest + int(limits.max())} positions, beyond the "
                                  f"target's max_position_embeddings={mpe} (fine only if its RoPE scaling covers it)")
        for w in self._warnings:
            warnings.warn(w, stacklevel=3)

        # buckets: rows, prompt positions (and the packed prefill's row); the output buffer holds `capacity` tokens
        # (no row can emit more), so the row limits are runtime data and programs depend on (rows, prompt bucket,
        # packed bucket, capacity, K) only; padding rows hold a one-token prompt and stop at prefill (max_new = 1)
        b, lp, packed_len = I.prefill_buckets(lengths, capacity, prefill)
        spec = dataclasses.replace(spec, max_new_tokens=capacity)
        padded = np.zeros((b, lp), np.int32)
        for i, r in enumerate(rows):
            padded[i, :len(r)] = r
        all_lengths = np.ones((b,), np.int32)
        all_lengths[:n] = lengths
        fill = lambda a, v: np.concatenate([a, np.full((b - n,), v, a.dtype)])  # noqa: E731
        sampling = Sampling(jnp.asarray(fill(temp, 0.0), jnp.float32), jnp.asarray(fill(tk, 0), jnp.int32),
                            jnp.asarray(fill(tp, 1.0), jnp.float32), jnp.asarray(fill(seeds, 0), jnp.uint32),
                            jnp.asarray(np.concatenate([stops, np.full((b - n, stops.shape[1]), -1, np.int32)])),
                            jnp.asarray(fill(limits, 1), jnp.int32))

        self.n, self.spec, self._capacity, self._target, self._drafter = n, spec, capacity, target, drafter
        self._sampling, self._lengths = sampling, lengths
        self._prefill = ("padded", b * lp) if packed_len is None else ("packed", packed_len)
        self._options = tuple(sorted((compiler_options or {}).items()))
        self._precision = _precision(target, drafter, allow_tf32)
        self._chunk_seconds = None if loop == "host" else chunk_seconds
        self._rounds_per_chunk = 1 if loop == "host" else (None if chunk_seconds is None else 8)
        self._compile_s, self._rounds, self._chunks, self._dispatch_s = 0.0, 0, 0, 0.0
        self._sent = np.zeros(n, np.int64)  # tokens already handed out per row (streaming)
        self._keep: dict[int, int] = {}  # host-side cuts of a row's output (finish(keep=...))
        self._closed = False
        self._bar = None
        if progress:
            from tqdm.auto import tqdm
            self._bar = tqdm(total=int(limits.sum()), desc=f"generate ({spec.drafting})", unit="tok",
                             dynamic_ncols=True)

        # prefill in two programs: the target's (one per rows, prompt and packed bucket for every K and drafting mode
        # with the same target features, so a sweep compiles it once), then the drafter's
        prompts_d, lengths_d = jnp.asarray(padded), jnp.asarray(all_lengths)
        statics = dict(capacity=capacity, cache_dtype=cdtype)
        pre_t = (target, prompts_d, lengths_d, sampling)
        exe, c = _compiled("prefill_target", pre_t, dict(spec=target_spec(spec), packed_len=packed_len, **statics),
                           self._options, self._precision)
        self._compile_s += c
        t0 = time.perf_counter()
        run = _shapes_of if _compile_only else (lambda exe, args: exe(*args))  # compile only: the outputs' shapes
        self._state, aux = run(exe, pre_t)
        c = 0.0
        if spec.drafting != "none":
            pre_d = (drafter, self._state, aux, prompts_d, lengths_d, sampling)
            exe, c = _compiled("prefill_drafter", pre_d, dict(spec=spec, packed_len=packed_len, **statics),
                               self._options, self._precision)
            self._compile_s += c
            self._state = dataclasses.replace(self._state, **run(exe, pre_d))
        del aux
        if not _compile_only:
            self._snapshot()
            self._prefill_s = time.perf_counter() - t0 - c
            self._t_first = time.perf_counter() - t_start - self._compile_s  # time to first token (compile excluded)
        loop_args = (target, drafter, self._state, sampling, jnp.int32(1))
        self._loop, c = _compiled("chunk", loop_args, dict(spec=spec), self._options, self._precision)
        self._compile_s += c
        if _compile_only:
            self.close()
            return
        per_round = _SECONDS_PER_ROUND.get(self._loop)
        if per_round is not None and self._chunk_seconds is not None:
            self._rounds_per_chunk = _chunk_rounds(self._chunk_seconds, per_round)
        self._decode_s = 0.0
        self._first_pending = True

    # -- host view of the device state ------------------------------------------------------------------
    def _snapshot(self):
        s = self._state
        host = jax.device_get(dict(out=s.out, num_out=s.num_out, done=s.done, stop=s.stop, rounds=s.rounds,
                                   num_drafts=s.num_drafts, num_draft_tokens=s.num_draft_tokens, accepted=s.accepted,
                                   accepted_at=s.accepted_at))
        self._host = {k: np.array(v[:self.n]) for k, v in host.items()}  # writable host copies
        for i, keep in self._keep.items():
            self._host["num_out"][i] = min(self._host["num_out"][i], keep)
        if self._bar is not None:
            self._bar.n = int(self._host["num_out"].sum())
            self._bar.refresh()

    @property
    def done(self) -> bool:
        return bool(self._host["done"].all())

    def _bound(self):
        return jnp.int32(self.spec.max_new_tokens if self._rounds_per_chunk is None else self._rounds_per_chunk)

    def _dispatch(self, state):
        t0 = time.perf_counter()
        out = self._loop(self._target, self._drafter, state, self._sampling, self._bound())
        self._dispatch_s += time.perf_counter() - t0
        return out

    def _adapt(self, rounds: int, seconds: float):
        """Size the next chunks (and the next generation's first chunk of this program) to about chunk_seconds."""
        if self._chunk_seconds is not None and self._rounds_per_chunk is not None and rounds:
            _SECONDS_PER_ROUND[self._loop] = seconds / rounds
            self._rounds_per_chunk = _chunk_rounds(self._chunk_seconds, seconds / rounds)

    def _run_chunk(self):
        """One device chunk of rounds (all remaining rounds when chunk_seconds is None), then a host snapshot (the
        streaming path: every chunk's tokens are read before the next chunk starts)."""
        t0 = time.perf_counter()
        try:
            new_state, rounds = self._dispatch(self._state)[:2]
            rounds = int(rounds)  # waits for the chunk
        except KeyboardInterrupt:
            self._interrupt()
        self._state = new_state
        dt = time.perf_counter() - t0
        self._decode_s += dt
        self._rounds += rounds
        self._chunks += 1
        self._adapt(rounds, dt)
        try:
            self._snapshot()
        except KeyboardInterrupt:
            self._interrupt()

    def _run_to_end(self):
        """Every remaining round in chunks; the host reads two scalars per chunk (rows still running, tokens emitted).
        The next chunk is dispatched only when this one is done: on the H200 the call handing the next chunk the
        (donated) state returned only when the running chunk had ended, so queueing ahead gained nothing, and it would
        leave Ctrl-C no live state to stop at."""
        t0 = last = time.perf_counter()
        snapshot = self._host
        try:
            while True:
                cur = self._dispatch(self._state)
                self._state = cur[0]
                running, rounds, emitted = int(cur[2]), int(cur[1]), int(cur[3])  # waits for the chunk
                now = time.perf_counter()
                self._rounds += rounds
                self._chunks += 1
                self._adapt(rounds, now - last)
                last = now
                if self._bar is not None:
                    self._bar.n = emitted
                    self._bar.refresh()
                if running == 0:
                    break
        except KeyboardInterrupt:
            self._decode_s += time.perf_counter() - t0
            try:
                self._snapshot()  # the live state: at most the chunk that was running
            except (KeyboardInterrupt, RuntimeError, ValueError):
                self._host = snapshot  # a second Ctrl-C, or the state was mid-handover: the last host copy
            self._interrupt()
        self._decode_s += time.perf_counter() - t0
        self._snapshot()

    def _interrupt(self):
        """Ctrl-C: end unfinished rows as "interrupted" and raise with what the host snapshot holds."""
        stop = self._host["stop"]
        stop[~self._host["done"]] = STOP_INTERRUPTED
        self._host["done"][:] = True
        res = self._result()
        self.close()
        raise GenerationInterrupted(res) from None

    # -- streaming ---------------------------------------------------------------------------------------
    def __iter__(self):
        return self

    def __next__(self) -> Chunk:
        if self._first_pending:
            self._first_pending = False
        elif self.done or self._closed:
            self.close()
            raise StopIteration
        else:
            self._run_chunk()
        out, num = self._host["out"], self._host["num_out"]
        new = [out[i, self._sent[i]:num[i]].tolist() for i in range(self.n)]
        self._sent = np.maximum(self._sent, num)
        done = self._host["done"].tolist()
        reasons = [STOP_NAMES[int(s)] if d else None for s, d in zip(self._host["stop"], done)]
        return Chunk(new, done, reasons)

    def finish(self, row: int, *, keep: Optional[int] = None):
        """End prompt `row` from the host (stop reason "stop"): it takes part in no further round. keep: cut its
        output to its first `keep` tokens (e.g. where a stop string ends)."""
        if not 0 <= row < self.n:
            raise IndexError(f"row {row} outside [0, {self.n})")
        if keep is not None:
            if not I.is_int(keep) or keep < 0:
                raise ValueError(f"keep must be an integer >= 0, got {keep!r}")
            self._keep[row] = min(int(keep), self._keep.get(row, int(keep)))
            self._host["num_out"][row] = min(self._host["num_out"][row], keep)
        if not self._host["done"][row]:
            s = self._state
            self._state = dataclasses.replace(s, done=s.done.at[row].set(True), stop=s.stop.at[row].set(STOP_HOST))
            self._host["done"][row] = True
            self._host["stop"][row] = STOP_HOST

    def result(self) -> GenerateResult:
        """Run to completion (if not yet) and return the outputs and statistics."""
        if not self.done and not self._closed:
            self._run_to_end()
        res = self._result()
        self.close()
        return res

    def close(self):
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._closed = True

    # -- statistics --------------------------------------------------------------------------------------
    def _result(self) -> GenerateResult:
        h = self._host
        tokens = [h["out"][i, :h["num_out"][i]].tolist() for i in range(self.n)]
        return GenerateResult(tokens, self._stats())

    def _stats(self) -> dict:
        h, spec = self._host, self.spec
        drafts = int(h["num_drafts"].sum())
        accepted = int(h["accepted"].sum())
        out_tokens = int(h["num_out"].sum())
        wall = self._prefill_s + self._decode_s
        rounds_total = max(int(h["rounds"].max()) if self.n else 0, 1)
        requests = []
        for i in range(self.n):
            nd, acc, out = int(h["num_drafts"][i]), int(h["accepted"][i]), int(h["num_out"][i])
            # a row's end time: prefill, then its share of the decode rounds (rounds cost the same for every row)
            e2e = self._t_first + self._decode_s * int(h["rounds"][i]) / rounds_total
            requests.append({
                "prompt_tokens": int(self._lengths[i]), "output_tokens": out, "rounds": int(h["rounds"][i]),
                **acceptance_stats(nd, acc, h["accepted_at"][i]),
                "stop_reason": STOP_NAMES[int(h["stop"][i])], "ttft_s": self._t_first, "e2e_s": e2e,
                "tpot_s": (e2e - self._t_first) / (out - 1) if out > 1 else None,
                "output_tokens_per_s": out / e2e if e2e > 0 else float("inf")})
        return {
            "rounds": self._rounds,
            **acceptance_stats(drafts, accepted, h["accepted_at"].sum(0)),
            "num_draft_tokens": int(h["num_draft_tokens"].sum()),
            "output_tokens": out_tokens,
            "per_request_rounds": h["rounds"].tolist(),
            "stop_reasons": [STOP_NAMES[int(s)] for s in h["stop"]],
            "requests": requests,
            "ttft_s": self._t_first,
            "prefill": self._prefill[0],
            "prefill_tokens": self._prefill[1],
            "prefill_time_s": self._prefill_s,
            "decode_time_s": self._decode_s,
            "wall_time_s": wall,
            "compile_time_s": self._compile_s,
            "output_tokens_per_s": out_tokens / wall if wall > 0 else float("inf"),
            "num_speculative_tokens": spec.k,
            "drafting": spec.drafting,
            "aux_layer_ids": list(spec.aux_layer_ids),
            "device_chunks": self._chunks,
            "host_dispatch_s": self._dispatch_s,
            "simulated_acceptance": spec.simulate_acceptance is not None,
            "warnings": list(self._warnings),
        }


def acceptance_stats(num_drafts: int, accepted: int, accepted_at) -> dict:
    """num_drafts (rounds that verified >= 1 draft), num_accepted_tokens, mean_acceptance_length (1 + accepted /
    num_drafts, as vLLM) and acceptance_rates (accepted_at [K]: rounds whose draft i was accepted, over num_drafts)."""
    return {"num_drafts": num_drafts, "num_accepted_tokens": accepted,
            "mean_acceptance_length": 1.0 + accepted / num_drafts if num_drafts else 1.0,
            "acceptance_rates": [float(x) / num_drafts if num_drafts else 0.0 for x in accepted_at]}


_SECONDS_PER_ROUND: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
"""chunk program -> seconds per round of its last chunk. A generation sizes its first chunk from it (8 rounds when the
program has not run yet), so a generation shorter than chunk_seconds runs in one device call, not two (each call costs
the host 1-4 ms on the H200)."""


def _chunk_rounds(chunk_seconds: float, per_round: float) -> int:
    return int(min(4096, max(1, chunk_seconds / max(per_round, 1e-6))))


def precompile(target, drafter, prompts: Sequence[Sequence[int]], **settings) -> float:
    """Compile every program that `Generation(target, drafter, prompts, **settings)` runs, running nothing (no KV
    cache is allocated), so that threads can compile many settings' programs at once; returns the compile seconds
    (0.0 when all were compiled before)."""
    return Generation(target, drafter, prompts, **settings, _compile_only=True)._compile_s


def _shapes_of(exe, args):
    """The output shapes of the compiled `exe` (instead of running it on `args`), as plain ShapeDtypeStructs."""
    del args
    return jax.tree.map(lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype, weak_type=o.weak_type), exe.out_info)


def generate(target, drafter, prompts: Sequence[Sequence[int]], *, max_new_tokens: Union[int, Sequence[int]],
             num_speculative_tokens: int = 3, drafting: str = "parallel", temperature=0.0, top_k=None, top_p=None,
             seed: Union[int, Sequence[int]] = 0, eos_token_id=None, cache_capacity: Optional[int] = None,
             draft_sampling: str = "argmax", implementation: str = "auto", cache_dtype=None,
             compiler_options: Optional[dict] = None, chunk_seconds: Optional[float] = 1.0, progress: bool = False,
             allow_tf32: bool = False, simulate_acceptance: Optional[Sequence[float]] = None,
             loop: str = "device", prefill: str = "auto") -> GenerateResult:
    """Speculative decoding of a batch of prompts (lists of token ids of any lengths).

    drafting: "parallel" (P-EAGLE: one drafter pass proposes K tokens), "sequential" (EAGLE-3: K drafter
      passes), "none" (plain autoregressive decoding with the same target code; drafter may be None).
    max_new_tokens: an integer or one per prompt.
    temperature / top_k / top_p: numbers or one per prompt (0 => greedy; top_k None/0 and top_p None/1 => off;
      top_k an integer, top_p in (0, 1]). Processing order: temperature, top-k, top-p (vLLM).
    seed: an integer in [0, 2**32) or one per prompt. Every random draw is keyed on (seed, absolute position), so a
      request's output does not depend on the other requests in the batch; give identical prompts different seeds
      for independent samples.
    eos_token_id: None, an id, a list of ids, or one list of ids per prompt; a row stops after emitting one.
    cache_capacity: KV positions per row (default: longest prompt + max_new_tokens + 2K, bucketed). A prompt longer
      than the cache is an error; a row that fills the cache stops with reason "capacity".
    cache_dtype: KV cache dtype, "bfloat16" / "float16" / "float32" (default: the model's).
    implementation: the kernel switch, "xla" (no Pallas kernel) | "pallas" (every kernel) | "auto".
    chunk_seconds: device time per chunk of rounds (progress, Ctrl-C, streaming); None = one device call. Each chunk
      boundary costs the device ~3 ms (8B shape on an H200: the host syncs and dispatches the next chunk), so 1 s
      keeps the cost near 0.3% and Ctrl-C within about a second.
    progress: a tqdm bar over output tokens. Ctrl-C raises `GenerationInterrupted` (a KeyboardInterrupt) whose
      `.result` holds the output so far.
    allow_tf32: float32 models run full-precision products by default (as PyTorch); True allows TF32 on the GPU.
    simulate_acceptance: K probabilities; the verdict of draft position i becomes a seeded draw (timing with
      random weights; outputs are then not the target's, and the stats say "simulated_acceptance": True).
    loop: "device" (chunks of rounds in a lax.while_loop) or "host" (one device call per round).
    prefill: the layout of the target's prefill pass, "packed" (the prompts concatenated into one row of N tokens,
      N the next power of two >= their total (min 16), each prompt attending to its own tokens only: document mask;
      each token's K/V written to its row's cache), "padded" (one row per prompt, right-padded to the next power of
      two >= the longest: [rows, Lp]) or "auto" (the default: packed when the batch has more than one row and
      N < rows * Lp).
      Both give the same outputs (up to float rounding); packed computes N instead of rows * Lp positions, a large
      saving for a batch of ragged prompts. Programs are compiled per (rows, Lp, N) bucket.
    compiler_options: XLA options for the compiled programs (e.g. {"xla_backend_optimization_level": 0}).

    A row stops on an EOS id, its max_new_tokens, a full cache, or non-finite target logits (reason "nonfinite": a
    broken checkpoint, nothing emitted from those logits).
    stats: rounds, mean_acceptance_length (1 + accepted / num_drafts, as vLLM), acceptance_rates (per draft
    position), num_drafts, num_draft_tokens, num_accepted_tokens, output_tokens, stop_reasons, requests (per prompt:
    tokens, acceptance, stop reason, ttft_s, e2e_s, tpot_s, output_tokens_per_s), ttft_s, wall_time_s (prefill +
    decode, compilation excluded), prefill ("packed" | "padded": the layout used), prefill_tokens (positions the
    target's prefill computed: N or rows * Lp), prefill_time_s, decode_time_s, compile_time_s, output_tokens_per_s,
    aux_layer_ids, warnings (e.g. a head trained for another verifier).
    """
    return Generation(target, drafter, prompts, max_new_tokens=max_new_tokens,
                      num_speculative_tokens=num_speculative_tokens, drafting=drafting, temperature=temperature,
                      top_k=top_k, top_p=top_p, seed=seed, eos_token_id=eos_token_id, cache_capacity=cache_capacity,
                      draft_sampling=draft_sampling, implementation=implementation, cache_dtype=cache_dtype,
                      compiler_options=compiler_options, chunk_seconds=chunk_seconds, progress=progress,
                      allow_tf32=allow_tf32, simulate_acceptance=simulate_acceptance, loop=loop,
                      prefill=prefill).result()

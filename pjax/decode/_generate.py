"""`generate` and `Generation`: a static batch on the engine (`pjax.decode.Engine`): every prompt is admitted at once
(one prefill of the batch, packed where it computes fewer positions) into an engine of one slot per prompt, then
decoded in device chunks of `rounds_per_step` rounds until every row stops. Between chunks the host streams tokens
(`Chunk`s), ends rows (`finish`: stop strings), shows progress and answers Ctrl-C with the output so far.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional, Sequence, Union

from pjax.decode import inputs as I
from pjax.decode.compiled import compile_count
from pjax.decode.engine import STOP_WIDTH, Engine, RequestParams, acceptance_stats
from pjax.decode.settings import EngineConfig, configure, make_spec
from pjax.decode.state import STOP_INTERRUPTED, STOP_NAMES, sampling_modes
from pjax.models.target import Target

__all__ = ["Chunk", "GenerateResult", "Generation", "GenerationInterrupted", "compile_count", "generate"]


@dataclasses.dataclass
class GenerateResult:
    """tokens: per prompt, the generated ids only (stop token included if hit); stats: see `generate`."""
    tokens: list[list[int]]
    stats: dict[str, Any]


@dataclasses.dataclass
class Chunk:
    """What one device step produced: new_tokens[i] = prompt i's tokens since the previous chunk (the first chunk
    holds the token sampled at prefill); done[i] = prompt i has stopped; stop_reasons[i] = why (None if running)."""
    new_tokens: list[list[int]]
    done: list[bool]
    stop_reasons: list[Optional[str]]


class GenerationInterrupted(KeyboardInterrupt):
    """Ctrl-C during a generation: `.result` holds what was generated so far (unfinished rows: "interrupted")."""

    def __init__(self, result: GenerateResult):
        super().__init__("generation interrupted; partial output in .result")
        self.result = result


class Generation:
    """A running static batch: the prompts are checked, the programs compiled and the requests queued on
    construction; iterate for `Chunk`s as device steps complete (streaming), end rows from the host with `finish`,
    and call `result()` for the outputs and statistics.

    Arguments as `generate` (which is `Generation(...).result()`)."""

    def __init__(self, target, drafter, prompts: Sequence[Sequence[int]], *, max_new_tokens, temperature=None,
                 top_k=None, top_p=None, seed=0, eos_token_id=None, progress: bool = False,
                 config: Optional[EngineConfig] = None, acceptance=None, mesh=None, **settings):
        if not isinstance(target, Target):
            raise TypeError(f"target must be a pjax Target (load one with pjax.load_target(path)), got "
                            f"{type(target).__name__}" + (" (a path? use pjax.load_target)" if isinstance(target, str)
                                                            else ""))
        c = configure(config, **settings)
        I.check_prefill(c.prefill)
        rows = I.check_prompts(prompts, target.config.vocab_size)
        n = len(rows)
        limits = I.per_row(max_new_tokens, n, "max_new_tokens", kind="int", default=None, low=1)
        temp, tk, tp, seeds = I.check_sampling(n, temperature, top_k, top_p, seed,
                                               defaults=(c.temperature, c.top_k, c.top_p, 0))
        stops = I.stop_table(eos_token_id, n, target.config.vocab_size, STOP_WIDTH)
        lengths = [len(r) for r in rows]
        longest, most = max(lengths), int(limits.max())
        if c.max_len is None:
            slack = make_spec(target, drafter, c, max_new_tokens=most, acceptance=acceptance).slack
            max_len = I.bucket_capacity(longest + most + slack)
        else:
            if not I.is_int(c.max_len) or c.max_len < 1:
                raise ValueError(f"max_len must be a positive integer, got {c.max_len!r}")
            max_len = int(c.max_len)
            if longest > max_len:
                raise ValueError(f"prompts[{lengths.index(longest)}] has {longest} tokens, longer than "
                                 f"max_len={max_len}")
        c = dataclasses.replace(c, max_slots=n, max_len=max(max_len, 2), max_admit_rows=None)
        self._engine = eng = Engine(target, drafter, c, acceptance=acceptance, mesh=mesh)
        self.n, self.spec, self._lengths = n, eng.spec, lengths
        self._modes = sampling_modes(zip(temp, tk, tp))
        eng.precompile_admissions([lengths], max_new_tokens=most, pipelined=False, sampling=self._modes)
        self._most, self._streaming = most, False
        self._layout = I.prefill_buckets(lengths, eng.max_len, eng.prefill)
        self._ids = [eng.submit(r, RequestParams(int(m), float(t), int(a), float(p), int(s),
                                                 tuple(int(x) for x in e if x >= 0)), stop_at_capacity=True)
                     for r, m, t, a, p, s, e in zip(rows, limits, temp, tk, tp, seeds, stops)]
        self._row = {rid: i for i, rid in enumerate(self._ids)}
        self._tokens: list[list[int]] = [[] for _ in range(n)]
        self._final: list[Optional[Any]] = [None] * n
        self._keep: dict[int, int] = {}
        self._closed = False
        self._t_first: Optional[float] = None
        self._wall = 0.0
        self._compile_before = eng.compile_s
        self._bar = None
        if progress:
            from tqdm.auto import tqdm
            self._bar = tqdm(total=int(limits.sum()), desc=f"generate ({self.spec.drafting.value})", unit="tok",
                             dynamic_ncols=True)

    @property
    def done(self) -> bool:
        return all(f is not None for f in self._final)

    # -- the engine's steps --------------------------------------------------------------------------------
    def _step(self, final: bool = False) -> Chunk:
        """One engine step (the admission first, then device chunks; final: no streaming, the tail that cannot be
        pipelined runs in one device call); Ctrl-C raises GenerationInterrupted."""
        new = [[] for _ in range(self.n)]
        t = time.perf_counter()
        try:
            events = self._engine.step(final=final)
        except KeyboardInterrupt:
            self._wall += time.perf_counter() - t
            self._interrupt()
        self._wall += time.perf_counter() - t
        if self._t_first is None:
            self._t_first = self._wall
        for ev in events:
            i = self._row[ev.request_id]
            keep = self._keep.get(i)
            tokens = ev.new_tokens if keep is None else ev.new_tokens[:max(0, keep - len(self._tokens[i]))]
            self._tokens[i] += tokens
            new[i] = tokens
            if ev.finished:
                self._final[i] = ev
        if self._bar is not None:
            self._bar.n = sum(map(len, self._tokens))
            self._bar.refresh()
        done = [f is not None for f in self._final]
        return Chunk(new, done, [f.stop_reason if f is not None else None for f in self._final])

    def _interrupt(self):
        """Ctrl-C: end unfinished rows as "interrupted" and raise with the tokens handed out so far."""
        res = self._result(interrupted=True)
        self.close()
        raise GenerationInterrupted(res) from None

    # -- streaming -----------------------------------------------------------------------------------------
    def __iter__(self):
        return self

    def __next__(self) -> Chunk:
        if self.done or self._closed:
            self.close()
            raise StopIteration
        if not self._streaming:  # streaming runs the pipelined chunks that `result()` never needs: built now
            self._engine.precompile_admissions([], max_new_tokens=self._most, sampling=self._modes)
            self._streaming = True
        return self._step()

    def finish(self, row: int, *, keep: Optional[int] = None):
        """End prompt `row` from the host (stop reason "stop"): it takes part in no further round. keep: cut its
        output to its first `keep` tokens (e.g. where a stop string ends)."""
        if not 0 <= row < self.n:
            raise IndexError(f"row {row} outside [0, {self.n})")
        if keep is not None:
            if not I.is_int(keep) or keep < 0:
                raise ValueError(f"keep must be an integer >= 0, got {keep!r}")
            keep = min(int(keep), self._keep.get(row, int(keep)))
            self._keep[row] = keep
            del self._tokens[row][keep:]
        if self._final[row] is None:
            self._engine.cancel(self._ids[row], keep=keep)

    def result(self) -> GenerateResult:
        """Run to completion (if not yet) and return the outputs and statistics."""
        while not self.done and not self._closed:
            self._step(final=True)
        res = self._result()
        self.close()
        return res

    def close(self):
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._closed = True

    # -- statistics ----------------------------------------------------------------------------------------
    def _result(self, interrupted: bool = False) -> GenerateResult:
        k = self.spec.k
        reqs, stops = [], []
        for i, ev in enumerate(self._final):
            out = len(self._tokens[i])
            if ev is None:
                st = {"prompt_tokens": self._lengths[i], "output_tokens": out, "rounds": 0, "num_draft_tokens": 0,
                      "mean_budget": 0.0, **acceptance_stats(0, 0, [0] * k),
                      "ttft_s": self._t_first, "e2e_s": self._wall, "tpot_s": None}
                reason = STOP_NAMES[STOP_INTERRUPTED] if interrupted else None
            else:
                st = {key: v for key, v in ev.stats.items() if key != "queue_s"}
                st["output_tokens"] = out
                reason = ev.stop_reason
            e2e = st["e2e_s"]
            st.update(stop_reason=reason, output_tokens_per_s=out / e2e if e2e else float("inf"))
            reqs.append(st)
            stops.append(reason)
        drafts = sum(r["num_drafts"] for r in reqs)
        accepted = sum(r["num_accepted_tokens"] for r in reqs)
        total = lambda key: [sum(r[key][j] for r in reqs) for j in range(k)]  # noqa: E731
        auto = self.spec.state_k is not None
        acceptance = acceptance_stats(drafts, accepted, total("accepted_per_position"),
                                      total("tested_per_position") if auto else None)
        out_tokens = sum(r["output_tokens"] for r in reqs)
        rounds = [r["rounds"] for r in reqs]
        draft_tokens = sum(r["num_draft_tokens"] for r in reqs)
        rows, lp, packed = self._layout
        wall = self._wall - (self._engine.compile_s - self._compile_before)
        t_first = self._t_first or 0.0
        eng = self._engine
        return GenerateResult([list(t) for t in self._tokens], {
            "rounds": max(rounds),
            **acceptance,
            "num_draft_tokens": draft_tokens,
            "mean_budget": draft_tokens / sum(rounds) if sum(rounds) else 0.0,
            "output_tokens": out_tokens,
            "per_request_rounds": rounds,
            "stop_reasons": stops,
            "requests": reqs,
            "ttft_s": t_first,
            "prefill": "padded" if packed is None else "packed",
            "prefill_tokens": rows * lp if packed is None else packed,
            "prefill_time_s": t_first,
            "decode_time_s": max(wall - t_first, 0.0),
            "wall_time_s": wall,
            "compile_time_s": eng.compile_s,
            "output_tokens_per_s": out_tokens / wall if wall > 0 else float("inf"),
            "num_speculative_tokens": "auto" if auto else k,
            **({"budget_stats": eng.budget_stats()} if auto else {}),
            "drafting": self.spec.drafting.value,
            "tree_budget": "auto" if self.spec.state_tree is not None else self.spec.tree_budget,
            "aux_layer_ids": list(self.spec.aux_layer_ids),
            "device_chunks": eng.chunks,
            "acceptance_replaced": self.spec.acceptance is not None,
            "warnings": list(eng.warnings),
        })


def generate(target, drafter, prompts: Sequence[Sequence[int]], *, max_new_tokens: Union[int, Sequence[int]],
             temperature=None, top_k=None, top_p=None, seed: Union[int, Sequence[int]] = 0, eos_token_id=None,
             progress: bool = False, config: Optional[EngineConfig] = None, acceptance=None, mesh=None,
             **settings) -> GenerateResult:
    """Speculative decoding of a batch of prompts (lists of token ids of any lengths), run as a static batch on the
    engine (`pjax.decode.Engine`: every prompt admitted at once, one slot each).

    max_new_tokens: an integer or one per prompt.
    temperature / top_k / top_p: numbers or one per prompt (None: the config's; 0 => greedy; top_k 0 and top_p 1 =>
      off; top_k an integer, top_p in (0, 1]). Processing order: temperature, top-k, top-p (vLLM).
    seed: an integer in [0, 2**32) or one per prompt. Every random draw is keyed on (seed, absolute position), so a
      request's output does not depend on the other requests in the batch; give identical prompts different seeds
      for independent samples.
    eos_token_id: None, an id, a list of ids, or one list of ids per prompt (at most 8 ids each); a row stops after
      emitting one.
    progress: a tqdm bar over output tokens. Ctrl-C raises `GenerationInterrupted` (a KeyboardInterrupt) whose
      `.result` holds the output so far.
    config / settings: the decoding settings, an `EngineConfig` and / or its fields by name (drafting,
      num_speculative_tokens, tree_budget, tree_score, draft_sampling, prefill, rounds_per_step, max_len,
      implementation, cache_dtype, allow_tf32, compiler_options; one set of defaults, `EngineConfig`'s).
      num_speculative_tokens="auto": each device chunk of rounds_per_step rounds drafts the K (0 .. 7) of best
      expected tokens per second (`pjax.decode.budget`); the same tokens as any fixed K at temperature 0.
      max_len: KV positions per row (default: longest prompt + max_new_tokens + the drafting's slack, 2K for a
      chain, `pjax.decode.state.drafting_slack`, bucketed); a prompt longer is an error, a row that fills it stops with reason "capacity". prefill: "auto"
      packs the prompts into one row where that computes fewer positions. tree_budget N: each round verifies a tree
      of N draft tokens (greedy and sampled rows alike, lossless), its paths ranked by tree_score; tree_budget
      "auto": each chunk drafts a chain of 0 .. 7 or a tree of 8, 16 or 32 nodes, as "auto" (parallel drafting).
    acceptance: None, or a hashable function replacing the round's acceptance rule (`EngineSpec.acceptance`; the
      benchmark's simulated acceptance); the stats then say "acceptance_replaced": True.
    mesh: None (one device), or a `jax.sharding.Mesh` with axes "data" and "model" (`pjax.make_mesh`): the target
      split over "model" (tensor / expert parallel), the drafter replicated, the prompts' rows over "data"; the same
      tokens as on one device (`pjax.decode.Engine`).

    A row stops on an EOS id, its max_new_tokens, a full cache, or non-finite target logits (reason "nonfinite": a
    broken checkpoint, nothing emitted from those logits).
    stats: rounds, mean_acceptance_length (1 + accepted / num_drafts, as vLLM), acceptance_rates (per draft
    position; accepted_per_position and tested_per_position: their counts), num_drafts, num_draft_tokens,
    mean_budget (draft tokens verified per round), num_accepted_tokens, output_tokens, stop_reasons, requests (per
    prompt: tokens, acceptance, stop reason, ttft_s, e2e_s, tpot_s, output_tokens_per_s), ttft_s, wall_time_s (prefill +
    decode, compilation excluded), prefill ("packed" | "padded": the layout used), prefill_tokens (positions the
    target's prefill computed), prefill_time_s, decode_time_s, compile_time_s, output_tokens_per_s, device_chunks,
    num_speculative_tokens (K, or "auto" with budget_stats: the engine's `Engine.budget_stats`), drafting,
    tree_budget, aux_layer_ids, warnings (e.g. a head trained for another verifier).
    """
    return Generation(target, drafter, prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                      top_p=top_p, seed=seed, eos_token_id=eos_token_id, progress=progress, config=config,
                      acceptance=acceptance, mesh=mesh, **settings).result()

"""`generate`: the user-facing speculative decoding entry point (host side: validation, padding,
compilation cache, timing, statistics). The device work is `prefill` + `decode_loop` (or one jitted
`spec_round` per round with loop="host")."""
from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from typing import Any, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from pjax.decode.state import DRAFT_SAMPLING, DRAFTING_MODES, STOP_NAMES, EngineSpec, Sampling
from pjax.decode.step import decode_loop, prefill, spec_round
from pjax.models.drafter import no_parallel_reason
from pjax.models.pairing import check_pair


@dataclasses.dataclass
class GenerateResult:
    """tokens: per prompt, the generated ids only (stop token included if hit); stats: see `generate`."""
    tokens: list[list[int]]
    stats: dict[str, Any]


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _donate() -> bool:
    return jax.default_backend() != "cpu"  # CPU ignores donation (and warns)


@functools.lru_cache(maxsize=None)
def _jitted(name: str, donate: bool, options: tuple = ()):
    """The jitted prefill / loop / round; `options` = sorted (key, value) XLA compiler options."""
    opts = dict(options) or None
    if name == "prefill":
        return jax.jit(prefill, static_argnames=("spec", "capacity", "cache_dtype"), compiler_options=opts)
    fn = {"loop": decode_loop, "round": spec_round}[name]
    return jax.jit(fn, static_argnames=("spec",), donate_argnames=("state",) if donate else (),
                   compiler_options=opts)


_COMPILED: dict = {}
_MAX_COMPILED = 64  # executables kept (oldest dropped first)


def _compiled(name, args, kwargs, options: tuple = ()):
    """AOT-compile once per (function, static settings, compiler options, argument structure and
    shapes); returns (executable, compile seconds this call)."""
    leaves, tree = jax.tree.flatten(args)
    key = (name, tuple(sorted(kwargs.items())), options, tree,
           tuple((np.shape(x), jnp.result_type(x)) for x in leaves))
    hit = _COMPILED.get(key)
    if hit is not None:
        return hit, 0.0
    t0 = time.perf_counter()
    exe = _jitted(name, _donate() and name != "prefill", options).lower(*args, **kwargs).compile()
    if len(_COMPILED) >= _MAX_COMPILED:
        _COMPILED.pop(next(iter(_COMPILED)))
    _COMPILED[key] = exe
    return exe, time.perf_counter() - t0


def _per_row(value, n: int, name: str, dtype, default):
    v = default if value is None else value
    if isinstance(v, (list, tuple, np.ndarray)):
        if len(v) != n:
            raise ValueError(f"{name}: {len(v)} values for {n} prompts")
        return np.asarray(v, dtype)
    return np.full((n,), v, dtype)


def _eos_table(eos_token_id, n: int, vocab: int) -> np.ndarray:
    """Stop ids [n, E] int32 (-1 padded, E >= 1 so that adding stop ids does not recompile)."""
    if eos_token_id is None:
        ids = []
    elif isinstance(eos_token_id, (int, np.integer)):
        ids = [int(eos_token_id)]
    else:
        ids = [int(e) for e in eos_token_id]
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise ValueError(f"eos_token_id {bad} outside the vocabulary [0, {vocab})")
    table = np.full((n, max(1, len(ids))), -1, np.int32)
    table[:, :len(ids)] = ids
    return table


def _check_prompts(prompts, vocab: int):
    if isinstance(prompts, np.ndarray) or not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    out = []
    for i, p in enumerate(prompts):
        p = np.asarray(p)
        if p.ndim != 1 or p.size == 0:
            raise ValueError(f"prompts[{i}] must be a non-empty 1-D list of token ids (got shape {p.shape})")
        if not np.issubdtype(p.dtype, np.integer):
            raise ValueError(f"prompts[{i}] must hold integer token ids (got {p.dtype})")
        if p.min() < 0 or p.max() >= vocab:
            raise ValueError(f"prompts[{i}] has token ids outside [0, {vocab})")
        out.append(p.astype(np.int32))
    return out


def check_engine_pair(target, drafter, k: int, drafting: str) -> tuple[int, ...]:
    """Host-side checks of a (target, drafter) pair for `drafting` with K drafts (`pjax.models.pairing`, plus the
    parallel-drafting needs); returns the aux layer ids the drafter reads."""
    if drafter is None:
        raise ValueError(f"drafting={drafting!r} needs a drafter (pass drafting='none' for plain decoding)")
    dcfg = drafter.config
    aux = check_pair(target.config, dcfg)
    if drafting == "parallel" and k > 1 and no_parallel_reason(dcfg):
        raise ValueError(no_parallel_reason(dcfg) + "; use drafting='sequential'")
    if dcfg.num_depths is not None and drafting == "parallel" and k > dcfg.num_depths:
        warnings.warn(f"num_speculative_tokens={k} exceeds the depth the head was trained for "
                      f"({dcfg.num_depths}); deeper drafts will rarely be accepted", stacklevel=4)
    return aux


def make_spec(target, drafter, *, max_new_tokens: int, num_speculative_tokens: int, drafting: str,
              draft_sampling: str = "argmax", implementation: str = "auto") -> EngineSpec:
    """Validate the settings and the (target, drafter) pair; returns the static EngineSpec."""
    if drafting not in DRAFTING_MODES:
        raise ValueError(f"drafting={drafting!r}: expected one of {DRAFTING_MODES}")
    if draft_sampling not in DRAFT_SAMPLING:
        raise ValueError(f"draft_sampling={draft_sampling!r}: expected one of {DRAFT_SAMPLING}")
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1 (got {max_new_tokens!r})")
    k = int(num_speculative_tokens)
    aux, mask_id = (), 0
    if drafting == "none":
        k = 0
    else:
        if k < 1 or k != num_speculative_tokens:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1 for drafting={drafting!r} "
                             f"(got {num_speculative_tokens!r})")
        aux = check_engine_pair(target, drafter, k, drafting)
        mask_id = drafter.config.mask_token_id if drafter.config.mask_token_id is not None else 0
    return EngineSpec(num_speculative_tokens=k, drafting=drafting, max_new_tokens=int(max_new_tokens),
                      draft_sampling=draft_sampling, aux_layer_ids=tuple(aux),
                      mask_token_id=int(mask_id), implementation=implementation)


def generate(target, drafter, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             num_speculative_tokens: int = 3, drafting: str = "parallel", temperature=0.0, top_k=None,
             top_p=None, seed: Union[int, Sequence[int]] = 0, eos_token_id=None,
             cache_capacity: Optional[int] = None, draft_sampling: str = "argmax", loop: str = "device",
             implementation: str = "auto", cache_dtype=None, compiler_options: Optional[dict] = None
             ) -> GenerateResult:
    """Speculative decoding of a batch of prompts (lists of token ids of any lengths).

    drafting: "parallel" (P-EAGLE: one drafter pass proposes K tokens), "sequential" (EAGLE-3: K drafter
      passes), "none" (plain autoregressive decoding with the same target code; drafter may be None).
    temperature / top_k / top_p: scalars or one value per prompt (0 => greedy; top_k None/0 and top_p
      None/1 => off). Processing order: temperature, top-k, top-p (vLLM).
    seed: int or one per prompt. Every random draw is keyed on (seed, absolute position), so a request's
      output does not depend on the other requests in the batch; give identical prompts different seeds
      for independent samples.
    cache_capacity: KV positions per row (default: longest prompt + max_new_tokens + 2K, rounded up to
      64). A prompt longer than the cache is an error; a row that fills the cache stops cleanly with
      stop reason "capacity" (drafts are cut so that no verify write ever falls outside the cache).
    loop: "device" (all rounds in one lax.while_loop) or "host" (one jitted call per round).
    cache_dtype: KV cache dtype (default: the model's). compiler_options: XLA options for the compiled
      programs (e.g. {"xla_backend_optimization_level": 0} for fast CPU compiles in tests).

    stats: rounds, mean_acceptance_length (1 + accepted / num_drafts, as vLLM), acceptance_rates
    (per draft position), num_drafts, num_draft_tokens, num_accepted_tokens, output_tokens,
    stop_reasons, wall_time_s (prefill + decode, compilation excluded), prefill_time_s, decode_time_s,
    compile_time_s, output_tokens_per_s.
    """
    spec = make_spec(target, drafter, max_new_tokens=max_new_tokens, num_speculative_tokens=num_speculative_tokens,
                     drafting=drafting, draft_sampling=draft_sampling,
                     implementation=implementation)
    if loop not in ("device", "host"):
        raise ValueError(f"loop={loop!r}: expected 'device' or 'host'")
    rows = _check_prompts(prompts, target.config.vocab_size)
    n = len(rows)
    lengths = np.array([len(r) for r in rows], np.int32)
    longest = int(lengths.max())
    if cache_capacity is None:
        capacity = _round_up(longest + spec.max_new_tokens + 2 * spec.k, 64)
    else:
        capacity = int(cache_capacity)
        if longest > capacity:
            i = int(lengths.argmax())
            raise ValueError(f"prompts[{i}] has {longest} tokens, longer than cache_capacity={capacity}")
    lp = min(_round_up(longest, 16), max(capacity, longest))
    padded = np.zeros((n, lp), np.int32)
    for i, r in enumerate(rows):
        padded[i, :len(r)] = r
    temp = _per_row(temperature, n, "temperature", np.float32, 0.0)
    tk = _per_row(top_k, n, "top_k", np.int32, 0)
    tp = _per_row(top_p, n, "top_p", np.float32, 1.0)
    if (temp < 0).any() or not np.isfinite(temp).all():
        raise ValueError("temperature must be finite and >= 0")
    if (tk < 0).any():
        raise ValueError("top_k must be >= 0 (0 or None = off)")
    if ((tp <= 0) | (tp > 1)).any():
        raise ValueError("top_p must be in (0, 1] (1 or None = off)")
    spec = dataclasses.replace(spec, use_top_k=bool((tk > 0).any()), use_top_p=bool((tp < 1).any()))
    seeds = _per_row(seed, n, "seed", np.int64, 0)
    sampling = Sampling(jnp.asarray(temp), jnp.asarray(tk), jnp.asarray(tp),
                        jnp.asarray((seeds % (1 << 32)).astype(np.uint32)),
                        jnp.asarray(_eos_table(eos_token_id, n, target.config.vocab_size)))

    compile_s = 0.0
    opts = tuple(sorted((compiler_options or {}).items()))
    pre_args = (target, drafter if spec.drafting != "none" else None, jnp.asarray(padded), jnp.asarray(lengths),
                sampling)
    pre_kw = dict(spec=spec, capacity=capacity, cache_dtype=cache_dtype)
    exe, c = _compiled("prefill", pre_args, pre_kw, opts)
    compile_s += c
    t0 = time.perf_counter()
    state = exe(*pre_args)
    jax.block_until_ready(state)
    prefill_s = time.perf_counter() - t0
    dr = pre_args[1]
    if loop == "device":
        exe, c = _compiled("loop", (target, dr, state, sampling), dict(spec=spec), opts)
        compile_s += c
        t1 = time.perf_counter()
        state, rounds = exe(target, dr, state, sampling)
        rounds = int(rounds)
    else:
        exe, c = _compiled("round", (target, dr, state, sampling), dict(spec=spec), opts)
        compile_s += c
        t1 = time.perf_counter()
        rounds = 0
        while rounds < spec.max_new_tokens and not bool(np.asarray(state.done).all()):
            state = exe(target, dr, state, sampling)
            rounds += 1
    jax.block_until_ready(state)
    t2 = time.perf_counter()
    host = jax.device_get(dict(out=state.out, num_out=state.num_out, stop=state.stop, rounds=state.rounds,
                               num_drafts=state.num_drafts, num_draft_tokens=state.num_draft_tokens,
                               accepted=state.accepted, accepted_at=state.accepted_at))
    tokens = [host["out"][i, :host["num_out"][i]].tolist() for i in range(n)]
    return GenerateResult(tokens, _stats(host, spec, rounds, prefill_s=prefill_s, decode_s=t2 - t1,
                                         compile_s=compile_s))


def _stats(host, spec: EngineSpec, rounds: int, *, prefill_s: float, decode_s: float, compile_s: float) -> dict:
    drafts = int(host["num_drafts"].sum())
    accepted = int(host["accepted"].sum())
    out_tokens = int(host["num_out"].sum())
    wall = prefill_s + decode_s
    return {
        "rounds": rounds,
        "num_drafts": drafts,
        "num_draft_tokens": int(host["num_draft_tokens"].sum()),
        "num_accepted_tokens": accepted,
        "mean_acceptance_length": 1.0 + accepted / drafts if drafts else 1.0,
        "acceptance_rates": [float(x) / drafts if drafts else 0.0 for x in host["accepted_at"].sum(0)],
        "output_tokens": out_tokens,
        "per_request_rounds": host["rounds"].tolist(),
        "stop_reasons": [STOP_NAMES[int(s)] for s in host["stop"]],
        "prefill_time_s": prefill_s,
        "decode_time_s": decode_s,
        "wall_time_s": wall,
        "compile_time_s": compile_s,
        "output_tokens_per_s": out_tokens / wall if wall > 0 else float("inf"),
        "num_speculative_tokens": spec.k,
        "drafting": spec.drafting,
    }

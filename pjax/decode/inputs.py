"""Host-side checks and normalisation of `generate`'s inputs, and the shape buckets that keep the number of compiled
programs small.

Every bad value is a ValueError / TypeError naming the argument (and the prompt index for per-prompt values) and what
was expected: no silent truncation (top_k=2.7), no silent wrap-around (seed=2**32), no NaN meaning "off".
Buckets: batch, prompt length and the packed prefill's row to powers of two, the KV capacity to a power of two
(multiples of 4096 above), the output buffer to a power of two, stop lists to a fixed width; per-row limits and
sampling values are runtime data.
"""
from __future__ import annotations

import numbers
from typing import Optional

import numpy as np

__all__ = ["PREFILL_LAYOUTS", "bucket_batch", "bucket_capacity", "bucket_length", "check_prefill", "check_prompts",
           "check_sampling", "is_int", "is_real", "packed_length", "per_row", "prefill_buckets", "stop_table"]

SEED_LIMIT = 1 << 32
# What float32 sampling honours (sampling values are float32 / int32 on device): a positive temperature T keeps
# 1 / T and logits / T finite, normal float32 numbers; a smaller top_p would round to 0; top_k is an int32.
TEMPERATURE_RANGE = (1e-30, 1e30)
TOP_P_RANGE = (1e-30, 1.0)
TOP_K_LIMIT = 1 << 31
PREFILL_LAYOUTS = ("auto", "packed", "padded")
MIN_PROMPT_BUCKET = 16
MIN_STOP_WIDTH = 8
CAPACITY_STEP = 4096


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def bucket_batch(n: int) -> int:
    """Rows compiled for n prompts: the next power of two (padding rows stop after prefill)."""
    return next_pow2(n)


def bucket_length(n: int) -> int:
    """Prompt positions compiled for a longest prompt of n tokens."""
    return max(MIN_PROMPT_BUCKET, next_pow2(n))


def check_prefill(prefill, where: str = "prefill") -> str:
    """The prefill layout setting ("auto" | "packed" | "padded"), or a ValueError naming it."""
    if not isinstance(prefill, str) or prefill not in PREFILL_LAYOUTS:
        raise ValueError(f"{where}={prefill!r}: expected one of {PREFILL_LAYOUTS} (the target prefill's layout: "
                         "prompts packed into one row, or one right-padded row each)")
    return prefill


def packed_length(total: int, rows: int, prompt_len: int, prefill: str) -> Optional[int]:
    """The target prefill's layout for a batch of `rows` rows whose prompts (padding rows included) hold `total`
    tokens, right-padded to prompt_len: the packed row's length N = bucket_length(total), or None for the padded
    layout [rows, prompt_len]. prefill: "padded" -> None; "packed" -> N; "auto" -> N when the batch has more than
    one row and N < rows * prompt_len (packing saves positions), else None."""
    if prefill == "padded":
        return None
    n = bucket_length(total)
    if prefill == "auto" and (rows < 2 or n >= rows * prompt_len):
        return None
    return n


def prefill_buckets(lengths, capacity: int, prefill: str) -> tuple[int, int, Optional[int]]:
    """The compiled prefill's shape for prompts of `lengths` with `capacity` KV positions per row: (rows =
    bucket_batch, prompt positions Lp = bucket_length of the longest (at most the capacity, unless the prompt is
    longer), packed row length or None = packed_length of their tokens plus one per padding row)."""
    n, longest = len(lengths), int(max(lengths))
    rows = bucket_batch(n)
    lp = min(bucket_length(longest), max(capacity, longest))
    return rows, lp, packed_length(int(sum(lengths)) + rows - n, rows, lp, prefill)


def bucket_capacity(n: int) -> int:
    """KV positions per row for n needed: a power of two up to CAPACITY_STEP, then multiples of it (so a long
    context never pays more than CAPACITY_STEP extra positions)."""
    if n <= CAPACITY_STEP:
        return max(64, next_pow2(n))
    return -(-n // CAPACITY_STEP) * CAPACITY_STEP


def is_int(v) -> bool:
    return isinstance(v, (numbers.Integral, np.integer)) and not isinstance(v, (bool, np.bool_))


def is_real(v) -> bool:
    return isinstance(v, (numbers.Real, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))


def check_prompts(prompts, vocab: int) -> list[np.ndarray]:
    """prompts: a non-empty list of 1-D integer token-id sequences in [0, vocab) -> int32 arrays."""
    if isinstance(prompts, (str, bytes)):
        raise TypeError("prompts must be a list of token-id lists; for text use pjax.text (load / TextGenerator)")
    if isinstance(prompts, np.ndarray) or not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, (str, bytes)):
            raise TypeError(f"prompts[{i}] is text; prompts must be token ids (for text use pjax.text: load / TextGenerator)")
        p = np.asarray(p)
        if p.ndim != 1 or p.size == 0:
            raise ValueError(f"prompts[{i}] must be a non-empty 1-D list of token ids (got shape {p.shape})")
        if not np.issubdtype(p.dtype, np.integer):
            raise ValueError(f"prompts[{i}] must hold integer token ids (got {p.dtype})")
        if p.min() < 0 or p.max() >= vocab:
            raise ValueError(f"prompts[{i}] has token ids outside [0, {vocab})")
        out.append(p.astype(np.int32))
    return out


def per_row(value, n: int, name: str, *, kind: str, default, low=None, high=None, low_open: bool = False,
            high_open: bool = False) -> np.ndarray:
    """A scalar or one value per prompt -> [n] array, each value checked.

    kind: "int" (integers only: 2.7 and "3" are errors) or "real" (finite numbers: NaN, inf and strings are errors).
    low / high: bounds (inclusive unless low_open / high_open). None (the value or an element) = `default`."""
    if isinstance(value, (list, tuple, np.ndarray)):
        vals = list(value)
        if len(vals) != n:
            raise ValueError(f"{name}: {len(vals)} values for {n} prompts")
    else:
        vals = [value] * n
    out = []
    for i, v in enumerate(vals):
        where = f"{name}[{i}]" if isinstance(value, (list, tuple, np.ndarray)) else name
        if v is None:
            v = default
        if kind == "int":
            if not is_int(v):
                raise TypeError(f"{where}={v!r} must be an integer")
        elif not is_real(v) or not np.isfinite(float(v)):
            raise (TypeError if not is_real(v) else ValueError)(f"{where}={v!r} must be a finite number")
        if low is not None and (v < low or (low_open and v == low)):
            raise ValueError(f"{where}={v!r} must be {'>' if low_open else '>='} {low}")
        if high is not None and (v > high or (high_open and v == high)):
            raise ValueError(f"{where}={v!r} must be {'<' if high_open else '<='} {high}")
        out.append(int(v) if kind == "int" else float(v))
    return np.asarray(out, np.int64 if kind == "int" else np.float64)


def check_sampling(n: int, temperature, top_k, top_p, seed, *, defaults=(0.0, 0, 1.0, 0)):
    """Sampling values of n prompts (each a scalar or one per prompt; None = its entry of `defaults`) -> float64
    temperature [n], int64 top_k [n], float64 top_p [n], int64 seed [n], each within what float32 sampling honours:
    temperature 0 (greedy) or in TEMPERATURE_RANGE, top_k in [0, 2**31) (0 = off), top_p in TOP_P_RANGE (1 = off),
    seed in [0, 2**32). A bad value is a ValueError / TypeError naming the field (and the prompt)."""
    temp = per_row(temperature, n, "temperature", kind="real", default=defaults[0], low=0.0)
    _in_float32_range(temp, temperature, "temperature", TEMPERATURE_RANGE,
                      "give 0 (greedy) or a temperature in [{}, {}] (float32 sampling divides the logits by it)")
    tk = per_row(top_k, n, "top_k", kind="int", default=defaults[1], low=0, high=TOP_K_LIMIT, high_open=True)
    tp = per_row(top_p, n, "top_p", kind="real", default=defaults[2], low=0.0, high=1.0, low_open=True)
    _in_float32_range(tp, top_p, "top_p", TOP_P_RANGE, "give a top_p in [{}, {}] (a float32 probability mass)")
    seeds = per_row(seed, n, "seed", kind="int", default=defaults[3], low=0, high=SEED_LIMIT, high_open=True)
    return temp, tk, tp, seeds


def _in_float32_range(values: np.ndarray, given, name: str, bounds: tuple, hint: str) -> None:
    """ValueError naming the first non-zero value outside `bounds` (one of `given`, a scalar or one per prompt)."""
    low, high = bounds
    for i in np.flatnonzero((values != 0) & ((values < low) | (values > high))):
        where = f"{name}[{i}]" if isinstance(given, (list, tuple, np.ndarray)) else name
        raise ValueError(f"{where}={float(values[i])!r} is out of range: " + hint.format(f"{low:g}", f"{high:g}"))


def stop_table(eos_token_id, n: int, vocab: int, width: Optional[int] = None) -> np.ndarray:
    """Stop ids [n, E] int32 (-1 padded). eos_token_id: None, an id, a list of ids (every prompt), or one list per
    prompt (a list of n lists). E = max(8, next power of two of the longest list) unless `width` is given, so adding
    stop ids rarely compiles a new program."""
    if eos_token_id is None:
        rows = [[] for _ in range(n)]
    elif is_int(eos_token_id):
        rows = [[int(eos_token_id)]] * n
    elif isinstance(eos_token_id, (list, tuple, np.ndarray)):
        items = list(eos_token_id)
        if items and all(isinstance(x, (list, tuple, np.ndarray)) for x in items):
            if len(items) != n:
                raise ValueError(f"eos_token_id: {len(items)} stop lists for {n} prompts (give one list per prompt, "
                                 "or one list for all)")
            rows = [list(x) for x in items]
        elif any(isinstance(x, (list, tuple, np.ndarray)) for x in items):
            raise TypeError("eos_token_id mixes ids and lists: give a list of ids (every prompt) or one list of ids "
                            "per prompt")
        else:
            rows = [items] * n
    else:
        raise TypeError(f"eos_token_id={eos_token_id!r} must be an id, a list of ids, or one list per prompt")
    for i, row in enumerate(rows):
        for t in row:
            if not is_int(t):
                raise TypeError(f"eos_token_id (prompt {i}): {t!r} is not an integer token id")
            if not 0 <= t < vocab:
                raise ValueError(f"eos_token_id (prompt {i}): {t} outside the vocabulary [0, {vocab})")
    longest = max((len(r) for r in rows), default=0)
    e = width or max(MIN_STOP_WIDTH, next_pow2(longest))
    if longest > e:
        raise ValueError(f"eos_token_id: {longest} stop ids exceed the table width {e}")
    table = np.full((n, e), -1, np.int32)
    for i, row in enumerate(rows):
        table[i, :len(row)] = row
    return table

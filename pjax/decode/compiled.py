"""The compilation cache of the engine's programs: each pure function is jitted once per compiler options and
AOT-compiled once per (static settings, matmul precision, argument structure and shapes); `compile_count` counts the
programs built, so tests and benchmarks see recompilations.

Programs are named; the engine registers its pure functions with `register_program` (the admission "admit" and the
device chunks "chunk" and "chunk_ending").
"""
from __future__ import annotations

import functools
import os
import threading
import time
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pjax.precision import matmul_precision as _rule

__all__ = ["COMPILE_THREADS", "clear_compiled", "compile_count", "compile_stats", "compiled", "jitted",
           "matmul_precision", "register_program", "use_compilation_cache"]

# name -> (function, static argument names, donated argument names)
_PROGRAMS: dict[str, tuple[Callable, tuple[str, ...], tuple[str, ...]]] = {}


def register_program(name: str, fn: Callable, *, static_argnames: Sequence[str],
                     donate_argnames: Sequence[str] = ()) -> None:
    """Make the pure function `fn` buildable by `compiled(name, ...)` (its `donate_argnames` are donated where the
    backend supports it). Registering the same function again is a no-op; another function under a taken name is
    an error."""
    entry = (fn, tuple(static_argnames), tuple(donate_argnames))
    have = _PROGRAMS.get(name)
    if have is not None and have != entry:
        raise ValueError(f"program {name!r} is already registered for {have[0].__qualname__}")
    _PROGRAMS[name] = entry


@functools.lru_cache(maxsize=None)
def jitted(name: str, donate: bool, options: tuple = ()):
    """The jitted program `name`; `options` = sorted (key, value) XLA compiler options."""
    fn, static, donated = _PROGRAMS[name]
    return jax.jit(fn, static_argnames=static, donate_argnames=donated if donate else (),
                   compiler_options=dict(options) or None)


COMPILE_THREADS = max(1, min(8, (os.cpu_count() or 2) // 2))  # programs compiled at once where several are needed

_COMPILED: dict = {}
_MAX_COMPILED = 64  # executables kept (oldest dropped first)
_BY_NAME: dict[str, list] = {}  # program name -> [programs compiled, seconds]
_BUILDING: dict = {}  # key -> lock held while one thread compiles it
_LOCK = threading.Lock()  # guards the three tables


def compile_count() -> int:
    """Programs compiled by this process's generations so far (tests and benchmarks count recompilations)."""
    return sum(n for n, _ in _BY_NAME.values())


def compile_stats() -> dict[str, tuple[int, float]]:
    """Programs compiled so far and their compile seconds (a persistent-cache hit counts its loading), by program
    name: {"prefill_target": (programs, seconds), "chunk": (...), ...}. Differences of two calls show where a run's
    compilation went."""
    return {name: (n, s) for name, (n, s) in _BY_NAME.items()}


def _donate() -> bool:
    return jax.default_backend() != "cpu"  # CPU ignores donation (and warns)


def clear_compiled() -> None:
    """Drop every program compiled here (with `jax.clear_caches()`, a long-lived process that compiles many programs
    frees their memory and code mappings)."""
    with _LOCK:
        _COMPILED.clear()


def _signature(x) -> tuple:
    """(shape, dtype, weakly typed?, sharding over several devices or None) of one argument as jit sees it (a program
    compiled for sharded arguments takes only arguments of those shardings; one device's arrays, numpy inputs and
    shape structs share a program). Arrays and shape structs (the compile-only path) answer from their own fields:
    `jnp.result_type` costs ~4 us a leaf, over the ~260 leaves of a 24-layer pair 1 ms of every generation's host time
    per program looked up."""
    if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
        several = x.sharding is not None and len(x.sharding.device_set) > 1
        return x.shape, x.dtype, x.weak_type, x.sharding if several else None
    return np.shape(x), jnp.result_type(x), not isinstance(x, (np.ndarray, np.generic)), None


def compiled(name, args, kwargs, options: tuple, precision: Optional[str]):
    """AOT-compile once per (function, static settings, compiler options, matmul precision, argument structure and
    shapes); returns (executable, compile seconds this call). Thread-safe: threads may compile different programs at
    once (XLA compiles in parallel), and a thread asking for a program another thread is compiling waits for it."""
    leaves, tree = jax.tree.flatten(args)
    key = (name, tuple(sorted(kwargs.items())), options, precision, tree, tuple(map(_signature, leaves)))
    with _LOCK:
        hit = _COMPILED.get(key)
        if hit is not None:
            return hit, 0.0
        building = _BUILDING.setdefault(key, threading.Lock())
    with building:  # one compilation per key; a second caller waits here, then finds the executable
        with _LOCK:
            hit = _COMPILED.get(key)
        if hit is not None:
            return hit, 0.0
        t0 = time.perf_counter()
        with jax.default_matmul_precision(precision):
            exe = jitted(name, _donate(), options).lower(*args, **kwargs).compile()
        seconds = time.perf_counter() - t0
        with _LOCK:
            entry = _BY_NAME.setdefault(name, [0, 0.0])
            entry[0] += 1
            entry[1] += seconds
            if len(_COMPILED) >= _MAX_COMPILED:
                _COMPILED.pop(next(iter(_COMPILED)))
            _COMPILED[key] = exe
            _BUILDING.pop(key, None)
    return exe, seconds


def use_compilation_cache(path) -> None:
    """Keep compiled programs in the directory `path` (JAX's persistent compilation cache, created on the first
    write) so that a later process with the same programs loads them instead of compiling."""
    jax.config.update("jax_compilation_cache_dir", os.path.abspath(path))


def matmul_precision(target, drafter, allow_tf32: bool) -> Optional[str]:
    """float32 models get full-precision products (XLA dots and the kernels) unless TF32 is asked for
    (`pjax.precision`; None: a bfloat16 pair, nothing to choose)."""
    return _rule(target, drafter, allow_tf32=allow_tf32)

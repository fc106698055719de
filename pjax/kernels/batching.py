"""`loop_vmap`: a batching rule for ops whose primitive has none, or only part of one (a Mosaic GPU kernel;
`jax.lax.ragged_dot`, which batches only when every operand has the batch axis)."""
from __future__ import annotations

import jax

__all__ = ["loop_vmap"]


def loop_vmap(fn):
    """`fn` (positional array arguments) under `jax.vmap` as one unbatched call per batch member, in a `lax.map` loop;
    arguments without the batch axis (shared expert weights) are closed over, never copied. The wrapped function has
    no reverse-mode derivative of its own: call it inside a `jax.custom_vjp`."""
    wrapped = jax.custom_batching.custom_vmap(fn)

    @wrapped.def_vmap
    def rule(axis_size, in_batched, *args):
        def one(members):
            it = iter(members)
            return wrapped(*[next(it) if b else a for a, b in zip(args, in_batched)])
        out = jax.lax.map(one, [a for a, b in zip(args, in_batched) if b])
        return out, jax.tree.map(lambda _: True, out)
    return wrapped

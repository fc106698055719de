"""Exactness at temperature 0: each speculative output against the plain (`none`) output of the same prompt, and
where two outputs part, whether the target's logits there are a near-tie that rounding can flip.

Greedy speculative decoding emits the target's argmax at every position, so in exact arithmetic its output is
plain greedy decoding's. In bfloat16 on a GPU the verify pass (K + 1 tokens) and a one-token decode step reduce
in different orders and different batch shapes, and where two logits lie within rounding of each other the argmax
can flip ("lossless up to hardware numerics", as vLLM documents it). At the first position where the outputs
differ, the target runs once over the shared prefix (prompt + the common output) and the logits of the next token
are read: the mismatch is a near-tie when both emitted tokens lie within

    threshold = NEAR_TIE_EPS * eps(dtype) * max(1, |top logit|)

of the top logit, eps being the machine epsilon of the model's compute dtype (2**-7 bfloat16, 2**-10 float16,
2**-23 float32): the logits are products of activations rounded to that dtype in every layer, so two reduction
orders of the same model differ by a few such units at the logit's magnitude; NEAR_TIE_EPS = 8 is a loose bound
(0.94 at a logit of 15 in bfloat16, 1.4e-5 in float32). A mismatch beyond it is a token the target did not prefer:
a bug, not rounding.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pjax.decode.inputs import bucket_length
from pjax.models.target import forward, logits_from_hidden

__all__ = ["NEAR_TIE_EPS", "Mismatch", "classify", "compare_outputs", "first_mismatch", "near_tie_threshold",
           "next_token_logits"]

NEAR_TIE_EPS = 8


@dataclasses.dataclass
class Mismatch:
    """Where a speculative output first differs from the reference output of the same prompt.

    position: index in the generated tokens; token / reference_token: what each emitted there (None where one
    output ended: the outputs agree up to the shorter one); top_logit, margin (top-1 minus top-2 logit), gap (top
    logit minus the lower of the two emitted tokens' logits), threshold and near_tie from the target's logits over
    the shared prefix (None where not computed)."""
    prompt_id: str
    position: int
    token: Optional[int]
    reference_token: Optional[int]
    top_logit: Optional[float] = None
    margin: Optional[float] = None
    gap: Optional[float] = None
    threshold: Optional[float] = None
    near_tie: Optional[bool] = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def first_mismatch(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """Index of the first differing token, the shorter length when one is a strict prefix of the other, or None
    when they are equal."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    if diff.size:
        return int(diff[0])
    return None if len(a) == len(b) else n


def near_tie_threshold(top_logit: float, dtype, eps_multiple: float = NEAR_TIE_EPS) -> float:
    """eps_multiple * eps(dtype) * max(1, |top_logit|): how far below the top logit a token may lie and still be a
    rounding-level tie in `dtype`."""
    return float(eps_multiple * float(jnp.finfo(dtype).eps) * max(1.0, abs(float(top_logit))))


def classify(logits, token: int, reference_token: int, dtype, eps_multiple: float = NEAR_TIE_EPS) -> dict:
    """logits [V] of the position where `token` and `reference_token` were emitted -> top_logit, margin (top-1 -
    top-2), gap (top logit - the lower of the two tokens' logits), threshold, near_tie (both tokens within the
    threshold of the top logit)."""
    lg = np.asarray(logits, np.float64).reshape(-1)
    top2 = np.sort(lg)[-2:] if lg.size > 1 else np.array([lg[0], lg[0]])
    top = float(top2[-1])
    gap = top - min(float(lg[token]), float(lg[reference_token]))
    thr = near_tie_threshold(top, dtype, eps_multiple)
    return {"top_logit": top, "margin": float(top2[-1] - top2[-2]), "gap": gap, "threshold": thr,
            "near_tie": bool(gap <= thr)}


def compare_outputs(outputs: Sequence[Sequence[int]], reference: Sequence[Sequence[int]],
                    prompts: Sequence[Sequence[int]], ids: Sequence[str],
                    logits_fn: Optional[Callable[[list[int]], np.ndarray]], dtype,
                    eps_multiple: float = NEAR_TIE_EPS) -> tuple[int, list[Mismatch]]:
    """(number of outputs equal to their reference, the mismatches). logits_fn(prefix ids) -> [V] logits of the
    token after the prefix (`next_token_logits`), called once per mismatch; None leaves the margins out."""
    exact, found = 0, []
    for out, ref, prompt, pid in zip(outputs, reference, prompts, ids, strict=True):
        j = first_mismatch(out, ref)
        if j is None:
            exact += 1
            continue
        tok = int(out[j]) if j < len(out) else None
        ref_tok = int(ref[j]) if j < len(ref) else None
        m = Mismatch(pid, j, tok, ref_tok)
        if tok is not None and ref_tok is not None and logits_fn is not None:
            info = classify(logits_fn(list(prompt) + list(ref[:j])), tok, ref_tok, dtype, eps_multiple)
            m = dataclasses.replace(m, **info)
        found.append(m)
    return exact, found


@functools.partial(jax.jit, static_argnames=("implementation",))
def _last_logits(target, tokens, index, implementation: str):
    """tokens [1, T] (a prefix padded at the end) -> float32 logits [V] at position `index`."""
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    hidden = forward(target, tokens, positions, implementation=implementation).hidden
    return logits_from_hidden(target, jax.lax.dynamic_index_in_dim(hidden[0], index, keepdims=False))


def next_token_logits(target, ids: Sequence[int], implementation: str = "auto") -> np.ndarray:
    """The target's float32 logits [V] for the token after `ids`: one causal forward (no cache) over the prefix
    padded to a power-of-two bucket (padding comes after it, so it changes nothing); float32 targets use
    full-precision products, as the engine does."""
    n = len(ids)
    tokens = np.zeros((1, bucket_length(n)), np.int32)
    tokens[0, :n] = ids
    precision = "highest" if target.dtype == jnp.float32 else None
    with jax.default_matmul_precision(precision):
        out = _last_logits(target, jnp.asarray(tokens), jnp.int32(n - 1), implementation)
    return np.asarray(out, np.float32)

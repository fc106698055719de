"""Decode state and static engine settings (pytrees / hashable dataclasses).

Shapes: B rows (requests), K speculative tokens per round (0 for plain decoding; an "auto" engine's state holds
K_max = `EngineSpec.state_k` and each round uses its own K <= K_max), S cache capacity, N output buffer length
(max_new_tokens + K_max + 1), V target vocabulary.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from pjax.decode.drafting import Drafting
from pjax.decode.tree import beam_width

DRAFT_SAMPLING = ("argmax", "sample")

# stop codes (DecodeState.stop). STOP_NONFINITE: the target's logits turned NaN / inf (nothing is emitted from
# them); STOP_HOST: ended from the host between device chunks (a stop string, a cancelled request);
# STOP_INTERRUPTED: the generation was interrupted (Ctrl-C) before the row finished.
RUNNING, STOP_EOS, STOP_LENGTH, STOP_CAPACITY, STOP_NONFINITE, STOP_HOST, STOP_INTERRUPTED = 0, 1, 2, 3, 4, 5, 6
STOP_NAMES = {RUNNING: "running", STOP_EOS: "eos", STOP_LENGTH: "length", STOP_CAPACITY: "capacity",
              STOP_NONFINITE: "nonfinite", STOP_HOST: "stop", STOP_INTERRUPTED: "interrupted"}


SAMPLING_MODES = ("greedy", "sampled", "filtered")  # `EngineSpec.sampling` fixed at compile time


def sampling_need(rows) -> str:
    """The `SAMPLING_MODES` entry that rows of (temperature, top_k, top_p) need: "filtered" when a sampled row asks
    for top-k / top-p (a greedy row's argmax is its own under any filter), else "sampled" when one samples, else
    "greedy". A batch whose rows finish needs this mode or an earlier one."""
    sampled = [(k, p) for t, k, p in rows if t > 0]
    if any(k > 0 or p < 1 for k, p in sampled):
        return "filtered"
    return "sampled" if sampled else "greedy"


def sampling_modes(rows) -> tuple[str, ...]:
    """The modes a batch of these rows can need as its rows finish (any subset of them needs what its strictest row
    needs): each row's `sampling_need`, in `SAMPLING_MODES` order."""
    needs = {sampling_need([r]) for r in rows}
    return tuple(m for m in SAMPLING_MODES if m in needs)


def any_filter(sampling) -> jax.Array:
    """[] bool, on the device: does some row ask for top-k / top-p (`EngineSpec.sampling` None decides by it)."""
    return jnp.any((sampling.top_k > 0) | (sampling.top_p < 1))


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """Static engine settings (hashable: a static jit argument).

    num_speculative_tokens: K drafts per round (0 when drafting == "none").
    drafting: a `Drafting` (its name is accepted: "parallel" | "sequential" | "none").
    max_new_tokens: the static bound on new tokens per row (sizes the output buffer); a row's own limit is
      `Sampling.max_new` (runtime data) when given.
    draft_sampling: "argmax" (q one-hot, vLLM default) | "sample" (draft d_i ~ q = softmax(draft logits / T)
      under the row's top-k / top-p, processed as the target's; q kept for verification; greedy rows still use
      argmax).
    aux_layer_ids: target layers whose entering residual streams feed the drafter (() for "none").
    mask_token_id: the P-EAGLE mask token (target vocabulary id), 0 when unused.
    implementation: the kernel switch of every op the round runs ("xla" | "pallas" | "auto", `pjax.kernels`).
    sampling: what the rows' sampling asks of a round: None (decided on the device each round: the top-k / top-p
      truncation, a vocabulary sort per position, runs only when some row asks for it, and a tree round takes
      the greedy acceptance when no row samples; branches, which on a GPU make XLA read their predicate back to
      the host, every round); or fixed when the round is compiled, with no branch: "greedy" (every row greedy),
      "sampled" (no row filters), "filtered" (the truncation runs; a row with top-k 0 and top-p 1 is unchanged
      by it). The engine picks per chunk from its running requests (`SAMPLING_MODES`).
    acceptance: None (the speculative-sampling rule, `pjax.kernels.acceptance`), or a hashable function that
      replaces it, fn(logits [B, K+1, V], drafts [B, K], sampling, positions [B], num_drafts [B], spec) ->
      `AcceptResult`: the one extension point of a round (e.g. the benchmark's simulated acceptance).
    tree_budget: None (a chain of K drafts), or N >= K: each round verifies a tree of N draft nodes of depth <= K
      (`pjax.decode.tree`: from the drafter's per-position distributions with parallel drafting, grown depth by
      depth with sequential drafting).
    tree_score: the tree's path score, "product" | "min" (`pjax.decode.tree.build_tree`).
    state_k: None (the state holds K drafts), or K_max >= K: a budget that follows the load (`pjax.decode.budget`):
      the state is sized for K_max drafts (drafts, accepted_at, tested_at, the output buffer, the cache slack) and
      this round verifies drafts[:, :K] (K = 0: no draft, the drafter only takes the new token) and drafts K for
      the next round, leaving drafts K.. as they are; every budget's round takes and returns the same state.
    state_tree: None, or N_max (with state_k, tree_budget="auto"): the state also holds a tree of N_max nodes of
      depth <= K_max, which every round with drafts for all K_max depths proposes beside the argmax chain (parallel
      drafting); a round of tree_budget n verifies its first n nodes, a chain round (tree_budget None) the chain.
    """
    num_speculative_tokens: int
    drafting: str
    max_new_tokens: int
    draft_sampling: str = "argmax"
    aux_layer_ids: tuple[int, ...] = ()
    mask_token_id: int = 0
    implementation: str = "auto"
    sampling: Optional[str] = None
    acceptance: Optional[Callable] = None
    tree_budget: Optional[int] = None
    tree_score: str = "product"
    state_k: Optional[int] = None
    state_tree: Optional[int] = None

    def __post_init__(self):
        object.__setattr__(self, "drafting", Drafting.parse(self.drafting, "EngineSpec.drafting"))
        if self.sampling is not None and self.sampling not in SAMPLING_MODES:
            raise ValueError(f"EngineSpec.sampling must be None or one of {SAMPLING_MODES}, got {self.sampling!r}")

    @property
    def k(self) -> int:
        return self.num_speculative_tokens

    @property
    def k_max(self) -> int:
        """The drafts the state holds: state_k, or K."""
        return self.k if self.state_k is None else self.state_k

    @property
    def slack(self) -> int:
        """Cache positions a row keeps free past its last token (`drafting_slack` of K_max)."""
        tree = self.tree_budget if self.state_tree is None else self.state_tree
        return drafting_slack(self.k_max, tree, self.drafting is Drafting.SEQUENTIAL)

    @property
    def out_len(self) -> int:
        """Output buffer length: a round may emit up to K_max + 1 tokens past max_new_tokens - 1."""
        return self.max_new_tokens + self.k_max + 1


def drafting_slack(k: int, tree_budget: Optional[int] = None, sequential: bool = False) -> int:
    """Cache positions a request keeps free beyond prompt + max_new_tokens: a last round's verification and drafting
    may write that far past its final token (2 K for a chain of K drafts, K + N for a tree of N nodes; a sequential
    tree's drafter writes (K - 1) W scratch slots past its root, W = `tree.beam_width`)."""
    if tree_budget is None:
        return 2 * k
    return k + max(tree_budget, (k - 1) * beam_width(tree_budget, k) if sequential else 0)


@dataclasses.dataclass
class Sampling:
    """Per-row sampling and stop parameters (pytree; leading axis B, dropped for the single-sequence API).

    temperature [B] f32 (0 => greedy), top_k [B] i32 (0 => off), top_p [B] f32 (1 => off), seed [B] u32
    (the counter-hash key: with positions it fixes every random draw, independent of batch composition),
    eos [B, E] i32 stop token ids (-1 = unused slot) or None, max_new [B] i32 new-token limit of each row
    (<= EngineSpec.max_new_tokens) or None (= EngineSpec.max_new_tokens). All runtime data: a round compiled for
    their `EngineSpec.sampling` mode (or None) takes any values of that mode without recompiling.
    """
    temperature: Any
    top_k: Any
    top_p: Any
    seed: Any
    eos: Any = None
    max_new: Any = None


jax.tree_util.register_dataclass(Sampling, data_fields=["temperature", "top_k", "top_p", "seed", "eos", "max_new"],
                                 meta_fields=[])


@dataclasses.dataclass
class DecodeState:
    """Everything a round reads and writes; every leaf has the batch axis first.

    target_cache: list[LayerKV] k/v [B, S, nkv, hd] (index = absolute position)
    drafter_cache: list[LayerKV] [B, S, ...] or None (drafting == "none")
    last [B] i32: the pending token (emitted, not yet in the target cache), at absolute position pos
    pos [B] i32: position of `last`; the target cache holds positions 0..pos-1
    drafts [B, K] i32: target-vocabulary drafts for positions pos+1..pos+K ([B, 0] with a tree; [B, K_max] with
      EngineSpec.state_k, of which the first `ready` were drafted for this pos)
    draft_probs [B, K, V] f32 or None: q of each draft (draft_sampling == "sample")
    out [B, N] i32: generated tokens (-1 padded); num_out [B] i32 valid entries
    done [B] bool; stop [B] i32 stop code (see STOP_NAMES)
    rounds [B] i32: rounds this row took part in (after prefill)
    num_drafts [B] i32: rounds that verified >= 1 draft (vLLM num_drafts)
    num_draft_tokens [B] i32: drafts (tree nodes) verified; accepted [B] i32: drafts accepted
    accepted_at [B, K] i32: rounds in which draft position i (tree: depth i + 1) was accepted
    tree: the `pjax.decode.tree.Tree` of N nodes the next round verifies (EngineSpec.tree_budget; of N_max with
      EngineSpec.state_tree, fresh where ready == K_max), or None
    ready [B] i32 or None (EngineSpec.state_k only): the leading drafts proposed for the current pos (the budget of
      the round that drafted them); a round verifies at most these (a switch to a larger budget verifies the fresh
      drafts only, once)
    tested_at [B, K_max] i32 or None (EngineSpec.state_k only): rounds in which draft position i was verified with
      drafts 0..i-1 accepted (accepted_at[i] / tested_at[i] is the conditional acceptance of position i)
    """
    target_cache: Any
    drafter_cache: Any
    last: Any
    pos: Any
    drafts: Any
    draft_probs: Optional[Any]
    out: Any
    num_out: Any
    done: Any
    stop: Any
    rounds: Any
    num_drafts: Any
    num_draft_tokens: Any
    accepted: Any
    accepted_at: Any
    tree: Optional[Any] = None
    ready: Optional[Any] = None
    tested_at: Optional[Any] = None


jax.tree_util.register_dataclass(
    DecodeState,
    data_fields=["target_cache", "drafter_cache", "last", "pos", "drafts", "draft_probs", "out", "num_out",
                 "done", "stop", "rounds", "num_drafts", "num_draft_tokens", "accepted", "accepted_at", "tree",
                 "ready", "tested_at"],
    meta_fields=[])


def add_batch_axis(tree):
    return jax.tree.map(lambda x: jnp.expand_dims(x, 0), tree)


def drop_batch_axis(tree):
    return jax.tree.map(lambda x: x[0], tree)

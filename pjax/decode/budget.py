"""A draft budget that follows the load: which K each device chunk of an "auto" engine runs
(`EngineConfig.num_speculative_tokens="auto"`).

The best K depends on the concurrency and on the acceptance: a round computes every slot of the engine, so at high
concurrency its cost grows with the positions verified and long drafts stop paying, and where no draft pays plain
decoding (K = 0) wins. The engine compiles one chunk program per candidate budget (`candidates`), all on one state
sized for K_max (`EngineSpec.state_k`), and before each chunk asks a `BudgetChooser` for K (host side; nothing
recompiles). The chooser's model:

- cost: t(k), seconds per round of budget k at the engine's slots, timed at warm-up on the compiled chunk programs
  (`set_warm_times`), then an exponentially weighted average of the chunk times seen while running
  (`observe_time`); a budget not run since warm-up is scaled by the average ratio of observed to warm-up times.
- gain: E(k) = 1 + sum_{i<=k} prod_{j<=i} alpha_j tokens per row and round, alpha_j the conditional acceptance of
  draft position j (accepted given drafts 1..j-1 were), from decayed counts of the rows' tested / accepted drafts
  (`observe_acceptance`); a position above the budgets in use keeps its last estimate (at first an optimistic
  prior), and every `explore_every` chunks the next larger budget runs once to refresh it.
- choice: argmax_k E(k) / t(k), switching only for a gain above `hysteresis`.

With `EngineConfig.tree_budget="auto"` the candidates also hold trees (`TreeBudget`: a round verifies the first n
nodes of the state's tree of N_max nodes). A tree's gain has no closed form: it is the measured tokens per row and
round of the chunks that ran it (`observe_tokens`, an exponentially weighted average; before any, E(K_max), the chain
of its depth), and the per-position acceptance is fed from chain chunks only. Exploration and hysteresis are the
chains', over the budgets ordered by the draft tokens they verify (chains before trees).
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Optional, Sequence

import numpy as np

__all__ = ["AUTO", "K_MAX", "BudgetChooser", "TreeBudget", "candidates", "draft_tokens", "expected_tokens", "is_auto",
           "label", "tree_candidates"]

AUTO = "auto"
K_MAX = 7  # the largest budget: P-EAGLE heads peak at K = 7 at concurrency 1, EAGLE-3 heads below it
CANDIDATES = (0, 1, 2, 3, 5, 7)  # the budgets an "auto" engine compiles, up to its K_max (which is always one)
TREE_CANDIDATES = (8, 16, 32)  # the tree budgets of tree_budget="auto", up to its N_max (which is always one)


@dataclasses.dataclass(frozen=True)
class TreeBudget:
    """A tree budget of tree_budget="auto": rounds verify the first `nodes` nodes of the state's tree (depth <=
    K_max). A chain budget is a plain int."""
    nodes: int

    def __str__(self) -> str:
        return f"tree {self.nodes}"


def label(budget):
    """A budget as a JSON value: the chain's K (int), or "tree N"."""
    return str(budget) if isinstance(budget, TreeBudget) else budget


def draft_tokens(budget) -> int:
    """The draft tokens a round of this budget verifies per row: K, or a tree's nodes."""
    return budget.nodes if isinstance(budget, TreeBudget) else budget


def _order(budget) -> tuple[int, int]:
    """Budgets ordered by the draft tokens a round verifies, chains before trees."""
    return draft_tokens(budget), isinstance(budget, TreeBudget)


def is_auto(value) -> bool:
    """Whether a num_speculative_tokens setting asks for a budget that follows the load."""
    return isinstance(value, str) and value == AUTO


def candidates(k_max: int) -> tuple[int, ...]:
    """The budgets of an "auto" engine drafting at most k_max tokens: CANDIDATES up to k_max, and k_max."""
    return tuple(sorted({k for k in CANDIDATES if k <= k_max} | {int(k_max)}))


def tree_candidates(k_max: int, n_max: int) -> tuple[TreeBudget, ...]:
    """The tree budgets of tree_budget="auto" with depth K_max and the state's tree of n_max nodes: TREE_CANDIDATES
    from K_max up to n_max, and n_max."""
    return tuple(TreeBudget(n) for n in sorted({n for n in TREE_CANDIDATES if k_max <= n <= n_max} | {int(n_max)}))


def expected_tokens(alpha: Sequence[float], k: int) -> float:
    """E(k) = 1 + sum_{i<=k} prod_{j<=i} alpha_j: the expected tokens a row emits in a round of k drafts, alpha [>= k]
    the conditional acceptance of each draft position (the first rejection ends the chain; the round's own token
    counts 1)."""
    return 1.0 + float(np.sum(np.cumprod(np.asarray(alpha, np.float64)[:k])))


class BudgetChooser:
    """The budget of each chunk (module docstring). budgets: the candidates, chains K (0 allowed) and `TreeBudget`s;
    prior: the acceptance assumed at every position before any is seen, worth `prior_weight` tested drafts; decay:
    the weight kept by the counts at each `observe_acceptance` (per chunk); smoothing: the weight of a new chunk
    time (and of a tree's new tokens per round); hysteresis: the relative gain a switch needs; explore_every: chunks
    between two runs of the next larger budget (0: never).
    Host-side state only; `choose` is called once per chunk."""

    def __init__(self, budgets: Sequence[int], *, prior: float = 0.8, prior_weight: float = 4.0, decay: float = 0.8,
                 smoothing: float = 0.2, hysteresis: float = 0.03, explore_every: int = 16):
        trees = tuple(sorted({b for b in budgets if isinstance(b, TreeBudget)}, key=_order))
        chains = tuple(sorted({int(k) for k in budgets if not isinstance(k, TreeBudget)}))
        if not chains or chains[0] < 0 or chains[-1] < 1 or any(t.nodes < chains[-1] for t in trees):
            raise ValueError(f"BudgetChooser: budgets must be integers >= 0, one of them >= 1, and trees of at least "
                             f"the largest of them nodes, got {tuple(map(label, budgets))}")
        for name, v in (("prior", prior), ("decay", decay), ("smoothing", smoothing)):
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"BudgetChooser: {name} must lie in [0, 1], got {v!r}")
        if prior_weight <= 0 or hysteresis < 0 or int(explore_every) != explore_every or explore_every < 0:
            raise ValueError(f"BudgetChooser: prior_weight must be > 0, hysteresis >= 0 and explore_every an integer "
                             f">= 0, got {prior_weight!r}, {hysteresis!r}, {explore_every!r}")
        self.budgets, self.k_max = chains + trees, chains[-1]  # ordered by the draft tokens a round verifies
        self.decay, self.smoothing, self.hysteresis, self.explore_every = decay, smoothing, hysteresis, explore_every
        self._accepted = np.full(self.k_max, prior * prior_weight, np.float64)
        self._tested = np.full(self.k_max, prior_weight, np.float64)
        self._warm: dict[int, float] = {}
        self._seconds: dict[int, float] = {}  # observed seconds per round, by budget (EWMA)
        self._ratio = 1.0  # observed / warm-up seconds (EWMA over every observed budget)
        self._tokens: dict[TreeBudget, float] = {}  # measured tokens per row and round, by tree budget (EWMA)
        self.current = self.k_max
        self._chunks = 0
        self.chunks = collections.Counter()  # chunks run, by budget

    # -- observations ----------------------------------------------------------------------------------------------
    def set_warm_times(self, seconds: dict[int, float]) -> None:
        """Seconds per round of each budget, timed at warm-up (every budget: a missing one is a ValueError)."""
        missing = set(self.budgets) - set(seconds)
        if missing:
            raise ValueError(f"BudgetChooser.set_warm_times: no time for budget(s) "
                             f"{[label(b) for b in sorted(missing, key=_order)]}")
        self._warm = {k: max(float(seconds[k]), 1e-9) for k in self.budgets}

    def observe_time(self, k: int, seconds_per_round: float) -> None:
        """A chunk of budget k ran at this many seconds per round."""
        s = self.smoothing
        before = self.round_seconds(k)
        self._seconds[k] = seconds_per_round if before is None else (1 - s) * before + s * seconds_per_round
        if k in self._warm:
            self._ratio = (1 - s) * self._ratio + s * seconds_per_round / self._warm[k]

    def observe_acceptance(self, accepted, tested) -> None:
        """Drafts since the last call, summed over rows: accepted [K_max] (rounds whose draft i was accepted) and
        tested [K_max] (rounds that verified draft i with drafts 0..i-1 accepted). The counts of a position tested
        here decay by `decay` first; a position not tested keeps its counts (its last estimate)."""
        accepted = np.asarray(accepted, np.float64)[:self.k_max]
        tested = np.asarray(tested, np.float64)[:self.k_max]
        keep = np.where(tested > 0, self.decay, 1.0)  # a position not tested keeps its estimate
        self._accepted = keep * self._accepted + accepted
        self._tested = keep * self._tested + tested

    def observe_tokens(self, tree: TreeBudget, tokens_per_round: float) -> None:
        """Chunks of tree budget `tree` emitted this many tokens per row and round."""
        s, before = self.smoothing, self._tokens.get(tree)
        self._tokens[tree] = tokens_per_round if before is None else (1 - s) * before + s * tokens_per_round

    # -- the model -------------------------------------------------------------------------------------------------
    @property
    def alpha(self) -> np.ndarray:
        """[K_max] the conditional acceptance of each draft position, as estimated now."""
        return np.clip(self._accepted / self._tested, 0.0, 1.0)

    def round_seconds(self, k: int) -> Optional[float]:
        """t(k): seconds per round of budget k (None before warm-up timing)."""
        if k in self._seconds:
            return self._seconds[k]
        return self._warm[k] * self._ratio if k in self._warm else None

    def gain(self, budget) -> float:
        """Expected tokens per row and round: E(k) of a chain, a tree's measured average (E(K_max) before any)."""
        if isinstance(budget, TreeBudget):
            return self._tokens.get(budget, expected_tokens(self.alpha, self.k_max))
        return expected_tokens(self.alpha, budget)

    def score(self, k) -> float:
        """gain / t(k): tokens per row and second (per round when no time is known)."""
        t = self.round_seconds(k)
        return self.gain(k) / (1.0 if t is None else t)

    def choose(self) -> int:
        """The budget of the next chunk: the best by `score` if it beats the current one by the hysteresis (then it
        becomes current), else the current one; every explore_every-th chunk the next one of `budgets` once."""
        best = max(self.budgets, key=self.score)
        if best != self.current and self.score(best) > (1.0 + self.hysteresis) * self.score(self.current):
            self.current = best
        self._chunks += 1
        k = self.current
        if self.explore_every and self._chunks % self.explore_every == 0 and k != self.budgets[-1]:
            k = self.budgets[self.budgets.index(k) + 1]
        self.chunks[k] += 1
        return k

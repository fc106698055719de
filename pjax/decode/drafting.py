"""The drafting strategy: how a round proposes its drafts. One enum, so a new kind of drafting (trees) plugs in here
and every check reads a property instead of comparing strings.

A member is a `str` ("parallel" == Drafting.PARALLEL), so settings, JSON records and CLI flags keep plain names.
"""
from __future__ import annotations

import enum
import warnings
from typing import Optional

from pjax.decode.budget import K_MAX
from pjax.decode.inputs import is_int
from pjax.models.drafter import Drafter, no_parallel_reason
from pjax.models.pairing import check_pair

__all__ = ["Drafting", "resolve"]


class Drafting(str, enum.Enum):
    """PARALLEL: P-EAGLE, one drafter pass proposes K tokens (mask tokens fill the unknown positions).
    SEQUENTIAL: EAGLE-3, K drafter passes. NONE: plain autoregressive decoding (no drafter)."""
    PARALLEL = "parallel"
    SEQUENTIAL = "sequential"
    NONE = "none"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value, where: str = "drafting") -> "Drafting":
        """A member from its name ("parallel" | "sequential" | "none"), or a ValueError naming `where`."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"{where}={value!r}: expected one of {cls.names()}") from None

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(m.value for m in cls)

    @classmethod
    def of_head(cls, drafter) -> "Drafting":
        """The drafting a head was built for: NONE without one, SEQUENTIAL for an EAGLE-3 head, else PARALLEL."""
        if drafter is None:
            return cls.NONE
        return cls.SEQUENTIAL if no_parallel_reason(drafter.config) else cls.PARALLEL

    @property
    def speculative(self) -> bool:
        """Rounds verify drafts (a drafter is needed)."""
        return self is not Drafting.NONE

    @property
    def one_pass(self) -> bool:
        """One drafter pass drafts every position (mask tokens; the drafter's K/V can be written in place)."""
        return self is Drafting.PARALLEL

    def default_k(self, drafter) -> int:
        """Drafts per round when none is asked for: P-EAGLE heads peak at K = 7 (at most the head's trained depth),
        EAGLE-3 heads at K = 3 in the published sweeps (spec/peagle.md); 0 without drafting."""
        if self is Drafting.NONE:
            return 0
        if self is Drafting.SEQUENTIAL:
            return 3
        depths = None if drafter is None else drafter.config.num_depths
        return 7 if depths is None else min(7, depths)

    def auto_k(self, drafter) -> int:
        """K_max of a budget that follows the load (`pjax.decode.budget`): `budget.K_MAX`, for P-EAGLE at most the
        head's trained depth; 0 without drafting."""
        if not self.speculative:
            return 0
        depths = None if drafter is None or self is Drafting.SEQUENTIAL else drafter.config.num_depths
        return K_MAX if depths is None else min(K_MAX, depths)

    def check_pair(self, target, drafter, k: int) -> tuple[int, ...]:
        """Host-side checks of a (target, drafter) pair for this drafting with K drafts (`pjax.models.pairing`, plus
        the parallel-drafting needs); returns the aux layer ids the drafter reads (() without drafting)."""
        if not self.speculative:
            return ()
        if drafter is None:
            raise ValueError(f"drafting={self.value!r} needs a drafter (load a head, or pass drafting='none' for "
                             "plain decoding)")
        if not isinstance(drafter, Drafter):
            raise TypeError(f"drafter must be a pjax Drafter (load one with pjax.load_drafter), got "
                            f"{type(drafter).__name__}")
        dcfg = drafter.config
        aux = check_pair(target.config, dcfg)
        if self.one_pass and k > 1 and no_parallel_reason(dcfg):
            raise ValueError(no_parallel_reason(dcfg) + "; use drafting='sequential'")
        if dcfg.num_depths is not None and self.one_pass and k > dcfg.num_depths:
            warnings.warn(f"num_speculative_tokens={k} exceeds the depth the head was trained for "
                          f"({dcfg.num_depths}); the drafts past it are extrapolated: check their acceptance per "
                          "position", stacklevel=5)
        return tuple(aux)


def resolve(drafter, drafting: Optional[str] = None, k: Optional[int] = None,
            k_name: str = "num_speculative_tokens") -> tuple[Drafting, int]:
    """(drafting, K): drafting None = the head's kind (`Drafting.of_head`); k None = `default_k`; k "auto" = `auto_k`
    (the largest budget of a budget that follows the load). K is 0 without drafting. A ValueError names `drafting` /
    `k` (as `k_name`) for a bad value or a drafting that needs a missing head."""
    mode = Drafting.of_head(drafter) if drafting is None else Drafting.parse(drafting)
    if not mode.speculative:
        return mode, 0
    if drafter is None:
        raise ValueError(f"drafting={mode.value!r} needs a drafter (load a head, or pass drafting='none')")
    if k is None:
        return mode, mode.default_k(drafter)
    if isinstance(k, str) and k == "auto":
        return mode, mode.auto_k(drafter)
    if not is_int(k) or k < 1:
        raise ValueError(f"{k_name} must be an integer >= 1 (draft tokens per round, drafting={mode.value!r}) or "
                         f"'auto', got {k!r}")
    return mode, int(k)

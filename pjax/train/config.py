"""Training configuration: everything static about a run (hashable; a static jit argument)."""
from __future__ import annotations

import dataclasses
from typing import Optional

from pjax.train.cod import CodConfig
from pjax.train.optim import OptimConfig

__all__ = ["OBJECTIVES", "TrainConfig"]

OBJECTIVES = ("peagle", "eagle3")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything static about a run (hashable).

    objective "peagle" (COD layout, spec D) or "eagle3" (training-time test with ttt_steps).
    batch_rows: packed rows per step (global; split over the data-parallel mesh).
    num_segments: sequence partitioning of each row (spec D.5; peagle only; 1 = single pass).
    compute_dtype: e.g. "bfloat16" to run the drafter in bf16 over float32 master weights.
    attn_chunk / loss_chunk / target_chunk: query / element chunk sizes (None = automatic).
    remat: P-EAGLE steps rematerialise each draft layer in the backward pass (only its input is stored; about one
      more head forward per step): what long rows need (a 16K row of an 8B target); False trades memory for speed.
    implementation: the kernel switch of the step: the target forward and the drafter's attention ("xla" |
      "pallas" | "auto", `pjax.kernels`).
    """
    objective: str = "peagle"
    total_seq_len: int = 2048
    batch_rows: int = 1
    total_steps: int = 1000
    cod: CodConfig = CodConfig()
    ttt_steps: int = 3
    ttt_step_loss_decay: float = 1.0
    loss_type: str = "kl"
    num_segments: int = 1
    optim: OptimConfig = OptimConfig()
    compute_dtype: Optional[str] = None
    attn_chunk: Optional[int] = None
    loss_chunk: Optional[int] = None
    target_chunk: Optional[int] = None
    remat: bool = True
    seed: int = 0
    implementation: str = "auto"

    def validate(self) -> "TrainConfig":
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective {self.objective!r} is not one of {OBJECTIVES}")
        if self.num_segments < 1 or (self.objective == "eagle3" and self.num_segments != 1):
            raise ValueError(f"num_segments={self.num_segments}: must be >= 1 (and 1 for the eagle3 objective)")
        if self.num_segments > self.total_seq_len:
            raise ValueError(f"num_segments={self.num_segments} exceeds total_seq_len={self.total_seq_len}")
        if self.ttt_steps < 1:
            raise ValueError(f"ttt_steps must be >= 1, got {self.ttt_steps}")
        self.cod.validate()
        return self

    @property
    def effective_optim(self) -> OptimConfig:
        """EAGLE-3 embeddings get no gradient (speculators): keep them out of the optimiser (no decay)."""
        if self.objective == "eagle3" and self.optim.train_embeddings:
            return dataclasses.replace(self.optim, train_embeddings=False)
        return self.optim

    @property
    def num_depths(self) -> int:
        return self.ttt_steps if self.objective == "eagle3" else self.cod.num_depths

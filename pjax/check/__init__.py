"""`python -m pjax check`: the correctness of pjax on the device it runs on, in three sections.

- `kernels` (`pjax.check.kernels`): each op through its public entry point with implementation = xla, pallas, auto
  and (cache attention, where the Mosaic GPU kernel runs) mosaic, against the op's jnp reference on the same device.
- `targets` (`pjax.check.targets`): tiny checkpoints of every target family written by transformers (random float32
  weights), loaded by pjax in float32, logits against transformers' float32 forward. Runs only where transformers and
  torch import (CPU torch is enough); elsewhere the section says it is skipped.
- `drafter` (`pjax.check.drafter`): a random P-EAGLE head over a KV cache against a float64 numpy forward.

Each row is one comparison with its bound (`pjax.check.report`); the command (`pjax.check.cli`) prints one table and
exits 1 on any failed row. Nothing here is imported by `import pjax`, and no module imports torch or transformers at
import time.
"""

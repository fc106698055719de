"""The README main job (examples/train_peagle.py) end to end, shortened: trains a tiny target and a P-EAGLE head,
exports the head (pjax.load_drafter reads it back), and speculative decoding reproduces plain greedy decoding with an
acceptance length only a trained head reaches.

Bounds measured 2026-11-24 (CPU, JAX 0.10.2, seed 0): 120 target + 60 head steps give an acceptance length of 2.63 at
K = 4; the same target with a one-step head gives 1.00 (the corpus then held `_sysconfigdata_*.py`; without it, as now,
the bound still holds on 2026-11-28). Fewer target steps (30-80) leave a degenerate target that
repeats one byte, where any head reaches the maximum (5.0), so the target is trained long enough to tell heads apart.
Measured 2026-11-28 (JAX 0.10.2): 120 target + 30 head steps give 3.04 at K = 4 (per-depth accuracy 0.58 ... 0.46); a
smaller target batch leaves the degenerate target (4 rows of 128 tokens: 4.79; 4 rows of 64: 4.96).
"""

import pytest
import pjax
from tests.engine_utils import fast_default_compiles
from tests.example_utils import load_example


# The README's example end to end (about 50 s): with --full; training a head that learns is checked by
# tests/test_parallel_consistency.py::test_tiny_pair_learns, greedy speculative == plain by the engine tests.
@pytest.mark.full
def test_main_job_short(tmp_path, monkeypatch):
    fast_default_compiles(monkeypatch)  # the acceptance check's decoding programs: compiled fast, run the same
    mod = load_example("train_peagle.py")
    out = tmp_path / "head"
    report = mod.tiny_job(["--target-steps", "120", "--steps", "30", "--no-progress", "--out", str(out)])
    assert report["identical_to_plain"] is True
    assert 2.0 <= report["acceptance_length"] <= 4.0, report["acceptance_length"]
    acc = report["head_history"][-1]["acc"]
    assert acc[0] > acc[-1] > 0.2  # deeper positions are harder, and still learned
    corpus = report["corpus"]  # what the number depends on, named in the report and printed
    assert len(corpus["sha256"]) == 64 and corpus["python"] and not any(f.startswith("_sysconfigdata")
                                                                       for f in corpus["files"])
    assert {"jax", "backend", "machine", "cpus"} <= set(report["environment"])
    head = pjax.load_drafter(out)
    assert head.config.num_aux == 3 and head.config.mask_token_id is not None

"""examples/benchmarks/gpu_check.py on CPU: the P-EAGLE head section (its float64 reference of the drafter forward
agrees with pjax's forward under every implementation) and the exit status (1 when a row misses its bound)."""

from tests.example_utils import load_example


def load():
    return load_example("benchmarks/gpu_check.py")


def test_drafter_section_passes_and_a_missed_bound_fails(tmp_path, monkeypatch):
    mod = load()
    assert mod.main(["--quick", "--only", "drafter", "--json", str(tmp_path / "rows.json")]) == 0
    rows = list(mod.ROWS)
    assert [r.impl for r in rows] == ["xla", "pallas", "auto"] and all(r.ok for r in rows)
    assert all(0 < r.rel_err <= 1e-5 for r in rows)  # float32 vs float64: real rounding, far below the bound
    assert "cache_attention" in rows[1].ran and rows[0].ran == "-"
    assert (tmp_path / "rows.json").exists()
    mod.ROWS.clear()
    monkeypatch.setattr(mod, "PARITY_BOUND", 1e-12)
    assert mod.main(["--quick", "--only", "drafter"]) == 1

"""Smoke test of examples/benchmarks/bench_train.py --tiny on CPU: each head objective and the remat switch reach the
step that is timed (one process per configuration, as on the GPU), and the result rows say what ran."""
import pytest
import json

from tests.example_utils import load_example


def load_bench():
    return load_example("benchmarks/bench_train.py")


# The benchmark script's run: with --full (the training steps it times are checked by the training tests).
@pytest.mark.full
def test_bench_train_heads_tiny(tmp_path):
    bench = load_bench()
    rows = []
    for extra in ([], ["--objective", "eagle3", "--no-remat", "--profile", "5"]):
        out = tmp_path / f"{len(extra)}.json"
        rows += bench.main(["--tiny", "--lm", "--lengths", "128", "--rows", "2", "--out", str(out), *extra])
        assert json.loads(out.read_text()) == rows[-1:]
    assert [(r["objective"], r["remat"]) for r in rows] == [("peagle", True), ("eagle3", False)], rows
    for r in rows:
        assert "error" not in r, r
        assert r["kind"] == "head" and r["rows"] == 2 and r["length"] == 128 and r["tokens_per_s"] > 0
        assert r["elements"] >= 2 * 128 * 3 // 4  # at least the supervised depth-0 elements (75% of the tokens)
        assert r["kernels"] == []  # no GPU: no kernel trace

"""Smoke test of examples/benchmarks/bench_generate.py --tiny on CPU: the prefill comparison (padded vs packed) runs
both layouts for each drafting mode and reports the positions each computed."""
import json

from tests.example_utils import load_example


def test_bench_generate_prefill_tiny(tmp_path):
    bench = load_example("benchmarks/bench_generate.py")
    out = tmp_path / "prefill.json"
    result = bench.main(["prefill", "--tiny", "--repeats", "1", "--prefill-batches", "4", "--prefill-median", "20",
                         "--prefill-longest", "40", "--out", str(out)])
    rows = result["prefill"]
    assert json.loads(out.read_text())["prefill"] == rows
    assert [r["drafting"] for r in rows] == ["none", "parallel"]
    lengths = bench.ragged_lengths(4, 20, 40)
    for r in rows:
        assert r["prompt_tokens"] == sum(lengths) and max(lengths) == 40
        assert r["padded_positions"] == 4 * 64  # 4 rows of the 40-token prompt's bucket
        assert r["packed_positions"] == 128  # the next power of two of the total
        assert r["padded_ms"] > 0 and r["packed_ms"] > 0

"""Smoke tests of examples/benchmarks/bench_generate.py --tiny on CPU: the host time of a generation's start; the
prefill comparison (padded vs packed) runs both layouts for each drafting mode and reports the positions each
computed."""
import json

import pytest

from tests.engine_utils import fast_default_compiles
from tests.example_utils import load_example


@pytest.fixture(autouse=True)
def _fast(monkeypatch):
    fast_default_compiles(monkeypatch)  # the script takes no compiler options


# The benchmark script's runs: with --full (the engine and prefill they time are checked by the engine tests).
@pytest.mark.full
def test_bench_generate_prefill_tiny(tmp_path):
    bench = load_example("benchmarks/bench_generate.py")
    out = tmp_path / "prefill.json"
    result = bench.main(["prefill", "--tiny", "--repeats", "1", "--prefill-batches", "4", "--prefill-median", "20",
                         "--prefill-longest", "40", "--k", "3", "--out", str(out)])
    res = result["prefill"]
    assert json.loads(out.read_text())["prefill"] == res
    rows = res["generate"]
    assert [r["drafting"] for r in rows] == ["none", "parallel"]
    lengths = bench.ragged_lengths(4, 20, 40)
    for r in rows:
        assert r["prompt_tokens"] == sum(lengths) and max(lengths) == 40
        assert r["padded_positions"] == 4 * 64  # 4 rows of the 40-token prompt's bucket
        assert r["packed_positions"] == 128  # the next power of two of the total
        assert r["padded_ms"] > 0 and r["packed_ms"] > 0
    # per drafting mode, one admission (the prefill) per layout and the chunk ending early (a prefill's few new
    # tokens never outlive a chunk, so the fixed-trip chunk is not built)
    assert res["programs_compiled"] == {"admit": 4, "chunk_ending": 2}


# With --full, as above.
@pytest.mark.full
def test_bench_generate_host_tiny(tmp_path, monkeypatch):
    """The host mode times a generation's start at each shape's layer count with tiny widths, for the three drafting
    modes, and nothing compiles while it is timed (every call after the warm-up finds its programs)."""
    from pjax.decode.compiled import compile_count
    bench = load_example("benchmarks/bench_generate.py")
    counts = []
    real = bench.precompile
    monkeypatch.setattr(bench, "precompile", lambda *a, **kw: (real(*a, **kw), counts.append(compile_count()))[0])
    rows = bench.main(["host", "--shapes", "tiny", "--repeats", "1", "--k", "3", "--prompt-len", "8",
                       "--new-tokens", "8", "--out", str(tmp_path / "host.json")])["host"]["rows"]
    assert [(r["drafting"], r["layers"]) for r in rows] == [("none", 2), ("parallel", 2), ("sequential", 2)]
    assert all(r["host_ms"] > 0 and r["arrays"] > 0 for r in rows)
    assert len(counts) == 3 * 11
    for i in range(3):  # per mode: the warm-up, then 10 timed calls that compile nothing
        assert len(set(counts[i * 11:(i + 1) * 11])) == 1

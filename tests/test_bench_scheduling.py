"""examples/benchmarks/bench_scheduling.py on a tiny target (CPU): the free-slot measurement's rows and JSON."""
import json

from tests.example_utils import load_example


def test_free_slots_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    bench = load_example("benchmarks/bench_scheduling.py")
    out = bench.main(["--only", "free", "--shape", "tiny", "--concurrency", "2", "--slots", "4", "--prompts", "3",
                      "--prompt-len", "8", "--new-tokens", "4", "--fill-new", "6", "--repeats", "2"])
    assert out["ratio"] == [] and out["gap"] == []
    assert [(r["concurrency"], r["slots"], len(r["runs"])) for r in out["free"]] == [(2, 2, 2), (2, 4, 2)]
    assert all(r["tok_s"] > 0 for r in out["free"])
    assert json.loads((tmp_path / "bench_scheduling.json").read_text())["free"] == out["free"]

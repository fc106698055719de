"""Smoke test of examples/benchmarks/bench_target.py --tiny on CPU, with its byte accounting checked
against hand-counted parameter sizes."""
import json

import pytest

from tests.example_utils import load_example


def load_bench():
    return load_example("benchmarks/bench_target.py")


def test_bench_target_tiny(tmp_path):
    bench = load_bench()
    report = bench.main(["--tiny", "--repeats", "3", "--json", str(tmp_path / "b.json")])
    assert json.loads((tmp_path / "b.json").read_text())["rows"] == report["rows"]
    rows = {(r["model"], r["step"]): r for r in report["rows"]}
    assert set(rows) == {(m, s) for m in ("llama-tiny", "qwen3-moe-tiny") for s in ("decode", "extend")}
    h, bf16 = 64, 2
    cap, ctx = 32 + 8, 32
    kv_per_token = 2 * 2 * 16 * bf16  # one layer, K and V, 2 kv heads, head_dim 16
    attn = h * 64 + 2 * h * 32 + 64 * h  # q, k, v, o
    for t, step in ((1, "decode"), (8, "extend")):
        # Llama: 1 layer (attention + dense MLP I=128 + 2 norms), final norm, lm_head [64, 257], T embedding rows
        dense = attn + 3 * h * 128 + 2 * h + h + h * 257 + t * h
        r = rows[("llama-tiny", step)]
        assert r["weight_bytes"] == dense * bf16
        assert r["kv_read_bytes"] == cap * kv_per_token and r["kv_write_bytes"] == t * kv_per_token
        assert r["bytes"] == r["weight_bytes"] + r["kv_read_bytes"] + r["kv_write_bytes"]
        # Qwen3-MoE: q/k norms (16 each), router [64, 8], distinct experts of 8 (top-2) x (gate_up 64x64 + down 32x64)
        experts = 8 * (1 - (1 - 2 / 8) ** t)
        moe = attn + 2 * 16 + h * 8 + experts * (h * 64 + 32 * h) + 2 * h + h + h * 257 + t * h
        assert rows[("qwen3-moe-tiny", step)]["weight_bytes"] == pytest.approx(moe * bf16, abs=1)
        for r in (rows[("llama-tiny", step)], rows[("qwen3-moe-tiny", step)]):
            assert r["context"] == ctx
            assert r["roofline_ms"] == pytest.approx(1e3 * r["bytes"] / report["copy_bandwidth_Bps"])
            # timings: ordered percentiles, a tiny step well under a second, fractions consistent with the times
            assert 0 < r["p10_ms"] <= r["median_ms"] <= r["p90_ms"] < 1000
            assert 0 < r["pipelined_ms"] < 1000
            assert r["roofline_fraction"] == pytest.approx(r["roofline_ms"] / r["pipelined_ms"])
            assert r["sync_fraction"] == pytest.approx(r["roofline_ms"] / r["median_ms"])
    # the extend step reads the same weights plus 7 more embedding rows and KV writes: more bytes than decode
    for m in ("llama-tiny", "qwen3-moe-tiny"):
        assert rows[(m, "extend")]["bytes"] > rows[(m, "decode")]["bytes"]
    assert report["copy_bandwidth_Bps"] > 1e8  # any machine copies faster than 100 MB/s

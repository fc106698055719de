"""Smoke test of examples/benchmarks/bench_target.py --tiny on CPU, with its byte accounting checked
against hand-counted parameter sizes."""
import json

import pytest

from tests.example_utils import load_example


def load_bench():
    return load_example("benchmarks/bench_target.py")


def test_bench_target_tiny(tmp_path):
    import jax
    bench = load_bench()
    report = bench.main(["--tiny", "--repeats", "3", "--profile", "--json", str(tmp_path / "b.json")])
    assert json.loads((tmp_path / "b.json").read_text())["rows"] == report["rows"]
    rows = {(r["model"], r["step"]): r for r in report["rows"]}
    assert set(rows) == {(m, s) for m in ("tiny", "tiny-moe-mxfp4") for s in ("decode", "extend")}
    h, bf16, layers = 64, 2, 4
    cap, ctx = 32 + 8, 32
    kv_per_token = layers * 2 * 2 * 16 * bf16  # K and V, 2 kv heads, head_dim 16
    attn = h * 64 + 2 * h * 32 + 64 * h  # q, k, v, o
    # tiny-moe-mxfp4 (GPT-OSS layers): attention biases and sinks, router [64, 8] + bias, 8 experts top-4 with biases,
    # packed MXFP4 experts (H / 2 bytes + H / 32 scales per output column)
    moe_attn = attn + 64 + 2 * 32 + h + 4
    packed = 8 * (2 * 64 * (h // 2 + h // 32) + h * (64 // 2 + 64 // 32))
    expert_biases = 8 * (2 * 64 + h) * bf16
    for t, step in ((1, "decode"), (8, "extend")):
        # Llama: 4 layers (attention + dense MLP I=128 + 2 norms), final norm, lm_head [64, 512], T embedding rows
        dense = layers * (attn + 3 * h * 128 + 2 * h) + h + h * 512 + t * h
        r = rows[("tiny", step)]
        assert r["weight_bytes"] == dense * bf16
        assert r["kv_read_bytes"] == cap * kv_per_token and r["kv_write_bytes"] == t * kv_per_token
        assert r["bytes"] == r["weight_bytes"] + r["kv_read_bytes"] + r["kv_write_bytes"]
        touched = 8 * (1 - (1 - 4 / 8) ** t) / 8  # the expected share of distinct experts read
        rest = layers * (moe_attn + h * 8 + 8 + 2 * h) + h + h * 512 + t * h
        want = rest * bf16 + layers * (packed + expert_biases) * touched
        assert rows[("tiny-moe-mxfp4", step)]["weight_bytes"] == pytest.approx(want, abs=layers)
        for r in (rows[("tiny", step)], rows[("tiny-moe-mxfp4", step)]):
            assert r["context"] == ctx
            assert r["roofline_ms"] == pytest.approx(1e3 * r["bytes"] / report["copy_bandwidth_Bps"])
            # timings: ordered percentiles, a tiny step well under a second, fractions consistent with the times
            assert 0 < r["p10_ms"] <= r["median_ms"] <= r["p90_ms"] < 1000
            assert 0 < r["pipelined_ms"] < 1000
            assert r["roofline_fraction"] == pytest.approx(r["roofline_ms"] / r["pipelined_ms"])
            assert r["sync_fraction"] == pytest.approx(r["roofline_ms"] / r["median_ms"])
            assert r["process_peak_device_bytes"] == (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    # the extend step reads the same weights plus 7 more embedding rows and KV writes: more bytes than decode
    for m in ("tiny", "tiny-moe-mxfp4"):
        assert rows[(m, "extend")]["bytes"] > rows[(m, "decode")]["bytes"]
    assert report["copy_bandwidth_Bps"] > 1e8  # any machine copies faster than 100 MB/s


def test_bench_checkpoint_writes_what_the_loader_reads(tmp_path):
    """examples/benchmarks/bench_checkpoint.py on the tiny MXFP4 shape: the checkpoint it writes (the GPT-OSS layout,
    two shards) loads with every tensor found and shaped as the loader expects, its experts stay packed with native
    weights and dequantise to what the dequantized load holds (e2m1 codes x 2**-6: |w| <= 6 / 64), and a generation
    runs on it."""
    import jax
    import numpy as np

    import pjax
    from pjax.kernels.quantized import dequantize
    bench = load_example("benchmarks/bench_checkpoint.py")
    out = bench.main(["--shape", "tiny-moe-mxfp4", "--dir", str(tmp_path / "ckpt"), "--new-tokens", "4",
                      "--shard-gb", str(300e3 / 2 ** 30)])
    assert out["written"]["shards"] == 2 and out["generate_tok_s"] > 0 and out["host_peak_bytes"] > 0
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
    assert len(index["weight_map"]) == out["written"]["tensors"]
    native = pjax.load_target(tmp_path / "ckpt", weights="native")
    plain = pjax.load_target(tmp_path / "ckpt", weights="dequantized")
    for i in native.params["layers"]:
        for name in ("gate_up", "down"):
            packed, dense = native.params["layers"][i]["mlp"][name], plain.params["layers"][i]["mlp"][name]
            assert packed.format == "mxfp4" and packed.data.dtype == np.uint8
            got = np.asarray(dequantize(packed), np.float32)
            np.testing.assert_array_equal(got, np.asarray(dense, np.float32))
            assert 0.04 < np.abs(got).max() <= 6 / 64
    attn = [jax.tree.leaves(t.params["layers"][0]["self_attn"]) for t in (native, plain)]
    assert all(np.array_equal(a, b) for a, b in zip(*attn)) and len(attn[0]) == len(attn[1]) > 4

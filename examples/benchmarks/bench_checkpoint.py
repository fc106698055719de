"""A GPT-OSS checkpoint as it ships (MXFP4 experts), written with random weights, then loaded and run.

    PYTHONPATH=. python3 examples/benchmarks/bench_checkpoint.py --shape gpt-oss-120b --dir DIR  # ~65 GB on disk
    PYTHONPATH=. python3 examples/benchmarks/bench_checkpoint.py --shape tiny-moe-mxfp4 --dir DIR  # CPU smoke run

Writes DIR in the Hugging Face layout of openai/gpt-oss-*: config.json (the published config of the shape,
`pjax.bench.models`, with `quantization_config` mxfp4), safetensors shards of at most --shard-gb and their index;
experts as `*_blocks` [E, out, in / 32, 16] (e2m1 pairs) and `*_scales` [E, out, in / 32] (e8m0) of random codes
(scales giving the dense weights' ~0.02 spread), every other tensor random bf16. Shards are written one at a time:
the host never holds more than one. Then `pjax.load_target(DIR, weights=--weights)`: load seconds, the process's
peak host memory, the device's bytes in use and peak; then `pjax.generate` with a random 4-layer P-EAGLE head (K = 3,
acceptance simulated) for --new-tokens tokens of one 128-token prompt. Prints and writes JSON
($OUT/bench_checkpoint.json when $OUT is set). An existing DIR with a config.json is loaded as it is (no rewrite).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pjax  # noqa: E402
from pjax.bench.models import PACKED_SHAPES, RANDOM_SHAPES, random_head  # noqa: E402
from pjax.bench.simulate import SimulatedAcceptance  # noqa: E402
from pjax.checkpoint.hf import hf_name  # noqa: E402
from pjax.models.families import config_from_hf  # noqa: E402
from pjax.models.paths import param_path  # noqa: E402
from pjax.models.target import abstract_target  # noqa: E402

SCALE_CODE = 121  # e8m0 exponent 2**-6: e2m1 codes (|v| <= 6) times it spread like N(0, 0.02)
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def tensor_specs(hf: dict) -> list[tuple[str, tuple, str]]:
    """(HF tensor name, shape, kind) of every tensor of a GPT-OSS checkpoint of config `hf`; kind "blocks" /
    "scales" (uint8), "norm" (ones), "bias" (zeros) or "weight" (random)."""
    cfg = config_from_hf(hf, "bench_checkpoint")
    e, h, i = cfg.moe.num_experts, cfg.hidden_size, cfg.moe.intermediate_size
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_target(cfg, jnp.bfloat16).params)[0]:
        p = tuple(map(str, param_path(path)))
        if len(p) == 4 and p[0] == "layers" and p[2] == "mlp":
            base = f"model.layers.{p[1]}.mlp.experts"
            if p[3] in ("gate_up", "down"):
                rows, cols = (2 * i, h) if p[3] == "gate_up" else (h, i)
                name = f"{base}.{p[3]}_proj"
                out += [(name + "_blocks", (e, rows, cols // 32, 16), "blocks"),
                        (name + "_scales", (e, rows, cols // 32), "scales")]
            else:
                out.append((f"{base}.{p[3][:-5]}_proj_bias", (e, 2 * i if p[3] == "gate_up_bias" else h), "bias"))
            continue
        name, transpose = hf_name(p, "model.", "gpt_oss")
        shape = tuple(leaf.shape[::-1]) if transpose else tuple(leaf.shape)
        kind = "norm" if "norm" in name else "bias" if name.endswith("bias") else "weight"
        out.append((name, shape, kind))
    return out


def _random(shape, kind: str, rng) -> np.ndarray:
    if kind == "blocks":
        return rng.integers(0, 256, shape, dtype=np.uint8)
    if kind == "scales":
        return np.full(shape, SCALE_CODE, np.uint8)
    if kind == "norm":
        return np.ones(shape, ml_dtypes.bfloat16)
    if kind == "bias":
        return np.zeros(shape, ml_dtypes.bfloat16)
    return (rng.standard_normal(shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16)


def write_checkpoint(path: Path, hf: dict, shard_bytes: int, seed: int = 0) -> dict:
    """Write the checkpoint (shards written one at a time, then the index and config.json); returns sizes."""
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    specs = tensor_specs(hf)
    groups, size = [[]], 0
    for spec in specs:
        n = int(np.prod(spec[1])) * (1 if spec[2] in ("blocks", "scales") else 2)
        if groups[-1] and size + n > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(spec)
        size += n
    weight_map, total = {}, 0
    for j, group in enumerate(groups):
        fname = f"model-{j + 1:05d}-of-{len(groups):05d}.safetensors"
        shard = {name: _random(shape, kind, rng) for name, shape, kind in group}
        total += sum(v.nbytes for v in shard.values())
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
        del shard
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                    "weight_map": weight_map}))
    config = dict(hf, architectures=["GptOssForCausalLM"], torch_dtype="bfloat16",
                  quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED})
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return {"tensors": len(specs), "shards": len(groups), "bytes": total}


def _device_bytes() -> dict:
    stats = jax.devices()[0].memory_stats() or {}
    return {k: stats[k] for k in ("bytes_in_use", "peak_bytes_in_use") if k in stats}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="gpt-oss-120b", choices=[k for k, (_, f) in PACKED_SHAPES.items()
                                                                 if f == "mxfp4"])
    ap.add_argument("--dir", required=True, type=Path)
    ap.add_argument("--shard-gb", type=float, default=4.0)
    ap.add_argument("--weights", default="native", choices=["native", "dequantized"])
    ap.add_argument("--new-tokens", type=int, default=64)
    a = ap.parse_args(argv)
    out = {"shape": a.shape, "device": jax.devices()[0].device_kind}
    if not (a.dir / "config.json").exists():
        t0 = time.perf_counter()
        out["written"] = write_checkpoint(a.dir, RANDOM_SHAPES[PACKED_SHAPES[a.shape][0]], int(a.shard_gb * 2 ** 30))
        out["write_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    target = pjax.load_target(a.dir, weights=a.weights, verify=False)
    jax.block_until_ready(target.params)
    out.update(load_s=time.perf_counter() - t0, weights=a.weights,
               host_peak_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               device_after_load=_device_bytes())
    head = random_head(target, "4", parallel=True, dtype=jnp.bfloat16, shape=PACKED_SHAPES[a.shape][0])
    prompt = np.random.default_rng(1).integers(0, target.config.vocab_size, 128).tolist()
    kw = dict(max_new_tokens=a.new_tokens, drafting="parallel", num_speculative_tokens=3,
              acceptance=SimulatedAcceptance((0.75, 0.67, 0.64)))
    pjax.generate(target, head, [prompt], **kw)  # compile and warm up
    t0 = time.perf_counter()
    res = pjax.generate(target, head, [prompt], **kw)
    seconds = time.perf_counter() - t0
    out.update(generate_tok_s=len(res.tokens[0]) / seconds, mean_acceptance_length=res.stats.get(
        "mean_acceptance_length"), device_after_generate=_device_bytes(),
        host_peak_bytes_after_generate=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    print(json.dumps(out, indent=1))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_checkpoint.json").write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()

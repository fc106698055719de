"""Probe (not part of pjax): the 445M batch-1 decode step under variants that change its kernels.

    PYTHONPATH=. python examples/benchmarks/launch_probe.py VARIANT [SHAPES] [MODES]

VARIANT: "default" (pjax as is); "no-pad" (`pjax.models.layers.Linear` without its one-row pad); "no-select" (the
batch-1 cache write as a bare in-place update, without the select that drops invalid tokens: NOT exact for invalid
writes, an upper bound only); "opt:NAME" (XLA compiler option NAME set to true for the decode programs).
SHAPES (default llama-445m) and MODES (default none,parallel,sequential) as in bench_generate.py. Prints, per
shape and drafting mode, the median ms per round over 5 generations of 256 tokens (K = 7) and, from one traced
generation, kernels per round and the GPU's busy fraction; the plain step's most launched kernels. One variant per
process (the compiled-program cache does not see the patches).
"""
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.profiler import ProfileData  # noqa: E402

import pjax  # noqa: E402
from bench_generate import SHAPES, models, prompts, timed  # noqa: E402
from devtime import _gpu_kernel_events  # noqa: E402
from pjax.models import cache as C  # noqa: E402
from pjax.models import layers as L  # noqa: E402


def patch(variant: str):
    """Apply the variant; returns the decode programs' compiler options."""
    if variant == "no-pad":
        L.Linear.__call__ = lambda self, x, out_sharding=None: nnx.Linear.__call__(self, x, out_sharding)
    elif variant == "no-select":
        general = C.LayerKV.write

        def write(self, k_new, v_new, positions, valid=None):
            if positions.shape != (1, 1):
                return general(self, k_new, v_new, positions, valid)
            at = jnp.clip(positions[0, 0], 0, self.k.shape[1] - 1)
            put = lambda b, n: jax.lax.dynamic_update_slice_in_dim(b, n.astype(b.dtype), at, axis=1)  # noqa: E731
            return C.LayerKV(put(self.k, k_new), put(self.v, v_new))
        C.LayerKV.write = write
    elif variant.startswith("opt:"):
        return {variant[4:]: True}
    elif variant != "default":
        raise SystemExit(f"unknown variant {variant!r}")
    return None


def main():
    variant = sys.argv[1]
    shapes = (sys.argv[2] if len(sys.argv) > 2 else "llama-445m").split(",")
    modes = (sys.argv[3] if len(sys.argv) > 3 else "none,parallel,sequential").split(",")
    opts = patch(variant)
    for shape in shapes:
        target, peagle = models(shape, {"llama-445m": 2, "llama3.1-8b": 4, "tiny": 1}[shape], peagle=True)
        eagle3 = models(shape, 1, peagle=False)[1] if "sequential" in modes else None
        ps = prompts(1, 128, SHAPES[shape][-1])
        for mode in modes:
            d = {"none": None, "parallel": peagle, "sequential": eagle3}[mode]
            kw = dict(max_new_tokens=256, chunk_seconds=None, drafting=mode, num_speculative_tokens=7,
                      compiler_options=opts)
            m = timed(target, d, ps, repeats=5, **kw)
            with tempfile.TemporaryDirectory() as t:
                jax.profiler.start_trace(t)
                rounds = pjax.generate(target, d, ps, **kw).stats["rounds"]
                jax.profiler.stop_trace()
                files = sorted(Path(t).rglob("*.xplane.pb"))
                ev = _gpu_kernel_events(ProfileData.from_file(str(files[-1]))) if files else []
            row = {"variant": variant, "shape": shape, "drafting": mode, "ms_per_round": m["decode_ms_per_round"]}
            if ev:
                busy, span = sum(e - s for s, e, _ in ev), ev[-1][1] - ev[0][0]
                row.update(kernels_per_round=len(ev) / rounds, busy_fraction=busy / span)
            print(json.dumps(row), flush=True)
            if ev and mode == "none":
                kinds = {}
                for s, e, n in ev:
                    k = kinds.setdefault(n, [0, 0])
                    k[0], k[1] = k[0] + 1, k[1] + e - s
                for n, (c, tt) in sorted(kinds.items(), key=lambda kv: -kv[1][0])[:20]:
                    print(f"   {c / rounds:6.2f} x {tt / c / 1e3:6.2f} us  {n[:100]}")


if __name__ == "__main__":
    main()

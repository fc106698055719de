"""How fast could the batch-1 Mosaic cache attention be if its consumers did no math?

    PYTHONPATH=.:examples/benchmarks python3 examples/benchmarks/attention_bound.py  # Hopper GPU, JAX >= 0.11, ~3 min

Why: at batch 1 (16 splits per KV head = 128 programs; Llama geometry with 22 draft queries, GPT-OSS with 12
verify queries) the op stays under 70% of HBM bandwidth. This probe separates the kernel's streaming structure from
its math. It builds variants of `pjax/kernels/cache_attention/mosaic.py` by patching its source text: a consumer
marked *idle* keeps every barrier handshake of its step (ring slots, turn-taking) but issues no wgmma and runs no
softmax, so the producer, the ring, the prologue and the epilogue stay as landed. With both consumers idle the
split kernel moves the same bytes through the same pipeline and computes nothing: a floor for this design. The patch
anchors are asserted, so a change to `mosaic.py` that moves them fails here (and in the test that builds the
variants) instead of measuring something else. Timing as `bench_kernels.timed`: a chain of copies with their own
K/V, the profiler's kernel durations and the device span per copy, median of 20 calls. Results: docs/benchmarks.md
section 2.
"""
from __future__ import annotations

import importlib.util
import pathlib
import sys
import tempfile

SOURCE = pathlib.Path(__file__).resolve().parents[2] / "pjax/kernels/cache_attention/mosaic.py"
STEP = "            def step(i, carry, masked):\n"  # the rows consumer's step, then the swapped (columns) one's
IDLE = """                if IDLE_{n}:  # probe: the step's barrier handshakes only
                    slot = lax.rem(i, stages)
                    plgpu.barrier_wait(k_full.at[slot])
                    take_turn()
                    plgpu.barrier_arrive(k_free.at[slot])
                    plgpu.barrier_arrive(turn)
                    plgpu.barrier_wait(v_full.at[slot])
                    plgpu.barrier_wait(turn)
                    plgpu.barrier_arrive(v_free.at[slot])
                    return carry
"""
ANCHOR = "LOG2E = 1.4426950408889634\n"
VARIANTS = {"landed": (False, False), "rows consumer idle": (True, False), "columns consumer idle": (False, True),
            "both idle": (True, True)}


def variant(idle_rows: bool, idle_cols: bool):
    """The landed `mosaic` module with the chosen consumers idle (see the module docstring)."""
    src = SOURCE.read_text()
    if src.count(STEP) != 2 or src.count(ANCHOR) != 1:
        raise RuntimeError(f"{SOURCE}: expected 2 consumer steps ({STEP.strip()!r}) and one {ANCHOR.strip()!r}; "
                           "update this probe's patch anchors")
    first = src.index(STEP) + len(STEP)
    second = src.index(STEP, first) + len(STEP)
    src = src[:first] + IDLE.format(n=0) + src[first:second] + IDLE.format(n=1) + src[second:]
    src = src.replace(ANCHOR, ANCHOR + f"IDLE_0, IDLE_1 = {idle_rows}, {idle_cols}\n")
    with tempfile.TemporaryDirectory(prefix="pjax_attention_bound_") as tmp:
        path = pathlib.Path(tmp) / "mosaic_variant.py"
        path.write_text(src)
        spec = importlib.util.spec_from_file_location(f"mosaic_variant_{int(idle_rows)}{int(idle_cols)}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    return mod


# (heads, head_dim, queries, swapped second consumer, contexts); without the swap both consumers run the rows step
GEOMETRIES = {"Llama T=22": (32, 128, 22, True, (8192, 16384, 32768)), "GPT-OSS T=12": (64, 64, 12, False, (16384,))}


def main():
    import jax
    import jax.numpy as jnp

    import bench_kernels as bk
    from pjax.kernels.cache_attention import pallas as attn_pallas
    from pjax.kernels.cache_attention import reference as attn_ref

    nkv = 8
    mods = {name: variant(*flags) for name, flags in VARIANTS.items()}
    print(f"{jax.devices()[0].device_kind}, JAX {jax.__version__}, batch 1, 16 splits per KV head")
    print("| shape | variant | context | split kernel (us) | span per copy (us) | % of 4.34 TB/s (span) |")
    print("|---|---|---|---|---|---|")
    for shape, (nh, hd, t, swap, contexts) in GEOMETRIES.items():
        # without the swap the rows step is both consumers': "rows consumer idle" is already "both idle"
        names = list(mods) if swap else ["landed", "both idle"]
        for ctx in contexts:
            q, k, v, q_pos, sets, _, _ = bk._attention_inputs(1, ctx, t, nh, nkv, hd, 4)
            kv_bytes = 2 * ctx * nkv * hd * 2
            part = lambda m, q_, k_, v_, stages=2: m.partials(q_, k_, v_, q_pos, scale=hd ** -0.5, splits=16,
                                                              swap=swap, stages=stages)
            ops = {name: (lambda q_, k_, v_, m=mods[name]: part(m, q_, k_, v_)) for name in names}
            if ctx == 16384:  # the whole op (split kernel + Triton merge), landed and no math, for each ring depth
                for stages in (2, 3, 4):  # that fits in shared memory (2: the default)
                    for name in ("landed", "both idle"):
                        if mods[name].unsupported_reason(q, k, stages=stages, swap=swap) is None:
                            ops[f"{name}, whole op" + (f", {stages} stages" if stages != 2 else "")] = (
                                lambda q_, k_, v_, m=mods[name], s=stages: attn_pallas.merge(
                                    *part(m, q_, k_, v_, s), t=t, nh=nh, hd=hd, sinks=None, dtype=q_.dtype))
                # the patched landed variant still computes attention
                want = attn_ref.cache_attention(q, k, v, q_pos, scale=hd ** -0.5).astype(jnp.float32)
                got = jax.jit(ops["landed, whole op"])(q, k, v).astype(jnp.float32)
                print(f"| {shape} | landed, max abs error vs reference: {float(jnp.max(jnp.abs(got - want))):.1e} |")
            for name, op in ops.items():
                span, split = bk.chain_times(op, sets, calls=20, kernel="mosaic")
                print(f"| {shape} | {name} | {ctx} | {split:.2f} | {span:.2f} | "
                      f"{kv_bytes / (span * 1e-6) / 4.34e12:.1%} |", flush=True)
            del q, k, v, sets


if __name__ == "__main__":
    sys.exit(main())

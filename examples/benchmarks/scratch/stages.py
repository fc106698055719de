import statistics, sys
import jax, jax.numpy as jnp
sys.path.insert(0, "examples/benchmarks")
import bench_kernels as bk
from devtime import profile_calls
from attention_bound import variant
from pjax.kernels.cache_attention import pallas as attn_pallas, reference as attn_ref

mods = {"landed": variant(False, False), "idle": variant(True, True)}
for shape, (nh, hd, t, swap) in {"GPT-OSS": (64, 64, 12, False), "Llama rows": (32, 128, 22, False),
                                 "Llama swap": (32, 128, 22, True)}.items():
    q, k, v, q_pos, sets, _, _ = bk._attention_inputs(1, 16384, t, nh, 8, hd, 4)
    half = len(sets) // 2
    want = attn_ref.cache_attention(q, k, v, q_pos, scale=hd ** -0.5).astype(jnp.float32)
    for stages in (2, 3, 4):
        for name, m in mods.items():
            reason = m.unsupported_reason(q, k, stages=stages, swap=swap)
            if reason:
                print(shape, stages, name, "skip", reason); continue
            op = lambda q_, k_, v_, m=m, stages=stages: attn_pallas.merge(*m.partials(q_, k_, v_, q_pos, scale=hd ** -0.5, splits=16, swap=swap, stages=stages), t=t, nh=nh, hd=hd, sinks=None, dtype=q_.dtype)
            try:
                err = float(jnp.max(jnp.abs(jax.jit(op)(q, k, v).astype(jnp.float32) - want)))
                prog = jax.jit(lambda s, op=op: [op(*a) for a in s])
                spans, kernels = profile_calls(prog, (sets[:half],), calls=20)
                split = statistics.median(d for ks in kernels for n, _, d in ks if "mosaic" in n) / 1e3
                span = statistics.median(spans) / half / 1e3
                print(f"| {shape} | stages {stages} | {name} | split {split:.2f} | op {span:.2f} | {2*16384*8*hd*2/(span*1e-6)/4.34e12:.1%} | err {err:.1e} |", flush=True)
            except Exception as ex:
                print(shape, stages, name, "failed", str(ex)[:200], flush=True)
    del q, k, v, sets

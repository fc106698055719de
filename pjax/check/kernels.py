"""`python -m pjax check`, section `kernels`: each op through its public entry point with every implementation
against the op's jnp reference computed on the same device.

Cache attention at decode / verify / draft shapes (bf16 and float32, sliding windows, sinks, ragged kv_len, GQA
geometries of Llama and GPT-OSS, a prefill-sized shape that "pallas" sends to the reference; "mosaic" too where the
Mosaic GPU kernel runs), training attention (output and q / k / v / sinks gradients: packed documents with the Pallas
kernel, windows, sinks, causal rows with cuDNN), the MoE expert matmul at few-pair shapes (and one past the kernel's
128 pairs), acceptance (greedy, sampled, top-k / top-p, sampled drafts with their probabilities; integer outputs must
be equal) and the drafter-input metadata (equal). Float32 products run at full precision (the command's setting), so
float32 kernels must match to F32_BOUND; bf16 attention to BF16_ATTN_BOUND absolute, the bf16 expert matmul to
BF16_REL_BOUND relative.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pjax.check.report import BF16_ATTN_BOUND, BF16_REL_BOUND, F32_BOUND, Report, float_errors, kernels_in
from pjax.kernels import IMPLEMENTATIONS, accept, attention, build_draft_inputs, cache_attention, causal_mask
from pjax.kernels import document_mask, expert_matmul, grouped_matmul
from pjax.kernels.acceptance import reference as acc_ref
from pjax.kernels.cache_attention import mosaic
from pjax.kernels.cache_attention import reference as attn_ref
from pjax.kernels.expert_matmul import reference as em_ref
from pjax.kernels.grouped_matmul import mosaic as gm_mosaic
from pjax.kernels.grouped_matmul import reference as gm_ref
from pjax.kernels.metadata import reference as meta_ref
from pjax.kernels.quantized import dequantize, random_weight

__all__ = ["CHECKS"]


def mosaic_interpret_runs() -> bool:
    """Mosaic GPU kernels run in interpret mode on a CPU from JAX 0.11 on."""
    return tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 11)


def attention_cases(quick):
    """(label, b, t, nh, nkv, hd, s, dtype, window, sinks, ragged)."""
    if quick:
        return [("verify f32", 2, 4, 8, 2, 32, 150, jnp.float32, None, False, False),
                ("verify K=11 MQA sinks ragged", 3, 12, 4, 1, 16, 97, jnp.bfloat16, None, True, True),
                ("draft window ragged", 2, 6, 6, 3, 24, 80, jnp.bfloat16, 16, False, True),
                ("draft f32 window sinks", 1, 14, 4, 2, 64, 70, jnp.float32, 8, True, False),
                ("draft K=11 88 rows", 1, 22, 8, 2, 128, 256, jnp.bfloat16, None, False, True),
                ("prefill-sized (160 rows)", 1, 40, 8, 2, 16, 64, jnp.float32, None, False, False)]
    return [("decode llama", 4, 1, 32, 8, 128, 4096, jnp.bfloat16, None, False, True),
            ("verify K=3 llama", 1, 4, 32, 8, 128, 8192, jnp.bfloat16, None, False, False),
            ("draft K=11 llama ragged", 8, 22, 32, 8, 128, 4096, jnp.bfloat16, None, False, True),
            ("draft K=11 llama 16K", 1, 22, 32, 8, 128, 16384, jnp.bfloat16, None, False, False),
            ("verify K=11 gpt-oss window sinks", 2, 12, 64, 8, 64, 4096, jnp.bfloat16, 128, True, True),
            ("verify K=7 f32 qwen3", 2, 8, 32, 4, 128, 2048, jnp.float32, None, False, True),
            ("draft K=7 f32 window sinks", 1, 14, 16, 4, 64, 1024, jnp.float32, 256, True, True),
            ("prefill-sized (256 rows)", 1, 64, 32, 8, 128, 1024, jnp.bfloat16, None, False, False)]


def check_attention(report: Report, quick: bool) -> None:
    on_mosaic = mosaic.available() or (jax.default_backend() != "gpu" and mosaic_interpret_runs())
    for i, (label, b, t, nh, nkv, hd, s, dtype, window, sinks, ragged) in enumerate(attention_cases(quick)):
        kq, kk, kv_, ks, kl = jax.random.split(jax.random.key(i), 5)
        q = jax.random.normal(kq, (b, t, nh, hd), jnp.float32).astype(dtype)
        k = jax.random.normal(kk, (b, s, nkv, hd), jnp.float32).astype(dtype)
        v = jax.random.normal(kv_, (b, s, nkv, hd), jnp.float32).astype(dtype)
        lengths = jax.random.randint(kl, (b,), t, s + 1) if ragged else jnp.full((b,), s, jnp.int32)
        q_pos = (lengths[:, None] - t + jnp.arange(t)[None]).astype(jnp.int32)
        kw = dict(scale=hd ** -0.5, window=window, sinks=jax.random.normal(ks, (nh,)) if sinks else None,
                  kv_len=lengths.astype(jnp.int32) if ragged else None)
        want = jax.jit(lambda *a: attn_ref.cache_attention(*a, **kw))(q, k, v, q_pos)
        shape = f"{label}: B={b} T={t} {nh}/{nkv}x{hd} S={s} {jnp.dtype(dtype).name}"
        impls = list(IMPLEMENTATIONS) + (["mosaic"] if on_mosaic and mosaic.unsupported_reason(q, k) is None else [])
        for impl in impls:
            fn = lambda *a, impl=impl: cache_attention(*a, **kw, implementation=impl)  # noqa: E731
            abs_err, rel = float_errors(jax.jit(fn)(q, k, v, q_pos), want)
            if dtype == jnp.float32:
                bound, ok = f"rel<={F32_BOUND}", rel <= F32_BOUND
            else:
                bound, ok = f"abs<={BF16_ATTN_BOUND}", abs_err <= BF16_ATTN_BOUND
            report.record("kernels", "cache_attention", impl, shape, abs_err=abs_err, rel_err=rel, bound=bound, ok=ok,
                          ran=kernels_in(fn, q, k, v, q_pos))


def flash_cases(quick):
    """(label, b, t, nh, nkv, hd, dtype, layout, window, sinks): layout "docs" (packed documents with padding: the
    Pallas kernel) or "causal" (one sequence per row, ragged lengths: cuDNN under "auto")."""
    if quick:
        return [("docs f32", 2, 80, 4, 2, 16, jnp.float32, "docs", None, False),
                ("docs bf16 window sinks", 2, 80, 4, 1, 32, jnp.bfloat16, "docs", 24, True),
                ("causal bf16", 2, 64, 4, 2, 64, jnp.bfloat16, "causal", None, False)]
    return [("target LM docs (445M geometry)", 2, 2048, 16, 8, 64, jnp.bfloat16, "docs", None, False),
            ("docs f32 GQA 4", 1, 1000, 8, 2, 128, jnp.float32, "docs", None, False),
            ("docs window sinks (GPT-OSS)", 1, 1536, 8, 1, 64, jnp.bfloat16, "docs", 128, True),
            ("causal rows (cuDNN)", 2, 2048, 16, 8, 64, jnp.bfloat16, "causal", None, False),
            ("causal rows window (cuDNN)", 2, 1024, 8, 2, 128, jnp.bfloat16, "causal", 256, False)]


def check_flash_attention(report: Report, quick: bool) -> None:
    """Training attention: the output and the gradients of q, k, v (and sinks) of each implementation against the
    query-chunked jnp reference on the same device."""
    for i, (label, b, t, nh, nkv, hd, dtype, layout, window, sinks) in enumerate(flash_cases(quick)):
        rng = np.random.default_rng(i)
        q, k, v = (jnp.asarray(rng.normal(size=(b, t, n, hd)), jnp.float32).astype(dtype) for n in (nh, nkv, nkv))
        sk = jnp.asarray(rng.normal(size=(nh,)), jnp.float32) if sinks else None
        if layout == "docs":  # three documents and a padded tail per row
            cuts = sorted(rng.choice(np.arange(8, t - 8), 3, replace=False))
            doc = np.full((b, t), -1)
            for j, (a, e) in enumerate(zip([0] + cuts[:2], cuts)):
                doc[:, a:e] = j
            mask = document_mask(doc)
            live = doc != -1
        else:
            lengths = np.array([t - 8 * j for j in range(b)])
            mask = causal_mask(lengths, t)
            live = np.arange(t)[None] < lengths[:, None]
        w = jnp.asarray(rng.normal(size=(b, t, nh, hd)) * live[..., None, None], jnp.float32)
        argnums = (0, 1, 2, 3) if sinks else (0, 1, 2)

        def run(impl):
            def f(q, k, v, sk):
                return attention(q, k, v, mask, scale=hd ** -0.5, window=window, sinks=sk, implementation=impl)
            out = jax.jit(f)(q, k, v, sk)
            grads = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) * w), argnums=argnums))(
                q, k, v, sk)
            return out, grads

        want, want_grads = run("xla")
        shape = f"{label}: B={b} T={t} {nh}/{nkv}x{hd} {jnp.dtype(dtype).name}" + (f" window {window}" if window
                                                                                     else "")
        impls = ["pallas", "auto"] + (["cudnn"] if layout == "causal" and jax.default_backend() == "gpu" and
                                      dtype != jnp.float32 else [])
        bound = F32_BOUND * 10 if dtype == jnp.float32 else BF16_ATTN_BOUND
        for impl in impls:
            got, grads = run(impl)
            pairs = [("out", got, want)] + [(f"d{n}", g, gw) for n, g, gw in zip("qkvs", grads, want_grads)]
            for name, g, gw in pairs:
                g, gw = np.asarray(g, np.float64), np.asarray(gw, np.float64)
                if name == "out":
                    g, gw = g[live], gw[live]
                abs_err, rel = float_errors(g, gw)
                report.record("kernels", f"flash_attention {name}", impl, shape, abs_err=abs_err, rel_err=rel,
                              bound=f"rel<={bound}", ok=rel <= bound)


def expert_cases(quick):
    """(label, tokens, top_k, experts, din, dout, dtype, packed format or None)."""
    if quick:
        return [("f32", 4, 2, 8, 64, 96, jnp.float32, None), ("bf16", 3, 2, 8, 48, 64, jnp.bfloat16, None),
                ("past 128 pairs", 65, 2, 8, 32, 48, jnp.float32, None),
                ("MXFP4", 2, 2, 4, 96, 64, jnp.bfloat16, "mxfp4"), ("FP8", 3, 2, 4, 128, 64, jnp.bfloat16, "fp8")]
    return [("qwen3-30b-a3b gate_up decode", 1, 8, 128, 2048, 1536, jnp.bfloat16, None),
            ("qwen3-30b-a3b down verify K=7", 8, 8, 128, 768, 2048, jnp.bfloat16, None),
            ("gpt-oss-20b gate_up decode", 1, 4, 32, 2880, 5760, jnp.bfloat16, None),
            ("gpt-oss-20b down verify K=3", 4, 4, 32, 2880, 2880, jnp.bfloat16, None),
            ("f32 verify K=3", 4, 4, 16, 512, 256, jnp.float32, None),
            ("past 128 pairs", 40, 4, 32, 256, 256, jnp.bfloat16, None),
            ("gpt-oss-20b gate_up decode MXFP4", 1, 4, 32, 2880, 5760, jnp.bfloat16, "mxfp4"),
            ("gpt-oss-20b down verify K=7 MXFP4", 8, 4, 32, 2880, 2880, jnp.bfloat16, "mxfp4"),
            ("qwen3-30b-a3b gate_up verify K=3 FP8", 4, 8, 128, 2048, 1536, jnp.bfloat16, "fp8")]


def _weights(key, x, e, din, dout, fmt):
    """Random expert weights [e, din, dout] of x's dtype (packed for fmt), and the (activations, dense stack) the
    reference multiplies: packed weights exactly dequantised, in float32."""
    if fmt is None:
        w = (jax.random.normal(key, (e, din, dout), jnp.float32) * din ** -0.5).astype(x.dtype)
        return w, (x, w)
    w = random_weight(key, (e, din, dout), fmt)
    return w, (x.astype(jnp.float32), dequantize(w))


def check_expert_matmul(report: Report, quick: bool) -> None:
    for i, (label, n, top, e, din, dout, dtype, fmt) in enumerate(expert_cases(quick)):
        kx, kw_, ki = jax.random.split(jax.random.key(100 + i), 3)
        x = jax.random.normal(kx, (n, din), jnp.float32).astype(dtype)
        w, (xr, dense) = _weights(kw_, x, e, din, dout, fmt)
        ids = jnp.argsort(jax.random.uniform(ki, (n, e)), axis=1)[:, :top].reshape(-1).astype(jnp.int32)
        want = jax.jit(functools.partial(em_ref.expert_matmul, repeat=top))(xr, ids, dense)
        shape = f"{label}: {n} tokens x top-{top} of {e}, {din}x{dout} {jnp.dtype(dtype).name}"
        bound = F32_BOUND if dtype == jnp.float32 else BF16_REL_BOUND
        for impl in IMPLEMENTATIONS:
            fn = lambda *a, impl=impl: expert_matmul(*a, repeat=top, implementation=impl)  # noqa: E731
            abs_err, rel = float_errors(jax.jit(fn)(x, ids, w), want)
            report.record("kernels", "expert_matmul", impl, shape, abs_err=abs_err, rel_err=rel,
                          bound=f"rel<={bound}", ok=rel <= bound, ran=kernels_in(fn, x, ids, w))


def grouped_cases(quick):
    """(label, rows, experts, din, dout, dtype, packed format or None, one expert's rows or None): uniform random
    routing (expert 0 empty) or every row to one expert, and rows past the groups."""
    if quick:
        return [("f32", 70, 4, 64, 48, jnp.float32, None, None),
                ("MXFP4", 80, 4, 96, 64, jnp.bfloat16, "mxfp4", None),
                ("FP8", 80, 4, 128, 64, jnp.bfloat16, "fp8", None)]
    return [("gpt-oss-20b gate_up, c = 64 verify K = 3", 1024, 32, 2880, 5760, jnp.bfloat16, None, None),
            ("gpt-oss-20b gate_up MXFP4, c = 64 verify K = 3", 1024, 32, 2880, 5760, jnp.bfloat16, "mxfp4", None),
            ("qwen3-30b-a3b gate_up FP8, prefill 1K", 8192, 128, 2048, 1536, jnp.bfloat16, "fp8", None),
            ("FP8 partial tiles", 1000, 8, 200, 136, jnp.bfloat16, "fp8", None),
            ("qwen3-30b-a3b down, c = 8 verify K = 3", 256, 128, 768, 2048, jnp.bfloat16, None, None),
            ("gpt-oss-20b down, odd rows, partial column tiles", 333, 32, 2880, 2880, jnp.bfloat16, None, None),
            ("one expert takes every row", 300, 8, 128, 192, jnp.bfloat16, None, 5),
            ("f32 down", 2048, 16, 512, 256, jnp.float32, None, None)]


def check_grouped_matmul(report: Report, quick: bool) -> None:
    for i, (label, m, e, din, dout, dtype, fmt, one) in enumerate(grouped_cases(quick)):
        kx, kw_ = jax.random.split(jax.random.key(200 + i))
        x = jax.random.normal(kx, (m, din), jnp.float32).astype(dtype)
        w, (xr, dense) = _weights(kw_, x, e, din, dout, fmt)
        ids = np.full(m - 5, one) if one is not None else np.random.default_rng(i).integers(1, e, m - 5)
        sizes = jnp.asarray(np.bincount(ids, minlength=e), jnp.int32)  # 5 rows past the groups
        want = jax.jit(gm_ref.grouped_matmul)(xr, dense, sizes)
        shape = f"{label}: {m} rows over {e} experts, {din}x{dout} {jnp.dtype(dtype).name}"
        bound = F32_BOUND if dtype == jnp.float32 else BF16_REL_BOUND
        on_mosaic = gm_mosaic.available() and gm_mosaic.unsupported_reason(x, w) is None
        for impl in list(IMPLEMENTATIONS) + (["mosaic"] if on_mosaic else []):
            fn = lambda *a, impl=impl: grouped_matmul(*a, implementation=impl)  # noqa: E731
            abs_err, rel = float_errors(jax.jit(fn)(x, w, sizes), want)
            report.record("kernels", "grouped_matmul", impl, shape, abs_err=abs_err, rel_err=rel,
                          bound=f"rel<={bound}", ok=rel <= bound, ran=kernels_in(fn, x, w, sizes))


def acceptance_cases(quick):
    """(label, b, k, v, dtype, mode): mode greedy | sampled | mixed (per-row temperatures, a quarter greedy, top-k /
    top-p) | q (sampled drafts with their probabilities)."""
    v = 300 if quick else 128256
    return [("greedy", 1 if quick else 8, 3, v, jnp.bfloat16, "greedy"),
            ("sampled", 3, 7, v, jnp.float32, "sampled"),
            ("mixed top-k top-p", 4 if quick else 16, 5, v, jnp.bfloat16, "mixed"),
            ("sampled drafts + draft_probs", 2 if quick else 8, 3, v, jnp.float32, "q"),
            ("K=0 plain sample", 2, 0, v, jnp.float32, "sampled")]


def acceptance_inputs(seed, b, k, v, dtype, mode):
    ks = jax.random.split(jax.random.key(seed), 6)
    logits = (jax.random.normal(ks[0], (b, k + 1, v), jnp.float32) * 3).astype(dtype)
    am = jnp.argmax(logits.astype(jnp.float32), -1).astype(jnp.int32)
    prefix = jax.random.randint(ks[1], (b, 1), 0, k + 1)
    drafts = jnp.where(jnp.arange(k)[None] < prefix, am[:, :k], jax.random.randint(ks[2], (b, k), 0, v))
    temperature = {"greedy": jnp.zeros((b,)), "sampled": jnp.ones((b,)), "q": jnp.full((b,), 0.8)}.get(
        mode, jnp.where(jnp.arange(b) % 4 == 3, 0.0, jax.random.uniform(ks[3], (b,), jnp.float32, 0.2, 2.0)))
    q = jax.nn.softmax(jax.random.normal(ks[4], (b, k, v)) * 2, -1) if mode == "q" else None
    kw = dict(temperature=temperature.astype(jnp.float32), seeds=jnp.arange(b, dtype=jnp.uint32) * 7919,
              positions=jax.random.randint(ks[5], (b,), 0, 5000), num_drafts=jnp.full((b,), k, jnp.int32),
              top_k=jnp.where(jnp.arange(b) % 2 == 0, 50, 0).astype(jnp.int32) if mode == "mixed" else None,
              top_p=jnp.where(jnp.arange(b) % 3 == 0, 0.9, 1.0).astype(jnp.float32) if mode == "mixed" else None)
    return logits, drafts.astype(jnp.int32), q, kw


def integer_mismatch(got, want) -> float:
    """Fraction of rows where any of the integer outputs differ."""
    rows = [np.any(np.asarray(g).reshape(len(np.asarray(w)), -1) != np.asarray(w).reshape(len(np.asarray(w)), -1),
                   axis=1) for g, w in zip(got, want)]
    return float(np.mean(np.any(np.stack(rows), axis=0)))


def check_acceptance(report: Report, quick: bool) -> None:
    for i, (label, b, k, v, dtype, mode) in enumerate(acceptance_cases(quick)):
        logits, drafts, q, kw = acceptance_inputs(200 + i, b, k, v, dtype, mode)
        want = jax.jit(lambda lg, d, q_: acc_ref.accept(lg, d, q_, **kw))(logits, drafts, q)
        shape = f"{label}: B={b} K={k} V={v} {jnp.dtype(dtype).name}"
        for impl in IMPLEMENTATIONS:
            fn = lambda lg, d, q_, impl=impl: accept(lg, d, q_, **kw, implementation=impl)  # noqa: E731
            bad = integer_mismatch(jax.jit(fn)(logits, drafts, q), want)
            report.record("kernels", "accept", impl, shape, abs_err=bad, rel_err=bad, bound="rows equal",
                          ok=bad == 0, ran=kernels_in(fn, logits, drafts, q))


def check_metadata(report: Report, quick: bool) -> None:
    for i, (b, k) in enumerate([(1, 3), (5, 7)] if quick else [(1, 3), (8, 7), (64, 11), (3, 1)]):
        ks = jax.random.split(jax.random.key(300 + i), 4)
        args = (jax.random.randint(ks[0], (b,), 0, k + 1), jax.random.randint(ks[1], (b, k + 1), 0, 128000),
                jax.random.randint(ks[2], (b,), 0, 128000), jax.random.randint(ks[3], (b,), 0, 9000))
        kw = dict(num_slots=2 * k + 1, mask_token_id=128002)
        want = jax.jit(lambda *a: meta_ref.build_draft_inputs(*a, **kw))(*args)
        for impl in IMPLEMENTATIONS:
            fn = lambda *a, impl=impl: build_draft_inputs(*a, **kw, implementation=impl)  # noqa: E731
            bad = integer_mismatch(jax.jit(fn)(*args), want)
            report.record("kernels", "build_draft_inputs", impl, f"B={b} K={k} slots={2 * k + 1}", abs_err=bad,
                          rel_err=bad, bound="rows equal", ok=bad == 0, ran=kernels_in(fn, *args))


CHECKS = (check_attention, check_flash_attention, check_expert_matmul, check_grouped_matmul, check_acceptance,
          check_metadata)

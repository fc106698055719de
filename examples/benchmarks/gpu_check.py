"""Correctness check of pjax on this device: every kernel with every implementation against its reference, every
target family against transformers in float32, and a P-EAGLE head against a float64 reference of its forward.

    python examples/benchmarks/gpu_check.py            # GPU: representative shapes (an H200: about 3 minutes)
    python examples/benchmarks/gpu_check.py --quick    # tiny shapes: a fast GPU pass, or a CPU run (interpret
                                                       # mode, about 5 minutes on 2 cores)

1. Kernels: each op through its public entry point with implementation = xla, pallas, auto and (cache attention,
   where the Mosaic GPU kernel runs) mosaic, against the op's jnp reference computed on the same device:
   cache attention at decode / verify / draft shapes (bf16 and float32, sliding windows, sinks, ragged kv_len, GQA
   geometries of Llama and GPT-OSS, a prefill-sized shape that "pallas" sends to the reference), training attention
   (output and q / k / v / sinks gradients: packed documents with the Pallas kernel, windows, sinks, causal rows with
   cuDNN), the MoE expert matmul at few-pair shapes (and one past the kernel's 128 pairs), acceptance (greedy,
   sampled, top-k / top-p, sampled drafts with their probabilities; integer outputs must be equal), the
   drafter-input metadata (equal).
   The "ran" column lists the Pallas kernels the traced call contains.
2. Targets: llama, qwen3, qwen3_moe, gpt_oss and gemma4 tiny checkpoints written by transformers (random float32
   weights), loaded by pjax in float32; a ragged-free cached prefill, a verify-sized extend (K + 1 = 4 tokens: the
   MoE layers take the few-pair expert-matmul path) and a decode step with each implementation, logits against
   transformers' float32 forward: relative error (Frobenius) <= 1e-4.
3. Drafter: a random 2-layer P-EAGLE head (parallel slots with the mask token and mask feature) over a KV cache with
   each implementation, draft logits against a float64 numpy forward written from the parameters: <= 1e-4.
Float32 products run at full precision (jax_default_matmul_precision = "highest", the engine's setting for float32
models), so float32 kernels must match the reference to 1e-5 (max abs error / max |reference|); bf16 attention to
2e-2 absolute (unit-normal inputs), bf16 expert matmul to 1e-2 relative.
Prints one table (op, implementation, shape, max abs / relative error, bound, pass); exits 1 on any failure.
Needs transformers and torch (CPU torch is enough) for section 2; --json PATH writes the rows.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pjax.kernels import IMPLEMENTATIONS  # noqa: E402
from pjax.kernels.acceptance import accept  # noqa: E402
from pjax.kernels.acceptance import reference as acc_ref  # noqa: E402
from pjax.kernels.cache_attention import cache_attention, mosaic  # noqa: E402
from pjax.kernels.cache_attention import reference as attn_ref  # noqa: E402
from pjax.kernels.expert_matmul import expert_matmul  # noqa: E402
from pjax.kernels.expert_matmul import reference as em_ref  # noqa: E402
from pjax.kernels.metadata import build_draft_inputs  # noqa: E402
from pjax.kernels.metadata import reference as meta_ref  # noqa: E402
from tests.kernel_jaxpr import pallas_kernel_names  # noqa: E402

F32_BOUND, BF16_ATTN_BOUND, BF16_REL_BOUND, PARITY_BOUND = 1e-5, 2e-2, 1e-2, 1e-4


@dataclasses.dataclass
class Row:
    section: str
    op: str
    impl: str
    shape: str
    abs_err: float
    rel_err: float
    bound: str
    ok: bool
    ran: str = ""


ROWS: list[Row] = []


def mosaic_interpret_runs() -> bool:
    """Mosaic GPU kernels run in interpret mode on a CPU from JAX 0.11 on."""
    return tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 11)


def log(*a):
    print(*a, flush=True)


def record(section, op, impl, shape, *, abs_err, rel_err, bound: str, ok: bool, ran=""):
    row = Row(section, op, impl, shape, float(abs_err), float(rel_err), bound, bool(ok), ran)
    ROWS.append(row)
    log(f"| {op} | {impl} | {shape} | {row.abs_err:.2e} | {row.rel_err:.2e} | {bound} | "
        f"{'pass' if ok else 'FAIL'} | {ran} |")


def float_errors(got, want):
    """(max abs error, max abs error / max |want|)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = float(np.max(np.abs(got - want))) if got.size else 0.0
    return err, err / max(float(np.max(np.abs(want))), 1e-30)


def frobenius_rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def kernels_in(fn, *args) -> str:
    names = sorted({n.removeprefix("pjax_") for n in pallas_kernel_names(fn, *args)})
    return ",".join(names) or "-"


# ---------------------------------------------------------------- 1. kernels
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


def check_attention(quick):
    on_mosaic = mosaic.available() or (jax.default_backend() != "gpu" and mosaic_interpret_runs())
    for i, (label, b, t, nh, nkv, hd, s, dtype, window, sinks, ragged) in enumerate(attention_cases(quick)):
        key = jax.random.key(i)
        kq, kk, kv_, ks, kl = jax.random.split(key, 5)
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
            fn = lambda *a, impl=impl: cache_attention(*a, **kw, implementation=impl)
            got = jax.jit(fn)(q, k, v, q_pos)
            abs_err, rel = float_errors(got, want)
            if dtype == jnp.float32:
                record("kernels", "cache_attention", impl, shape, abs_err=abs_err, rel_err=rel,
                       bound=f"rel<={F32_BOUND}", ok=rel <= F32_BOUND, ran=kernels_in(fn, q, k, v, q_pos))
            else:
                record("kernels", "cache_attention", impl, shape, abs_err=abs_err, rel_err=rel,
                       bound=f"abs<={BF16_ATTN_BOUND}", ok=abs_err <= BF16_ATTN_BOUND,
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


def check_flash_attention(quick):
    """Training attention: the output and the gradients of q, k, v (and sinks) of each implementation against the
    query-chunked jnp reference on the same device (float32 products at full precision)."""
    from pjax.kernels.flash_attention import attention, causal_mask, document_mask
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
        for impl in impls:
            got, grads = run(impl)
            pairs = [("out", got, want)] + [(f"d{n}", g, gw) for n, g, gw in zip("qkvs", grads, want_grads)]
            for name, g, gw in pairs:
                g, gw = np.asarray(g, np.float64), np.asarray(gw, np.float64)
                if name == "out":
                    g, gw = g[live], gw[live]
                abs_err, rel = float_errors(g, gw)
                bound = F32_BOUND * 10 if dtype == jnp.float32 else BF16_ATTN_BOUND
                record("kernels", f"flash_attention {name}", impl, shape, abs_err=abs_err, rel_err=rel,
                       bound=f"rel<={bound}", ok=rel <= bound)


def expert_cases(quick):
    """(label, tokens, top_k, experts, din, dout, dtype)."""
    if quick:
        return [("f32", 4, 2, 8, 64, 96, jnp.float32), ("bf16", 3, 2, 8, 48, 64, jnp.bfloat16),
                ("past 128 pairs", 65, 2, 8, 32, 48, jnp.float32)]
    return [("qwen3-30b-a3b gate_up decode", 1, 8, 128, 2048, 1536, jnp.bfloat16),
            ("qwen3-30b-a3b down verify K=7", 8, 8, 128, 768, 2048, jnp.bfloat16),
            ("gpt-oss-20b gate_up decode", 1, 4, 32, 2880, 5760, jnp.bfloat16),
            ("gpt-oss-20b down verify K=3", 4, 4, 32, 2880, 2880, jnp.bfloat16),
            ("f32 verify K=3", 4, 4, 16, 512, 256, jnp.float32),
            ("past 128 pairs", 40, 4, 32, 256, 256, jnp.bfloat16)]


def check_expert_matmul(quick):
    for i, (label, n, top, e, din, dout, dtype) in enumerate(expert_cases(quick)):
        kx, kw_, ki = jax.random.split(jax.random.key(100 + i), 3)
        x = jax.random.normal(kx, (n, din), jnp.float32).astype(dtype)
        w = (jax.random.normal(kw_, (e, din, dout), jnp.float32) * din ** -0.5).astype(dtype)
        ids = jnp.argsort(jax.random.uniform(ki, (n, e)), axis=1)[:, :top].reshape(-1).astype(jnp.int32)
        want = jax.jit(functools.partial(em_ref.expert_matmul, repeat=top))(x, ids, w)
        shape = f"{label}: {n} tokens x top-{top} of {e}, {din}x{dout} {jnp.dtype(dtype).name}"
        for impl in IMPLEMENTATIONS:
            fn = lambda *a, impl=impl: expert_matmul(*a, repeat=top, implementation=impl)
            abs_err, rel = float_errors(jax.jit(fn)(x, ids, w), want)
            bound = F32_BOUND if dtype == jnp.float32 else BF16_REL_BOUND
            record("kernels", "expert_matmul", impl, shape, abs_err=abs_err, rel_err=rel, bound=f"rel<={bound}",
                   ok=rel <= bound, ran=kernels_in(fn, x, ids, w))


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


def check_acceptance(quick):
    for i, (label, b, k, v, dtype, mode) in enumerate(acceptance_cases(quick)):
        logits, drafts, q, kw = acceptance_inputs(200 + i, b, k, v, dtype, mode)
        want = jax.jit(lambda lg, d, q_: acc_ref.accept(lg, d, q_, **kw))(logits, drafts, q)
        shape = f"{label}: B={b} K={k} V={v} {jnp.dtype(dtype).name}"
        for impl in IMPLEMENTATIONS:
            fn = lambda lg, d, q_, impl=impl: accept(lg, d, q_, **kw, implementation=impl)
            bad = integer_mismatch(jax.jit(fn)(logits, drafts, q), want)
            record("kernels", "accept", impl, shape, abs_err=bad, rel_err=bad, bound="rows equal", ok=bad == 0,
                   ran=kernels_in(fn, logits, drafts, q))


def check_metadata(quick):
    for i, (b, k) in enumerate([(1, 3), (5, 7)] if quick else [(1, 3), (8, 7), (64, 11), (3, 1)]):
        ks = jax.random.split(jax.random.key(300 + i), 4)
        args = (jax.random.randint(ks[0], (b,), 0, k + 1), jax.random.randint(ks[1], (b, k + 1), 0, 128000),
                jax.random.randint(ks[2], (b,), 0, 128000), jax.random.randint(ks[3], (b,), 0, 9000))
        kw = dict(num_slots=2 * k + 1, mask_token_id=128002)
        want = jax.jit(lambda *a: meta_ref.build_draft_inputs(*a, **kw))(*args)
        for impl in IMPLEMENTATIONS:
            fn = lambda *a, impl=impl: build_draft_inputs(*a, **kw, implementation=impl)
            bad = integer_mismatch(jax.jit(fn)(*args), want)
            record("kernels", "build_draft_inputs", impl, f"B={b} K={k} slots={2 * k + 1}", abs_err=bad, rel_err=bad,
                   bound="rows equal", ok=bad == 0, ran=kernels_in(fn, *args))


# ---------------------------------------------------------------- 2. targets vs transformers
def check_targets(quick):
    import torch
    import transformers

    import pjax
    from pjax.models.cache import init_cache
    from pjax.models.target import forward, logits_from_hidden
    from tests.engine_utils import AVAILABLE, FAMILIES
    from tests.hf_utils import hf_logits, randomize

    transformers.utils.logging.disable_progress_bar()
    prefill, extends = 12, (4, 1)  # a verify of K + 1 = 4 tokens, then a decode step
    total = prefill + sum(extends)
    for name in AVAILABLE:
        model_cls, cfg_cls, kw = FAMILIES[name]
        if name == "gpt_oss" and not _reads_swiglu_limit():
            kw = dict(kw, swiglu_limit=7.0)  # this transformers hard-codes the clamp at 7.0 and ignores the config's
        torch.manual_seed(0)
        model = randomize(model_cls(cfg_cls(**kw)).float().eval(), std=0.2)
        ids = np.random.default_rng(1).integers(0, kw["vocab_size"], (1, total))
        ref = hf_logits(model, ids)
        with tempfile.TemporaryDirectory() as path:
            model.save_pretrained(path)
            target = pjax.load_target(path, dtype=jnp.float32)
        for impl in IMPLEMENTATIONS:
            step = jax.jit(functools.partial(forward, implementation=impl))
            cache = init_cache(target.config, 1, 32, jnp.float32)
            start, worst, worst_abs, ran = 0, 0.0, 0.0, set()
            for n in (prefill,) + extends:
                toks = jnp.asarray(ids[:, start:start + n], jnp.int32)
                pos = jnp.arange(start, start + n, dtype=jnp.int32)[None]
                out = step(target, toks, pos, cache)
                cache = out.cache
                got = np.asarray(logits_from_hidden(target, out.hidden))
                worst = max(worst, frobenius_rel(got, ref[:, start:start + n]))
                worst_abs = max(worst_abs, float_errors(got, ref[:, start:start + n])[0])
                ran.add(kernels_in(step, target, toks, pos, cache))
                start += n
            record("targets", f"{name} logits vs transformers", impl,
                   f"prefill {prefill}, extend {extends[0]}, decode {extends[1]} (f32)", abs_err=worst_abs,
                   rel_err=worst, bound=f"rel<={PARITY_BOUND}", ok=worst <= PARITY_BOUND,
                   ran="; ".join(sorted(ran)))


def _reads_swiglu_limit() -> bool:
    """transformers < 5.18 builds GPT-OSS experts with a fixed limit 7.0 / alpha 1.702 whatever the config says
    (5.18 reads config.swiglu_limit / swiglu_alpha, as pjax does)."""
    import inspect

    from transformers.models.gpt_oss import modeling_gpt_oss
    return "config.swiglu_limit" in inspect.getsource(modeling_gpt_oss)


# ---------------------------------------------------------------- 3. P-EAGLE drafter vs float64
def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x, pos, theta):
    hd = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    ang = pos[:, :, None, None] * inv
    x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
    return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], -1)


def _attention(p, x, pos, nh, nkv, hd, theta):
    b, t, _ = x.shape
    q = _rope((x @ p["q_proj"]["kernel"]).reshape(b, t, nh, hd), pos, theta)
    k = _rope((x @ p["k_proj"]["kernel"]).reshape(b, t, nkv, hd), pos, theta)
    v = (x @ p["v_proj"]["kernel"]).reshape(b, t, nkv, hd)
    g = nh // nkv
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * hd ** -0.5
    s = np.where((pos[:, None, None, :] <= pos[:, None, :, None]), s, -np.inf)
    s = np.exp(s - s.max(-1, keepdims=True))
    o = np.einsum("bhqk,bkhd->bqhd", s / s.sum(-1, keepdims=True), v).reshape(b, t, nh * hd)
    return o @ p["o_proj"]["kernel"]


def _mlp(p, x):
    gate = x @ p["gate_proj"]["kernel"]
    return (gate / (1 + np.exp(-gate)) * (x @ p["up_proj"]["kernel"])) @ p["down_proj"]["kernel"]


def drafter_reference(params, cfg, tokens, features, is_mask, pos):
    """float64 P-EAGLE forward over one causal block of slots: fc fuses the features (mask slots: mask_hidden),
    layer 0 attends over [norm(embed) ; norm(fused)], the residual stream starts at the fused feature; deeper layers
    are llama decoder layers; draft-vocab logits of the final norm."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    lay, eps = cfg.layer, cfg.layer.rms_norm_eps
    nh, spec = lay.num_heads, lay.layers[0]
    g = np.where(is_mask[..., None], p["mask_hidden"], np.asarray(features, np.float64))
    h = g @ p["fc"]["kernel"]
    e = p["embed_tokens"]["embedding"][tokens]
    for i in range(lay.num_layers):
        lp = p["layers"][i]
        if i == 0:
            x = np.concatenate([_rms(e, lp["input_layernorm"]["weight"], eps), _rms(h, lp["hidden_norm"]["weight"],
                                                                                    eps)], -1)
        else:
            x = _rms(h, lp["input_layernorm"]["weight"], eps)
        h = h + _attention(lp["self_attn"], x, pos, nh, spec.num_kv_heads, spec.head_dim, spec.rope.theta)
        h = h + _mlp(lp["mlp"], _rms(h, lp["post_attention_layernorm"]["weight"], eps))
    return _rms(h, p["norm"]["weight"], eps) @ p["lm_head"]["kernel"]


def check_drafter(quick):
    from pjax.config import LayerSpec, ModelConfig, RopeSpec
    from pjax.models.drafter import (DrafterConfig, combine, draft_logits_from_hidden, drafter_forward, init_drafter,
                                     init_drafter_cache)
    v, h, ht, a = 257, 64, 48, 3
    layer = ModelConfig("llama", v, h, 128, 8, tuple(LayerSpec(16, 2, RopeSpec(theta=10000.0)) for _ in range(2)),
                        rms_norm_eps=1e-5)
    cfg = DrafterConfig(layer=layer, num_aux=a, target_hidden_size=ht, draft_vocab_size=200, mask_token_id=v - 1,
                        aux_layer_ids=(1, 4, 7))
    drafter = init_drafter(cfg, jax.random.key(0), jnp.float32, scale=0.2)
    b, t, k = 2, 14, 7  # 2K = 14 parallel slots: accepted tokens + bonus, then K - 1 mask slots
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, v - 1, (b, t))
    is_mask = np.arange(t)[None] >= t - (k - 1)
    tokens = np.where(is_mask, cfg.mask_token_id, tokens)
    features = rng.standard_normal((b, t, a * ht))
    pos = np.broadcast_to(np.arange(t), (b, t))
    want = drafter_reference(drafter.params, cfg, tokens, features, is_mask, pos.astype(np.float64))

    for impl in IMPLEMENTATIONS:
        def run(d, tok, feat, msk, p_, impl=impl):
            fused = jnp.where(msk[..., None], combine(d, d.params["mask_hidden"]), combine(d, feat))
            cache = init_drafter_cache(d, tok.shape[0], 32, jnp.float32)
            normed, _, _ = drafter_forward(d, tok, fused, p_, cache, implementation=impl)
            return draft_logits_from_hidden(d, normed)
        args = (drafter, jnp.asarray(tokens, jnp.int32), jnp.asarray(features, jnp.float32), jnp.asarray(is_mask),
                jnp.asarray(pos, jnp.int32))
        got = jax.jit(run)(*args)
        rel = frobenius_rel(got, want)
        record("drafter", "P-EAGLE head vs float64", impl, f"B={b} {t} slots (K={k}), 2 layers, cached (f32)",
               abs_err=float_errors(got, want)[0], rel_err=rel, bound=f"rel<={PARITY_BOUND}",
               ok=rel <= PARITY_BOUND, ran=kernels_in(run, *args))


SECTIONS = {"kernels": (check_attention, check_flash_attention, check_expert_matmul, check_acceptance,
                        check_metadata),
            "targets": (check_targets,), "drafter": (check_drafter,)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes (a CPU run: interpret mode)")
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--json", default=None, help="write the rows to this JSON file")
    args = ap.parse_args(argv)
    only = args.only.split(",")
    for s in only:
        if s not in SECTIONS:
            ap.error(f"unknown section {s!r} (choose from {', '.join(SECTIONS)})")
    jax.config.update("jax_default_matmul_precision", "highest")
    dev = jax.devices()[0]
    t0 = time.time()
    log(f"# gpu_check: {dev.device_kind} ({dev.platform}), jax {jax.__version__}, "
        f"{'quick' if args.quick else 'full'}, matmul precision highest\n")
    log("| op | implementation | shape | max abs err | rel err | bound | result | ran |\n|---|---|---|---|---|---|---|---|")
    for section in only:
        for check in SECTIONS[section]:
            t = time.time()
            check(args.quick)
            log(f"| _{check.__name__}: {time.time() - t:.0f} s_ | | | | | | | |")
    failed = [r for r in ROWS if not r.ok]
    log(f"\n{len(ROWS) - len(failed)} passed, {len(failed)} failed in {time.time() - t0:.0f} s")
    for r in failed:
        log(f"FAILED: {r.op} [{r.impl}] {r.shape}: abs {r.abs_err:.3e} rel {r.rel_err:.3e} ({r.bound})")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps([dataclasses.asdict(r) for r in ROWS], indent=1))
        tmp.replace(path)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""The target stage: a Llama code model trained on next-token prediction (`pjax.train.target_lm.make_lm_step`, the step
`pjax.train.train_target_lm` runs) with orbax checkpoints, its held-out loss, and the native copy it leaves."""
from __future__ import annotations

import functools
import json
import math
import shutil
import time
from pathlib import Path
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from examples.code_pair.data import documents, load_tokenizer, special_ids
from examples.code_pair.recipe import RecipeError, resume, write_json


def target_hf_config(b) -> dict:
    from pjax.checkpoint.hf_export import hf_config
    from pjax.config import LayerSpec, ModelConfig, RopeSpec
    r, ids = b.recipe, special_ids(b)
    if r.target_hidden % r.target_heads:
        raise RecipeError(f"--target-hidden {r.target_hidden} is not a multiple of --target-heads {r.target_heads}")
    spec = LayerSpec(head_dim=r.target_hidden // r.target_heads, num_kv_heads=r.target_kv_heads,
                     rope=RopeSpec(theta=r.rope_theta))
    cfg = ModelConfig("llama", load_tokenizer(b).get_vocab_size(), r.target_hidden, r.target_intermediate,
                      r.target_heads, (spec,) * r.target_layers, rms_norm_eps=1e-5).validate()
    return hf_config(cfg, dtype="float32", bos_token_id=ids["bos_token"], eos_token_id=ids["eos_token"],
                     pad_token_id=ids["pad_token"], max_position_embeddings=r.target_seq_len)


def init_code_target(cfg, seed: int):
    """Normal(0, 0.02) weights, the residual-branch outputs (o_proj, down_proj) scaled by 1/sqrt(2 L) so the
    residual stream's variance does not grow with depth at initialisation."""
    from pjax.models.target import Target, init_target
    t = init_target(cfg, jax.random.key(seed), jnp.float32, scale=0.02)
    scale = 1.0 / math.sqrt(2 * cfg.num_layers)

    def fix(path, x):
        names = [str(getattr(k, "key", k)) for k in path]
        return x * scale if ("o_proj" in names or "down_proj" in names) else x
    return Target(t.config, t.graphdef, jax.tree_util.tree_map_with_path(fix, t.params))


def _eval_loss(b, target, docs) -> dict:
    """Mean next-token loss of the target over up to eval_rows packed rows of `docs`."""
    from pjax.train.data import pack_documents, stack_rows
    from pjax.train.target_lm import lm_loss
    r = b.recipe
    rows = pack_documents(docs, r.target_seq_len)[:r.eval_rows]
    fn = jax.jit(functools.partial(lm_loss, compute_dtype=r.compute_dtype, implementation=b.implementation))
    shell = type(target)(target.config, target.graphdef, None)
    total, count = 0.0, 0
    for i in range(0, len(rows), r.target_batch_rows):
        batch = stack_rows(rows[i:i + r.target_batch_rows])
        doc = batch["document_ids"]
        n = int(np.sum((doc[:, 1:] == doc[:, :-1]) & (doc[:, 1:] != -1)))
        total += float(fn(target.params, shell, jnp.asarray(batch["tokens"]), jnp.asarray(doc))) * n
        count += n
    loss = total / max(count, 1)
    return dict(loss=loss, perplexity=math.exp(loss), tokens=count)


def _target_steps(b, work: Path, per_step: int, rate: Optional[float]) -> int:
    """The target's step count: target_tokens / tokens per step, or fewer when target_minutes at the measured rate
    (tokens/s) allows fewer. Decided once (plan.json), so a resumed run keeps it."""
    r, plan = b.recipe, work / "plan.json"
    if plan.exists():
        return json.loads(plan.read_text())["steps"]
    most = -(-r.target_tokens // per_step)
    if r.target_minutes is None or rate is None:
        return most
    steps = max(r.target_warmup + 1, min(most, int(r.target_minutes * 60 * rate / per_step)))
    write_json(plan, dict(steps=steps, measured_tokens_per_s=rate, target_minutes=r.target_minutes,
                           target_tokens=r.target_tokens))
    return steps


def stage_target(b, work: Path) -> dict:
    """Next-token training (`pjax.train.target_lm.make_lm_step`, the step `train_target_lm` runs) with orbax
    checkpoints; with target_minutes, the step count is fixed at the end of the warmup from the measured rate (the
    warmup's learning rates do not depend on it)."""
    from pjax.checkpoint import save_native_target
    from pjax.models.families import config_from_hf
    from pjax.train import RowStream, TrainState
    from pjax.train.target_lm import causal_lengths, make_lm_step
    r = b.recipe
    if r.target_minutes is not None and r.target_warmup < 10:
        raise RecipeError(f"--target-minutes measures the rate during the warmup: --target-warmup must be >= 10, "
                          f"got {r.target_warmup}")
    hf = target_hf_config(b)
    target = init_code_target(config_from_hf(hf), r.seed)
    per_step = r.target_batch_rows * r.target_seq_len
    steps = _target_steps(b, work, per_step, None)
    decided = (work / "plan.json").exists() or r.target_minutes is None

    def make_step(n):
        return make_lm_step(lr=r.target_lr, steps=n, warmup=r.target_warmup, weight_decay=r.target_weight_decay,
                            compute_dtype=r.compute_dtype, remat=r.remat, implementation=b.implementation)
    init, step = make_step(steps)
    stream = RowStream(documents(b, "train"), r.target_seq_len, r.target_batch_rows, seed=r.seed)
    state = TrainState(jnp.zeros((), jnp.int32), target.params, init(target.params),
                       jax.random.key_data(jax.random.key(r.seed)), jnp.zeros((), jnp.int32))
    ckpt, state, history = resume(work, state)
    history_path = work / "history.json"
    start = int(state.step)
    n_params = sum(x.size for x in jax.tree.leaves(target.params))
    epoch_tokens = stream.batches_per_epoch * per_step
    b.log(f"target: {n_params / 1e6:.1f} M parameters; {'' if decided else 'at most '}{steps} steps x {per_step} "
          f"tokens = {steps * per_step / 1e6:.1f} M tokens ({steps * per_step / epoch_tokens:.2f} epochs of "
          f"{epoch_tokens / 1e6:.1f} M){'' if decided else f'; fixed after the warmup for {r.target_minutes} min'}"
          f"{f'; resuming at step {start}' if start else ''}")
    params, opt_state, shell = state.params, state.opt_state, type(target)(target.config, target.graphdef, None)
    bar = b.bar(steps, "train target", initial=start, unit="step")
    losses, t_save, log_every = [], time.time(), max(1, min(50, steps // 20))
    t_log = n_log = None
    step_times = []  # until the step count is fixed: each step timed alone (block per step)
    done = start
    while done < steps:
        batch = stream.batch(done)
        lengths = causal_lengths(batch["document_ids"])
        t_step = time.time()
        params, opt_state, loss = step(params, opt_state, shell, jnp.asarray(batch["tokens"]),
                                       jnp.asarray(batch["document_ids"]),
                                       None if lengths is None else jnp.asarray(lengths))
        losses.append(loss)
        done += 1
        if not decided:
            jax.block_until_ready(loss)
            step_times.append(time.time() - t_step)
        if t_log is None:  # the first step compiles: rates count from its end
            jax.block_until_ready(loss)
            t_log, n_log = time.time(), done
        if not decided and done >= min(r.target_warmup, steps) and len(step_times) >= 6:
            # the median step: compilations (the first step, the first batch of the other attention layout) and
            # checkpoint writes are outliers that a mean over the warmup would count
            rate = per_step / float(np.median(step_times[1:]))
            new = _target_steps(b, work, per_step, rate)
            decided = True
            b.log(f"target: {rate:.0f} tokens/s measured; {new} steps ({new * per_step / 1e6:.1f} M tokens) fit "
                  f"{r.target_minutes} min")
            if new != steps:
                steps, step = new, make_step(new)[1]
                log_every = max(1, min(50, steps // 20))
                if bar is not None:
                    bar.total = steps
                    bar.refresh()
        if done % log_every == 0 or done == steps:
            value = float(np.mean(jax.device_get(losses)))
            now = time.time()
            rate = (done - n_log) * per_step / max(now - t_log, 1e-9) if done > n_log else float("nan")
            history.append(dict(step=done, loss=value, tokens_per_s=rate))
            eta = (steps - done) * per_step / rate if rate == rate and rate > 0 else float("nan")
            if bar is not None:
                bar.set_postfix_str(f"loss {value:.3f} {rate / 1e3:.0f}k tok/s")
            else:
                b.log(f"target step {done}/{steps} loss {value:.4f} {rate:.0f} tok/s ETA {eta / 60:.1f} min")
            losses, t_log, n_log = [], now, done
        if bar is not None:
            bar.update(1)
        t_save = b.save_or_stop("target", done, steps, t_save, bar, ckpt, lambda: (
            ckpt.save(TrainState(jnp.asarray(done, jnp.int32), params, opt_state, state.rng,
                                 jnp.asarray(done, jnp.int32))), write_json(history_path, history)))
    if bar is not None:
        bar.close()
    ckpt.close()
    trained = type(target)(target.config, target.graphdef, params)
    held = _eval_loss(b, trained, documents(b, "held_out"))
    b.log(f"target: held-out loss {held['loss']:.4f} (perplexity {held['perplexity']:.2f}) over "
          f"{held['tokens']} tokens")
    save_native_target(trained, hf, work / "model")
    shutil.rmtree(work / "ckpt", ignore_errors=True)
    return dict(parameters=int(n_params), steps=steps, tokens=steps * per_step, history=history, held_out=held)


def load_code_target(b, dtype=jnp.float32):
    from pjax.checkpoint import load_target
    return load_target(b.dir("target") / "model", dtype=dtype)



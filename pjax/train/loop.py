"""The training loop: progress bar, periodic metrics (loss, per-depth accuracy, tokens/s),
checkpointing with exact resume, export of the trained head."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from pjax.checkpoint.integrity import checksums
from pjax.dtypes import parse_dtype
from pjax.models.drafter import Drafter
from pjax.models.target import Target
from pjax.precision import float32_products, precision_scope
from pjax.train.data import FeatureStream, RowStream
from pjax.train.data.documents import check_token_ids
from pjax.train.checkpoint import Checkpointer, TrainError, run_settings
from pjax.train.config import TrainConfig
from pjax.train.state import TrainState, drafter_from_state, init_train_state
from pjax.models.sharding import make_mesh
from pjax.train.step import eval_step, make_train_step, replicate, shard_batch, shard_target


@dataclasses.dataclass
class TrainResult:
    drafter: Drafter
    state: TrainState
    history: list  # one dict per log interval (`summarize`): step, loss, acc, acc_all, cond_acc, chain_acc (P-EAGLE),
    # tokens_per_s, lr, grad_norm


def summarize(step: int, metrics: list, seconds: float) -> dict:
    """Aggregate per-step metric dicts (host numpy) of one log interval. acc[d]: depth d's top-1 agreement with the
    target; cond_acc[d]: the same given depths (TTT steps) < d of the anchor agree; chain_acc[d] (P-EAGLE): of the
    anchors supervised at depths 0..d, the fraction with all of them right (what acceptance of d + 1 drafts
    estimates)."""
    correct = np.sum([m["correct"] for m in metrics], axis=0)
    total = np.sum([m["total"] for m in metrics], axis=0)
    out = dict(step=step, loss=float(np.mean([m["loss"] for m in metrics])),
               acc=[float(c / t) if t else float("nan") for c, t in zip(correct, total)],
               acc_all=float(correct.sum() / max(total.sum(), 1.0)),
               tokens_per_s=float(np.sum([m["tokens"] for m in metrics]) / max(seconds, 1e-9)),
               lr=float(metrics[-1]["lr"]), grad_norm=float(np.mean([m["grad_norm"] for m in metrics])))
    if "cond_correct" in metrics[0]:
        cc = np.sum([m["cond_correct"] for m in metrics], axis=0)
        ct = np.sum([m["cond_total"] for m in metrics], axis=0)
        out["cond_acc"] = [float(c / t) if t else float("nan") for c, t in zip(cc, ct)]
        if "chain_total" in metrics[0]:
            ch = np.sum([m["chain_total"] for m in metrics], axis=0)
            out["chain_acc"] = [float(c / t) if t else float("nan") for c, t in zip(cc, ch)]
    return out


def _check_stream(stream, cfg: TrainConfig) -> None:
    if stream.batch_rows != cfg.batch_rows or stream.total_seq_len != cfg.total_seq_len:
        raise ValueError(f"stream yields {stream.batch_rows} x {stream.total_seq_len} batches but the config says "
                         f"batch_rows={cfg.batch_rows}, total_seq_len={cfg.total_seq_len}")


def _check_data(stream, vocab_size: int) -> None:
    """Token ids of a RowStream's documents within the target's vocabulary (DataError naming file and line)."""
    if isinstance(stream, RowStream):
        check_token_ids(stream.docs, vocab_size)


def _check_finite(host: list, first_step: int) -> None:
    """TrainError naming the first step (first_step + i) of `host` (per-step metric dicts) whose loss or
    gradient norm is not finite."""
    for i, m in enumerate(host):
        loss, grad = float(m["loss"]), float(m["grad_norm"])
        if not (np.isfinite(loss) and np.isfinite(grad)):
            raise TrainError(f"step {first_step + i}: the loss is {loss} and the gradient norm {grad}; training "
                             "stopped before saving or exporting non-finite weights (check the data and lower the "
                             "learning rate)")


def _settings(target: Target, drafter: Drafter, cfg: TrainConfig, stream) -> dict:
    """`run_settings` of this run: the data's, the draft vocabulary's and the target weights' fingerprints (one
    device pass, `pjax.checkpoint.integrity.checksums`) with the configs."""
    fingerprint = getattr(stream, "fingerprint", None)
    digest = lambda b: hashlib.blake2b(b, digest_size=16).hexdigest()  # noqa: E731
    d2t = None if drafter.d2t is None else digest(np.asarray(drafter.d2t).tobytes())
    weights = digest(" ".join(checksums(jax.tree.leaves(target.params))).encode())
    return run_settings(drafter.config, cfg, fingerprint() if callable(fingerprint) else None, d2t, weights)


def format_metrics(m: dict) -> str:
    accs = " ".join(f"{a:.2f}" for a in m["acc"])
    return (f"step {m['step']} loss {m['loss']:.4f} acc[{accs}] tok/s {m['tokens_per_s']:.0f} "
            f"lr {m['lr']:.2e} |g| {m['grad_norm']:.3f}")


def train_drafter(target: Target, drafter: Drafter, stream: RowStream | FeatureStream, cfg: TrainConfig, *,
                  steps: Optional[int] = None, mesh=None, checkpoint_dir=None, save_every: Optional[int] = None,
                  resume: bool = True, log_every: int = 10, progress: bool = True,
                  log_fn: Optional[Callable[[dict], None]] = None, state: Optional[TrainState] = None,
                  compiler_options: Optional[dict] = None, split_target: bool = False) -> TrainResult:
    """Train `drafter` (start point: random init, `init_drafter_for_target` or `pjax.load_drafter`)
    on `stream` against the frozen `target` until step `steps` (default cfg.total_steps). A `RowStream` yields raw
    token rows (target features computed in the step); a `FeatureStream` yields offline features (the target then
    only supplies its final norm and lm_head for the loss).

    With `checkpoint_dir` (checked first: `check_checkpoint_dir`), an existing checkpoint is restored first
    (resume=True; its run's settings must match: `Checkpointer.check_settings`) and the state is saved every
    `save_every` steps and at the end. Token ids outside the target's vocabulary are refused before training; a
    non-finite loss or gradient stops it (TrainError naming the step, nothing saved past it). mesh: a 1-D "data"
    mesh (`make_mesh`) for data parallelism; default one device. A float32 target or float32 compute runs full
    float32 products (`pjax.precision`). split_target: keep 1/n of each large target weight per device
    (`pjax.train.step.shard_target`) instead of a full copy on each. Returns the trained head, final state, metrics."""
    cfg.validate()
    _check_stream(stream, cfg)
    _check_data(stream, target.config.vocab_size)
    steps = cfg.total_steps if steps is None else int(steps)
    # explicit placement: restored == fresh state
    mesh = make_mesh(devices=jax.devices()[:1]) if mesh is None else mesh
    if split_target and mesh.devices.size == 1:
        raise ValueError("split_target=True needs a mesh of more than one device (make_mesh()); with one device "
                         "there is nothing to split the target over")
    ckpt = Checkpointer(checkpoint_dir) if checkpoint_dir is not None else None
    if ckpt is not None and resume:
        ckpt.check_settings(_settings(target, drafter, cfg, stream))
    if state is None:
        state = replicate(init_train_state(drafter, cfg), mesh)
        if ckpt is not None and resume and ckpt.latest_step() is not None:
            state = ckpt.restore(state)
            print(f"resumed from step {int(jax.device_get(state.step))} ({ckpt.directory})", flush=True)
    target = shard_target(target, mesh) if split_target else replicate(target, mesh)
    shell = replicate(Drafter(drafter.config, drafter.graphdef, None, drafter.d2t), mesh)
    step_fn = make_train_step(cfg, mesh, compiler_options=compiler_options)
    start = int(jax.device_get(state.step))
    position = int(jax.device_get(state.data_position))  # tracked on the host: no per-step device sync
    history, pending = [], []
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=steps, initial=start, desc=f"train {cfg.objective}", dynamic_ncols=True)
    t0 = time.perf_counter()
    f32_compute = cfg.compute_dtype is None or parse_dtype(cfg.compute_dtype) == jnp.float32
    f32 = (target, drafter if f32_compute else None)  # the models `pjax.precision`'s rule looks at
    for i in range(start, steps):
        batch = shard_batch(stream.batch(position), mesh)
        with precision_scope(*f32):
            state, m = step_fn(state, shell, target, batch)
        position += 1
        pending.append(m)
        done = i + 1
        saving = ckpt is not None and save_every and done % save_every == 0 and done != steps
        if done % log_every == 0 or done == steps or saving:
            _check_finite(jax.device_get([{k: x[k] for k in ("loss", "grad_norm")} for x in pending]),
                          done - len(pending) + 1)
        if done % log_every == 0 or done == steps:
            host = jax.device_get(pending)
            now = time.perf_counter()
            summary = summarize(done, host, now - t0)
            history.append(summary)
            pending, t0 = [], now
            if bar is not None:
                bar.set_postfix_str(format_metrics(summary).split(" ", 2)[2])
            if log_fn is not None:
                log_fn(summary)
        if bar is not None:
            bar.update(1)
        if saving:
            ckpt.save(state)
    if bar is not None:
        bar.close()
    if ckpt is not None and int(jax.device_get(state.step)) > start:
        ckpt.save(state)
    if ckpt is not None:
        ckpt.close()
    return TrainResult(drafter_from_state(drafter, state), state, history)


@float32_products
def evaluate_drafter(target: Target, drafter: Drafter, stream: RowStream | FeatureStream, cfg: TrainConfig, *,
                     batches: int, state: Optional[TrainState] = None, mesh=None,
                     compiler_options: Optional[dict] = None) -> dict:
    """The training metrics of `drafter` (or of `state`'s params) on `batches` batches of `stream` without training
    it: held-out accuracy per depth (acc, cond_acc, chain_acc as in `summarize`) and loss. Batches 0..batches-1 of
    the stream (wrapping into its next epoch when it has fewer)."""
    cfg.validate()
    _check_stream(stream, cfg)
    if batches < 1:
        raise ValueError(f"batches={batches}: expected at least 1")
    mesh = make_mesh(devices=jax.devices()[:1]) if mesh is None else mesh
    state = replicate(init_train_state(drafter, cfg) if state is None else state, mesh)
    target = replicate(target, mesh)
    shell = replicate(Drafter(drafter.config, drafter.graphdef, None, drafter.d2t), mesh)
    kw = {} if compiler_options is None else dict(compiler_options=compiler_options)
    step = jax.jit(functools.partial(eval_step, cfg=cfg), **kw)
    t0 = time.perf_counter()
    metrics = [step(state, shell, target, shard_batch(stream.batch(i), mesh)) for i in range(batches)]
    host = [dict(m, lr=np.float32(0), grad_norm=np.float32(0)) for m in jax.device_get(metrics)]
    out = summarize(batches, host, time.perf_counter() - t0)
    return {k: v for k, v in out.items() if k not in ("step", "lr", "grad_norm")}

"""The head stages: a P-EAGLE head and an EAGLE-3 head trained against the target on the same rows, steps, rows per
step and row length, with orbax checkpoints and a held-out evaluation."""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import jax

from examples.code_pair.data import special_ids
from examples.code_pair.recipe import fmt, not_learned, resume, write_json
from examples.code_pair.regen import head_documents
from examples.code_pair.target import load_code_target


def _head_config(b, objective: str, target, docs):
    from pjax.train import (CodConfig, OptimConfig, TrainConfig, build_vocab_mapping, drafter_config_for_target,
                            token_frequencies)
    r, peagle = b.recipe, objective == "peagle"
    v = target.config.vocab_size
    vd = r.draft_vocab_size or v
    d2t = build_vocab_mapping(token_frequencies(docs, v), vd, v)[0] if vd < v else None
    dcfg = drafter_config_for_target(
        target.config, num_layers=r.peagle_layers if peagle else r.eagle3_layers, draft_vocab_size=vd,
        mask_token_id=special_ids(b)["mask_token"], aux_layer_ids=r.aux_layer_ids, model_kind=objective,
        num_depths=r.peagle_depths if peagle else None)
    cfg = TrainConfig(
        objective=objective, total_seq_len=r.head_seq_len, batch_rows=r.head_batch_rows, total_steps=r.head_steps,
        cod=CodConfig(num_depths=r.peagle_depths, down_sample_ratio=r.peagle_down_sample_ratio,
                      down_sample_ratio_min=r.peagle_down_sample_ratio_min, max_anchors=r.peagle_max_anchors),
        ttt_steps=r.eagle3_ttt_steps, num_segments=r.peagle_segments if peagle else 1,
        optim=OptimConfig(lr=r.peagle_lr if peagle else r.eagle3_lr, warmup_steps=r.head_warmup,
                          weight_decay=r.head_weight_decay, train_embeddings=peagle, optimizer=r.head_optimizer),
        compute_dtype=r.compute_dtype, remat=r.remat, seed=r.seed, implementation=b.implementation)
    return dcfg, d2t, cfg


def _train_head(b, work: Path, objective: str) -> dict:
    from pjax.checkpoint import save_drafter
    from pjax.train import RowStream, evaluate_drafter, init_drafter_for_target, make_mesh, train_drafter
    from pjax.train.loop import format_metrics
    from pjax.train.state import drafter_from_state, init_train_state
    from pjax.train.step import replicate
    r = b.recipe
    target32 = load_code_target(b)
    docs = head_documents(b)
    dcfg, d2t, cfg = _head_config(b, objective, target32, docs)
    drafter = init_drafter_for_target(target32, dcfg, jax.random.key(r.seed + (2 if objective == "peagle" else 3)),
                                      d2t=d2t)
    mesh = make_mesh(devices=jax.devices()[:1])
    target = replicate(target32 if r.compute_dtype is None else target32.astype(r.compute_dtype), mesh)
    stream = RowStream(docs, r.head_seq_len, r.head_batch_rows, seed=r.seed + 1)
    state = replicate(init_train_state(drafter, cfg), mesh)
    ckpt, state, history = resume(work, state)
    history_path = work / "history.json"
    start = int(jax.device_get(state.step))
    tokens = r.head_steps * r.head_batch_rows * r.head_seq_len
    b.log(f"{objective}: {dcfg.layer.num_layers} layer(s), aux layers {dcfg.aux_layer_ids}, "
          f"{'depths ' + str(r.peagle_depths) if objective == 'peagle' else 'ttt steps ' + str(r.eagle3_ttt_steps)}, "
          f"{r.head_steps} steps ({tokens / 1e6:.1f} M tokens){f', resuming at step {start}' if start else ''}")
    log_every = max(1, min(25, r.head_steps // 20))  # also the steps between time checks
    bar = b.bar(r.head_steps, f"train {objective}", initial=start, unit="step")
    t_save, done = time.time(), start
    while done < r.head_steps:
        stop = min(r.head_steps, done + log_every)
        res = train_drafter(target, drafter, stream, cfg, steps=stop, mesh=mesh, state=state, progress=False,
                            log_every=log_every)
        state, history = res.state, history + res.history
        if bar is not None:
            bar.update(stop - done)
            if res.history:
                bar.set_postfix_str(format_metrics(res.history[-1]).split(" ", 2)[2])
        elif res.history:
            rate = res.history[-1]["tokens_per_s"]
            eta = (r.head_steps - stop) * r.head_batch_rows * r.head_seq_len / rate if rate > 0 else float("nan")
            b.log(f"{objective} {format_metrics(res.history[-1])} ETA {eta / 60:.1f} min")
        done = stop
        t_save = b.save_or_stop(objective, done, r.head_steps, t_save, bar, ckpt,
                                lambda: (ckpt.save(state), write_json(history_path, history)))
    if bar is not None:
        bar.close()
    ckpt.close()
    held = evaluate_drafter(target, drafter, RowStream(head_documents(b, "held_out"), r.head_seq_len,
                                                       r.head_batch_rows, seed=r.seed + 6),
                            cfg, batches=r.head_eval_batches, state=state, mesh=mesh)
    save_drafter(drafter_from_state(drafter, state), work / "head", dtype="float32")
    shutil.rmtree(work / "ckpt", ignore_errors=True)
    last = history[-1] if history else {}
    for name, m in (("final (training batches)", last), ("held-out", held)):
        if m:  # marginal, conditional (earlier depths right) and whole-chain accuracy per depth / step
            b.log(f"{objective}: {name} " + " ".join(f"{k}{fmt(m[k])}" for k in ("acc", "cond_acc", "chain_acc")
                                                     if k in m))
    warning = not_learned(objective, first_accuracy=held["acc"][0]) if held else None
    if warning:
        b.log(warning)
    return dict(steps=r.head_steps, tokens=tokens, layers=dcfg.layer.num_layers, aux_layer_ids=dcfg.aux_layer_ids,
                final=last, held_out=held, history=history, learned=warning is None)


def stage_peagle(b, work: Path) -> dict:
    return _train_head(b, work, "peagle")


def stage_eagle3(b, work: Path) -> dict:
    return _train_head(b, work, "eagle3")



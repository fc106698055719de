"""The export stage (DIR/pair: the Hugging Face target, both heads in the speculators format, the prompts) and the
check stage: greedy decoding of the benchmark prompts, plain against each head, beside each head's teacher-forced
accuracy over the same sequences."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from examples.code_pair.data import load_tokenizer
from examples.code_pair.recipe import RecipeError, fmt, not_learned, now, write_json
from examples.code_pair.target import load_code_target

PAIR_KIND = "code-pair"


def stage_export(b, work: Path) -> dict:
    """DIR/pair, written beside its place and renamed in (its previous copy replaced as a whole)."""
    from pjax.checkpoint import load_drafter, save_drafter, write_output_dir
    from pjax.checkpoint.hf_export import save_hf_target
    r = b.recipe
    final = b.out / "pair"
    target = load_code_target(b)
    summary = dict(recipe=dataclasses.asdict(r), written_at=now(),
                   stages={s: (b.marker(s) or {}).get("summary") for s in ("corpus", "tokenizer", "tokens", "regen")},
                   target={k: v for k, v in b.marker("target")["summary"].items() if k != "history"},
                   heads={h: {k: v for k, v in b.marker(h)["summary"].items() if k != "history"}
                          for h in ("peagle", "eagle3")})
    with write_output_dir(final, force=True, kind=PAIR_KIND, metadata={"recipe": "examples/code_pair"}) as tmp:
        save_hf_target(target, tmp / "target", dtype=r.export_dtype, tokenizer_dir=b.dir("tokenizer"),
                       max_position_embeddings=r.target_seq_len)
        for head in ("peagle", "eagle3"):
            save_drafter(load_drafter(b.dir(head) / "head", dtype=jnp.float32), tmp / head, dtype=r.export_dtype,
                         verifier_name_or_path=str(final / "target"))
        shutil.copyfile(b.dir("corpus") / "prompts.jsonl", tmp / "prompts.jsonl")
        shutil.copyfile(b.dir("corpus") / "manifest.json", tmp / "corpus_manifest.json")
        write_json(tmp / "pair.json", summary)
    b.log(f"export: {final} (target/, peagle/, eagle3/, prompts.jsonl, corpus_manifest.json, pair.json)")
    return dict(pair=str(final))


def stage_check(b, work: Path) -> dict:
    import pjax
    r = b.recipe
    pair = b.out / "pair"
    target = pjax.load_target(pair / "target", dtype=jnp.dtype(r.export_dtype))
    tok = load_tokenizer(b)
    rows = [json.loads(line) for line in (pair / "prompts.jsonl").read_text().splitlines()]
    fits = [ids for ids in (tok.encode(row["prompt"]).ids for row in rows)
            if len(ids) + r.check_new_tokens <= r.target_seq_len]  # within the trained context
    prompts = fits[:r.check_prompts]
    if not prompts:
        raise RecipeError(f"no benchmark prompt fits {r.check_new_tokens} new tokens within the trained context of "
                          f"{r.target_seq_len}: lower --check-new-tokens")
    kw = dict(max_new_tokens=r.check_new_tokens, implementation=b.implementation)
    plain = pjax.generate(target, None, prompts, drafting="none", **kw)
    out = dict(prompts=len(prompts), new_tokens=r.check_new_tokens, dtype=r.export_dtype,
               plain_tokens_per_s=plain.stats["output_tokens_per_s"])
    for head, drafting, k in (("peagle", "parallel", r.peagle_depths), ("eagle3", "sequential", r.eagle3_ttt_steps)):
        drafter = pjax.load_drafter(pair / head, dtype=jnp.dtype(r.export_dtype), target=target)
        res = pjax.generate(target, drafter, prompts, drafting=drafting, num_speculative_tokens=k, **kw)
        same = sum(a == p for a, p in zip(res.tokens, plain.tokens))
        forced = _teacher_forced(b, target, drafter, head, k, prompts, plain.tokens)
        rates = res.stats["acceptance_rates"]
        out[head] = dict(k=k, mean_acceptance_length=res.stats["mean_acceptance_length"],
                         acceptance_rates=rates, identical_to_plain=same == len(prompts),
                         identical_rows=same, tokens_per_s=res.stats["output_tokens_per_s"], teacher_forced=forced)
        b.log(f"check {head}: K={k} mean acceptance length {res.stats['mean_acceptance_length']:.3f}, per-position "
              f"{[round(x, 3) for x in rates]}; {same}/{len(prompts)} rows identical to plain greedy decoding "
              f"({r.export_dtype})")
        warning = not_learned(head, acceptance_length=res.stats["mean_acceptance_length"])
        if warning:
            b.log(warning)
        conditional = [a / p if p else float("nan") for a, p in zip(rates, [1.0] + list(rates[:-1]))]
        b.log(f"check {head}: decoding, position i accepted given i - 1 {fmt(conditional)}; the same sequences "
              f"teacher-forced: depth d right given depths < d {fmt(forced['cond_acc'])}"
              + (f", chain 0..d right {fmt(forced['chain_acc'])}" if "chain_acc" in forced else ""))
        if drafting == "parallel":
            out[head]["replay"] = rp = _replay(target, drafter, k, prompts, res.tokens, b.implementation)
            b.log(f"check {head}: decoding replayed from the teacher-forced drafts of its own outputs, per-position "
                  f"{fmt(rp['acceptance_rates'])} over {rp['rounds']} rounds; every anchor of the same outputs: "
                  f"chain 0..d right {fmt(rp['every_anchor_chain'])} over {rp['anchors']} anchors")
    return out


def _teacher_forced(b, target, drafter, objective: str, k: int, prompts, outputs) -> dict:
    """The head's training metrics (`pjax.train.evaluate_drafter`, every anchor at every depth) on prompt + output
    sequences, the outputs supervised: what decoding them would accept if drafting and training agree."""
    from pjax.train import CodConfig, RowStream, TrainConfig, evaluate_drafter
    from pjax.train.data import Document
    r = b.recipe
    docs = [Document(np.asarray(p + o, np.int32), np.asarray([0] * len(p) + [1] * len(o), np.int8))
            for p, o in zip(prompts, outputs) if o]
    stream = RowStream(docs, r.head_seq_len, 1, shuffle=False)
    cfg = TrainConfig(objective=objective, total_seq_len=r.head_seq_len, batch_rows=1, total_steps=1,
                      cod=CodConfig(num_depths=k, down_sample_ratio=1.0, down_sample_ratio_min=1.0, max_anchors=None),
                      ttt_steps=k, compute_dtype=r.compute_dtype, seed=r.seed, implementation=b.implementation)
    return evaluate_drafter(target, drafter, stream, cfg, batches=stream.batches_per_epoch)


def _replay(target, drafter, k: int, prompts, outputs, implementation: str) -> dict:
    """Greedy parallel decoding of prompt + output sequences replayed from the head's teacher-forced drafts
    (`pjax.train.replay.replay_rounds`): the replay's per-position acceptance (rounds whose draft i was accepted / rounds)
    and the chain accuracy over every anchor, both over anchors whose k drafts lie inside the sequence. Replay vs
    decoding = drafting vs training; every anchor vs replay = what the choice of round starts costs."""
    from pjax.train.replay import replay_rounds, teacher_forced_drafts
    accepted, every = np.zeros(k), np.zeros(k)
    rounds = anchors = 0
    for p, o in zip(prompts, outputs):
        if len(o) <= k:  # no anchor has all k drafts inside the sequence
            continue
        seq = list(p) + list(o)
        chain, starts = replay_rounds(teacher_forced_drafts(target, drafter, seq, k, implementation=implementation),
                                      seq, len(p) - 1)
        every += chain.sum(0)
        anchors += len(chain)
        accepted += chain[starts].sum(0)
        rounds += len(starts)
    return dict(rounds=rounds, anchors=anchors, acceptance_rates=(accepted / max(rounds, 1)).tolist(),
                every_anchor_chain=(every / max(anchors, 1)).tolist())



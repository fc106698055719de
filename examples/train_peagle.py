"""Train a P-EAGLE head (or, with --objective eagle3, an EAGLE-3 head) in JAX.

Default (no --target): the self-contained "main job" — a tiny byte-level target is trained on an
embedded corpus (Python standard-library sources), a head is trained against it, exported in the
speculators format, and speculative decoding with `pjax.generate` reports the acceptance length.

    python examples/train_peagle.py                       # tiny job, ~1 minute on a laptop CPU
    python examples/train_peagle.py --target /models/Qwen3-8B --data chats.jsonl --out heads/q8b \
        --steps 20000 --seq-len 8192 --num-depths 8 --num-layers 4 --draft-vocab-size 32000 \
        --checkpoint-dir ckpt/q8b --segments 4 --compute-dtype bfloat16

Data files: .jsonl rows with "messages" (chat; loss on assistant turns, rendered with the target's
chat template), "text" (all tokens supervised) or "input_ids" + "loss_mask"; other files are plain
text documents. --init-head starts from any head `pjax.load_drafter` reads (fine-tuning). --target reads
the target's tokenizer with transformers (`pip install -e ".[train]"`).

The export directory and the checkpoint directory are checked before any work; a re-run with the same
--checkpoint-dir resumes (other settings are refused, naming the setting). Exit status: 0 done; 2 bad input
(one line `error: ...`); 130 interrupted (the checkpoints written so far are kept).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402


def _args(argv=None, objective="peagle"):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--objective", choices=("peagle", "eagle3"), default=objective)
    p.add_argument("--target", help="Hugging Face target directory (default: the tiny built-in job)")
    p.add_argument("--data", nargs="*", default=None, help="training files (.jsonl or text); tiny job: its corpus "
                   "(default: Python standard-library sources)")
    p.add_argument("--init-head", help="start from this head (speculators or vLLM-native checkpoint)")
    p.add_argument("--out", default="runs/tiny_head", help="export directory (speculators format)")
    p.add_argument("--force", action="store_true", help="replace --out when it holds a head pjax wrote before")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--target-steps", type=int, default=400, help="tiny job: target training steps")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per packed row")
    p.add_argument("--batch-rows", type=int, default=None, help="rows per step (global)")
    p.add_argument("--num-depths", type=int, default=4, help="P-EAGLE depths K (parallel tokens trained)")
    p.add_argument("--ttt-steps", type=int, default=3, help="EAGLE-3 training-time-test steps")
    p.add_argument("--down-sample-ratio", type=float, default=0.7)
    p.add_argument("--down-sample-ratio-min", type=float, default=0.2)
    p.add_argument("--max-anchors", type=int, default=None)
    p.add_argument("--segments", type=int, default=1, help="sequence partitioning (spec D.5)")
    p.add_argument("--num-layers", type=int, default=1, help="draft decoder layers")
    p.add_argument("--draft-vocab-size", type=int, default=None)
    p.add_argument("--mask-token-id", type=int, default=None)
    p.add_argument("--aux-layer-ids", type=int, nargs="*", default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--warmup-steps", type=int, default=None)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw",
                   help="muon: Muon on the weight matrices, AdamW on the rest (speculators' --optimizer muon)")
    p.add_argument("--loss", choices=("kl", "ce"), default="kl")
    p.add_argument("--compute-dtype", default=None, help="e.g. bfloat16 (master weights stay float32)")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--save-every", type=int, default=None)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--all-devices", action="store_true", help="data parallel over every local device")
    p.add_argument("--split-target", action="store_true",
                   help="with --all-devices: each device keeps 1/n of every large target weight instead of a copy")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-generate", action="store_true", help="tiny job: skip the speculative decoding check")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _log(m):
    from pjax.train.loop import format_metrics
    if "acc" in m:
        print(format_metrics(m), flush=True)
    else:
        print(f"target step {m['step']} loss {m['loss']:.4f}", flush=True)


def acceptance_report(target, drafter, docs, *, k, objective, prompts=8, prompt_len=64, new_tokens=64):
    """Greedy speculative decoding on corpus snippets vs plain greedy decoding with the same target:
    returns the speculative run's stats plus `identical_to_plain` and the plain run's tokens/s."""
    import pjax
    ps = []
    for d in docs[::max(1, len(docs) // prompts)][:prompts]:
        start = len(d.tokens) // 2
        ps.append([int(t) for t in d.tokens[start:start + prompt_len]])
    drafting = "parallel" if objective == "peagle" else "sequential"
    res = pjax.generate(target, drafter, ps, max_new_tokens=new_tokens, num_speculative_tokens=k, drafting=drafting)
    plain = pjax.generate(target, None, ps, max_new_tokens=new_tokens, drafting="none")
    return dict(res.stats, identical_to_plain=res.tokens == plain.tokens,
                plain_output_tokens_per_s=plain.stats["output_tokens_per_s"])


def check_outputs(a, sources=()) -> None:
    """The export directory (--out) and --checkpoint-dir may be written: checked before any work."""
    from pjax.checkpoint import prepare_output
    from pjax.train.checkpoint import check_checkpoint_dir
    prepare_output(a.out, force=a.force, kind="drafter", sources=sources)
    if a.checkpoint_dir is not None:
        check_checkpoint_dir(a.checkpoint_dir)


def tiny_job(argv=None, objective="peagle") -> dict:
    """The README main job: tiny target + head, export, acceptance length. Returns a report dict."""
    a = _args(argv, objective)
    from pjax.checkpoint import save_drafter
    from examples.tiny_pair import tiny_run
    check_outputs(a)
    t0 = time.time()
    run = tiny_run(corpus_files=a.data, objective=a.objective, seq_len=a.seq_len or 128,
                   batch_rows=a.batch_rows or 8, target_steps=a.target_steps, head_steps=a.steps or 300, num_depths=a.num_depths,
                   ttt_steps=a.ttt_steps, head_layers=a.num_layers, draft_vocab_size=a.draft_vocab_size,
                   seed=a.seed, checkpoint_dir=a.checkpoint_dir, progress=not a.no_progress,
                   log_every=a.log_every, log_fn=_log if a.no_progress else None)
    report = dict(train_seconds=round(time.time() - t0, 1), corpus=run.corpus,
                  environment=dict(python=run.corpus["python"], jax=jax.__version__, backend=jax.default_backend(),
                                   machine=platform.machine(), cpus=os.cpu_count()),
                  target_history=run.target_history,
                  head_history=run.head_history, export=str(save_drafter(run.drafter, a.out, overwrite=a.force)))
    if not a.no_generate:
        k = a.num_depths if a.objective == "peagle" else a.ttt_steps
        stats = acceptance_report(run.target, run.drafter, run.docs, k=k, objective=a.objective)
        report["acceptance_length"] = stats.get("mean_acceptance_length")
        report["identical_to_plain"] = stats["identical_to_plain"]
        report["generate_stats"] = {key: v for key, v in stats.items() if isinstance(v, (int, float, list))}
    last = run.head_history[-1]
    print(f"head: loss {last['loss']:.4f}, per-depth acc {[round(x, 3) for x in last['acc']]}; "
          f"exported to {report['export']}")
    if "acceptance_length" in report:
        print(f"speculative decoding (greedy, K={k}): mean acceptance length {report['acceptance_length']:.3f}; "
              f"tokens identical to plain greedy decoding: {report['identical_to_plain']}")
        env, corpus = report["environment"], run.corpus
        print(f"this number depends on the corpus ({len(corpus['files'])} files, {corpus['bytes']} bytes, sha256 "
              f"{corpus['sha256'][:12]}: Python {corpus['python']}'s standard library unless --data) and on the "
              f"machine's arithmetic (JAX {env['jax']}, {env['backend']} {env['machine']}, {env['cpus']} CPUs)")
    return report


def _mask_token_id(a, tok, vocab):
    if a.mask_token_id is not None:
        return a.mask_token_id
    mid = getattr(tok, "mask_token_id", None)
    if mid is not None:
        return int(mid)
    if len(tok) < vocab:
        return len(tok)  # first unused embedding row (speculators adds <|MASK|> there)
    for name in ("pad_token_id", "eos_token_id", "unk_token_id"):
        if getattr(tok, name, None) is not None:
            return int(getattr(tok, name))
    raise UsageError("could not choose a mask token id: pass --mask-token-id")


def target_job(argv=None, objective="peagle"):
    """Train a head for a real target (Hugging Face directory) on the given data files."""
    a = _args(argv, objective)
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise UsageError("--target reads the target's tokenizer with transformers, which is not installed "
                         "(pip install -e \".[train]\")") from None

    from pjax.checkpoint import load_drafter, load_target, save_drafter
    from pjax.train import (CodConfig, OptimConfig, RowStream, TrainConfig, build_vocab_mapping,
                            drafter_config_for_target, init_drafter_for_target, load_documents, make_mesh,
                            token_frequencies, train_drafter)
    if not a.data:
        raise UsageError("--data is required with --target")
    if a.split_target and not a.all_devices:
        raise UsageError("--split-target needs --all-devices (the target is split over the data-parallel devices)")
    check_outputs(a, sources=[a.target] + ([a.init_head] if a.init_head else []))
    target = load_target(a.target, dtype=jnp.bfloat16)
    tok = AutoTokenizer.from_pretrained(a.target)
    v = target.config.vocab_size
    docs = load_documents(a.data, tok, vocab_size=v)
    if a.init_head:
        drafter = load_drafter(a.init_head, dtype=jnp.float32, target=target)
    else:
        vd = a.draft_vocab_size or v
        d2t = build_vocab_mapping(token_frequencies(docs, v), vd, v)[0] if vd < v else None
        dcfg = drafter_config_for_target(target.config, num_layers=a.num_layers, draft_vocab_size=vd,
                                         mask_token_id=_mask_token_id(a, tok, v), aux_layer_ids=a.aux_layer_ids,
                                         model_kind=a.objective,
                                         num_depths=a.num_depths if a.objective == "peagle" else None)
        drafter = init_drafter_for_target(target, dcfg, jax.random.key(a.seed), d2t=d2t)
    seq, rows = a.seq_len or 4096, a.batch_rows or jax.device_count()
    steps = a.steps or 1000
    cfg = TrainConfig(objective=a.objective, total_seq_len=seq, batch_rows=rows, total_steps=steps,
                      cod=CodConfig(a.num_depths, a.down_sample_ratio, a.down_sample_ratio_min, a.max_anchors),
                      ttt_steps=a.ttt_steps, loss_type=a.loss, num_segments=a.segments,
                      optim=OptimConfig(lr=a.lr or 6e-4, warmup_steps=a.warmup_steps, weight_decay=a.weight_decay,
                                        train_embeddings=a.objective == "peagle", optimizer=a.optimizer),
                      compute_dtype=a.compute_dtype, seed=a.seed)
    stream = RowStream(docs, seq, rows, seed=a.seed)
    res = train_drafter(target, drafter, stream, cfg, mesh=make_mesh() if a.all_devices else None,
                        checkpoint_dir=a.checkpoint_dir, save_every=a.save_every, log_every=a.log_every,
                        progress=not a.no_progress, log_fn=_log if a.no_progress else None,
                        split_target=a.split_target)
    out = save_drafter(res.drafter, a.out, verifier_name_or_path=a.target, overwrite=a.force,
                       sources=[a.target] + ([a.init_head] if a.init_head else []))
    print(f"exported {out}")
    return dict(history=res.history, export=str(out))


class UsageError(ValueError):
    """A flag combination or value the job cannot use; the message names the flag."""


def main(argv=None, objective="peagle") -> int:
    """Run the job; bad input is one line `error: ...` (exit 2), Ctrl-C one line (exit 130)."""
    from pjax.checkpoint import CheckpointError, OutputError
    from pjax.command import run_command
    from pjax.config import ConfigError
    from pjax.train.checkpoint import TrainError
    from pjax.train.data import DataError
    a = _args(argv, objective)
    kept = (f"; the checkpoints in {a.checkpoint_dir} are kept (run the same command to resume)"
            if a.checkpoint_dir else "")

    def run():
        report = target_job(argv, objective) if a.target else tiny_job(argv, objective)
        summary = {k: v for k, v in report.items() if k not in ("head_history", "target_history", "history")}
        print(json.dumps(summary, indent=1, default=str))
        return 0
    return run_command(run, user_errors=(UsageError, CheckpointError, OutputError, ConfigError, DataError, TrainError,
                                         OSError),
                       interrupted=f"interrupted{kept}")


if __name__ == "__main__":
    sys.exit(main())

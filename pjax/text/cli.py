"""`python -m pjax generate`: text from a prompt, a chat or a jsonl file, with a target directory and a P-EAGLE head.

    python -m pjax generate --target DIR [--head DIR] [--tokenizer DIR] (--prompt TEXT | --chat TEXT | --file F.jsonl)
        [--drafting parallel|sequential|none] [--k K] [--temperature T] [--top-p P] [--top-k N] [--seed S]
        [--max-new-tokens N] [--dtype bfloat16|float32] [--stop STR ...] [--stream] [--batch-size N]

The text goes to stdout (for --file one block per row, headed "=== prompt N ==="), a statistics line per prompt to
stderr. Exit codes: 0 success, 2 bad usage or bad input (one line naming the flag or file), 130 Ctrl-C (the text
generated so far is printed first).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pjax.checkpoint import load_drafter, load_target
from pjax.checkpoint.hf import read_target_config
from pjax.command import InputError, checked, dtype_flag, run_command
from pjax.decode.inputs import SEED_LIMIT
from pjax.decode.settings import (add_compilation_cache_flag, add_flags, config_from_flags, number_flag,
                                  use_compilation_cache_flag)
from pjax.dtypes import parse_dtype
from pjax.text.generate import TextGenerationInterrupted, TextGenerator, TextOutput
from pjax.text.tokenizer import check_messages, load_tokenizer

__all__ = ["build_parser", "main", "read_jsonl"]

DEFAULT_NEW_TOKENS = 256


def build_parser(prog: str = "python -m pjax generate") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, metavar="DIR",
                   help="Hugging Face target directory (config.json, safetensors, tokenizer.json)")
    p.add_argument("--head", metavar="DIR", help="P-EAGLE / EAGLE-3 head directory (default: no drafting)")
    p.add_argument("--tokenizer", metavar="DIR", help="tokenizer directory (default: --target)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="a plain-text prompt (encoded as is, BOS per the tokenizer)")
    src.add_argument("--chat", metavar="TEXT", help="one user message, rendered with the model's chat template")
    src.add_argument("--file", metavar="FILE.jsonl",
                     help='prompts, one JSON object per line: {"prompt": TEXT} or {"messages": [{"role", "content"}]}')
    add_flags(p, "drafting", "num_speculative_tokens", "tree_budget", "tree_score", "temperature", "top_p", "top_k")
    p.add_argument("--seed", type=number_flag(int, low=0, high=SEED_LIMIT, high_open=True), default=0, metavar="S",
                   help="sampling seed in [0, 2**32) (default 0)")
    p.add_argument("--max-new-tokens", type=number_flag(int, low=1), metavar="N",
                   help=f"new tokens per prompt at most (default {DEFAULT_NEW_TOKENS}, fewer when the target's context "
                        "length, max_position_embeddings, leaves less room after the prompt)")
    p.add_argument("--dtype", type=dtype_flag, default="bfloat16",
                   help="parameter dtype: bfloat16 (default), float32, float16 (or bf16, f32, f16)")
    p.add_argument("--no-finite-check", action="store_true",
                   help="accept NaN / inf weights (by default every floating tensor is checked, on device)")
    p.add_argument("--stop", nargs="+", action="extend", metavar="STR",
                   help="stop strings: the text ends before the first one (bash: --stop $'\\n\\n' for newlines)")
    p.add_argument("--stream", action="store_true", help="print the text as it is generated")
    add_flags(p, "prefill", "implementation", "cache_dtype")
    add_compilation_cache_flag(p)
    p.add_argument("--batch-size", type=number_flag(int, low=1), default=8, metavar="N",
                   help="--file prompts decoded together (default 8)")
    return p


def read_jsonl(path) -> list[tuple[int, object]]:
    """(line number, prompt) of a jsonl file: each non-blank line an object with "prompt" (text) or "messages" (a
    chat); other keys are ignored. Errors name the file and line."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise InputError(f"--file {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"--file {path}: cannot be read ({e})") from None
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path} line {n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict) or ("prompt" in row) == ("messages" in row):
            raise InputError(f'{where}: expected an object with "prompt" (text) or "messages" (a chat), not both')
        if "prompt" in row:
            if not isinstance(row["prompt"], str):
                raise InputError(f'{where}: "prompt" must be a string')
            rows.append((n, row["prompt"]))
        else:
            rows.append((n, checked(where, check_messages, row["messages"], where='"messages"')))
    if not rows:
        raise InputError(f"--file {path}: no prompts (empty file)")
    return rows


def _stats_line(out: TextOutput, label: str = "") -> str:
    s = out.stats
    return (f"{label}{s['output_tokens']} tokens, acceptance length {s['mean_acceptance_length']:.2f}, "
            f"{s['output_tokens_per_s']:.1f} tokens/s, ttft {s['ttft_s'] * 1e3:.0f} ms, finish: {out.finish_reason}")


class _Printer:
    """Prints a batch's outputs in order; streaming, the first unfinished one live and the others when their turn
    comes."""

    def __init__(self, offset: int, count: int, blocks: bool):
        self.offset, self.count, self.blocks = offset, count, blocks
        self.pending = [[] for _ in range(count)]
        self.done = [False] * count
        self.printed = [""] * count
        self.current = 0
        self._header(0)

    def _header(self, i):
        if self.blocks and i < self.count:
            print(f"=== prompt {self.offset + i + 1} ===", flush=True)

    def _write(self, i, text):
        if text:
            sys.stdout.write(text)
            sys.stdout.flush()
            self.printed[i] += text

    def delta(self, i, text, finished):
        self.pending[i].append(text)
        self.done[i] = self.done[i] or finished
        while self.current < self.count:
            c = self.current
            self._write(c, "".join(self.pending[c]))
            self.pending[c] = []
            if not self.done[c]:
                return
            print(flush=True)
            self.current += 1
            self._header(self.current)

    def rest(self, outputs: list[TextOutput]):
        """Print what has not been printed of each output (all of it when not streaming, the tail on Ctrl-C)."""
        while self.current < self.count:
            c = self.current
            self._write(c, outputs[c].text[len(self.printed[c]):])
            print(flush=True)
            self.current += 1
            self._header(self.current)


def _run_batch(gen, prompts, offset: int, blocks: bool, args, kw) -> list[TextOutput]:
    stream = checked("", gen.stream, prompts, **kw)
    printer = _Printer(offset, len(prompts), blocks)
    try:
        if args.stream:
            for d in stream:
                printer.delta(d.index, d.text, d.finished)
        outputs = stream.result()
    except TextGenerationInterrupted as e:
        printer.rest(e.outputs)
        raise
    printer.rest(outputs)
    for i, out in enumerate(outputs):
        print(_stats_line(out, f"[prompt {offset + i + 1}] " if blocks else ""), file=sys.stderr, flush=True)
    return outputs


def _render(tokenizer, args) -> list[list[int]]:
    """Prompt ids, every prompt checked before the models load; errors name the flag or the file line."""
    if args.file is None:
        flag, text = ("--prompt", args.prompt) if args.chat is None else ("--chat", args.chat)
        rows = [(flag, text, args.chat is not None)]
    else:
        rows = [(f"{args.file} line {n}", p, None) for n, p in read_jsonl(args.file)]
    ids = []
    for where, prompt, chat in rows:
        p = checked(where, tokenizer.render, prompt, chat=chat)
        if not p:
            raise InputError(f"{where}: the prompt renders to no tokens")
        ids.append(p)
    return ids


def _max_new_tokens(args, config, prompts) -> int:
    """--max-new-tokens within the target's context (max_position_embeddings, when the config gives it) after the
    longest prompt: a larger value given is refused, the default is capped."""
    want = DEFAULT_NEW_TOKENS if args.max_new_tokens is None else args.max_new_tokens
    mpe, longest = config.max_position_embeddings, max(len(p) for p in prompts)
    if not mpe or longest + want <= mpe:
        return want
    if mpe - longest < 1 or args.max_new_tokens is not None:
        raise InputError(f"--max-new-tokens {want}: the longest prompt ({longest} tokens) + {want} new tokens exceed "
                         f"the target's context length (max_position_embeddings={mpe}); at most "
                         f"{max(mpe - longest, 0)} new tokens fit")
    return mpe - longest


def run(args) -> int:
    if args.drafting in ("parallel", "sequential") and args.head is None:
        raise InputError(f"--drafting {args.drafting} needs --head DIR (or use --drafting none)")
    if args.num_speculative_tokens is not None and (args.head is None or args.drafting == "none"):
        raise InputError("--k needs drafting: give --head DIR (and not --drafting none)")
    use_compilation_cache_flag(args.compilation_cache, InputError)
    tokenizer = (checked("--target", load_tokenizer, args.target) if args.tokenizer is None
                 else checked("--tokenizer", load_tokenizer, args.tokenizer))
    prompts = _render(tokenizer, args)
    max_new = _max_new_tokens(args, checked("--target", read_target_config, args.target)[1], prompts)
    dtype = parse_dtype(args.dtype)
    check = not args.no_finite_check
    target = checked("--target", load_target, args.target, dtype=dtype, check_finite=check)
    drafter = None if args.head is None else checked("--head", load_drafter, args.head, dtype=dtype, target=target,
                                                     check_finite=check)
    gen = TextGenerator(target, drafter, tokenizer, config=config_from_flags(args))
    kw = dict(max_new_tokens=max_new, drafting=args.drafting, k=args.num_speculative_tokens,
              temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop)
    blocks = args.file is not None
    step = args.batch_size if blocks else 1
    outputs: list[TextOutput] = []
    for start in range(0, len(prompts), step):
        outputs += _run_batch(gen, prompts[start:start + step], start, blocks, args, kw)
    if blocks:
        tokens = sum(o.stats["output_tokens"] for o in outputs)
        seconds = sum(max(o.stats["e2e_s"] for o in outputs[s:s + step]) for s in range(0, len(outputs), step))
        print(f"total: {len(outputs)} prompts, {tokens} tokens, {tokens / seconds if seconds > 0 else 0:.1f} "
              "tokens/s", file=sys.stderr)
    return 0


def main(argv=None, prog: str = "python -m pjax generate") -> int:
    args = build_parser(prog).parse_args(argv)
    return run_command(lambda: run(args), user_errors=(InputError,))


if __name__ == "__main__":
    sys.exit(main())

"""The `pjax` command: one entry point whose subcommands live with the code they run.

    python -m pjax generate ...  text from a prompt, a chat or a jsonl file (`pjax.text.cli`)
    python -m pjax bench ...     throughput, latency, acceptance and exactness on datasets (`pjax.bench.cli`)
    python -m pjax convert ...   checkpoints: inspect, pjax-native copies, head export (`pjax.checkpoint.cli`)
    python -m pjax serve ...     an OpenAI-compatible HTTP server over the continuous-batching engine (`pjax.serve.cli`)
    python -m pjax check ...     kernels, target families and a P-EAGLE head checked on this device (`pjax.check.cli`)

Exit codes, every subcommand: 0 success, 1 the run failed, 2 bad usage or bad input (argparse errors, files or
arguments that do not fit, each named in a one-line message), 130 interrupted (Ctrl-C).
"""
from __future__ import annotations

import importlib
import sys

# subcommand -> (module with `main(argv, prog) -> int`, one-line help)
COMMANDS = {
    "generate": ("pjax.text.cli", "generate text from a prompt, a chat or a jsonl file"),
    "bench": ("pjax.bench.cli", "benchmark speculative decoding: throughput, latency, acceptance, exactness"),
    "convert": ("pjax.checkpoint.cli", "inspect / validate checkpoints, write pjax-native copies, re-export heads"),
    "serve": ("pjax.serve.cli", "serve a target (and head) over the OpenAI API: completions, chat, streaming"),
    "check": ("pjax.check.cli", "check pjax on this device: every kernel, every target family, a P-EAGLE head"),
}


def usage() -> str:
    lines = ["usage: python -m pjax COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"error: unknown command {name!r}\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return module.main(rest, prog=f"python -m pjax {name}")

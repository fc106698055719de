"""`python -m pjax serve`: an OpenAI-compatible HTTP server over the continuous-batching engine.

    python -m pjax serve --target DIR [--head DIR] [--tokenizer DIR] [--drafting parallel|sequential|none] [--k K]
        [--max-slots N] [--max-admit-rows N] [--max-len N] [--dtype bfloat16|float32] [--host 127.0.0.1]
        [--port 8000] [--served-model-name NAME] [--rounds-per-step N] [--warmup full|minimal]

Loads the target (and head), builds the engine, compiles its programs (--warmup), then listens; clients speak the
OpenAI API (/v1/completions, /v1/chat/completions, /v1/models, /health), e.g. with the `openai` package. Ctrl-C or
SIGTERM stop accepting connections, give requests in flight up to 5 s to finish, cancel the rest and stop the engine.
Exit codes: 0 stopped by SIGTERM, 1 the server failed, 2 bad usage or bad input (one line naming the flag, the
directory or the address), 130 Ctrl-C (SIGINT).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import signal
import socket
import sys
import time

from pjax.command import dtype_flag, run_command
from pjax.decode.settings import DEFAULT_MAX_LEN, add_flags, config_from_flags
from pjax.dtypes import parse_dtype

__all__ = ["build_parser", "main"]

SHUTDOWN_GRACE_S = 5  # seconds requests in flight get to finish after Ctrl-C / SIGTERM


class InputError(ValueError):
    """Bad input to the command (a flag's value, a directory, the address); the message names it."""


class _Terminated(BaseException):
    """SIGTERM: a requested, clean shutdown."""


def _port(text):
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"{text} must be in [0, 65535] (0: any free port)")
    return v


def build_parser(prog: str = "python -m pjax serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description=__doc__.split("\n\n")[0],
        epilog="endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (stream: true for "
               "server-sent events), GET /health. Ctrl-C / SIGTERM: requests in flight get "
               f"{SHUTDOWN_GRACE_S} s, then the server stops (exit 130 / 0). Guide: docs/guides/serving.md")
    p.add_argument("--target", required=True, metavar="DIR",
                   help="Hugging Face target directory (config.json, safetensors, tokenizer.json)")
    p.add_argument("--head", metavar="DIR", help="P-EAGLE / EAGLE-3 head directory (default: no drafting)")
    p.add_argument("--tokenizer", metavar="DIR", help="tokenizer directory (default: --target)")
    add_flags(p, "drafting", "num_speculative_tokens", "max_slots", "max_admit_rows", "max_len")
    p.add_argument("--dtype", type=dtype_flag, default="bfloat16",
                   help="parameter dtype: bfloat16 (default), float32, float16 (or bf16, f32, f16)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0: all)")
    p.add_argument("--port", type=_port, default=8000, help="port (default 8000; 0: any free port, logged)")
    p.add_argument("--served-model-name", metavar="NAME",
                   help="the model name clients send (default: --target as given)")
    add_flags(p, "rounds_per_step", "prefill", "implementation", "cache_dtype")
    p.add_argument("--warmup", choices=("full", "minimal"), default="full",
                   help="full (default): compile every program traffic can need before listening; minimal: the "
                        "decode program and a one-request short-prompt admission (others compile on first use)")
    return p


def _checked(what: str, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except (ValueError, TypeError) as e:
        raise InputError(f"{what}: {e}" if what else str(e)) from e


def _bind(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port): the port is reserved (a taken one is a one-line error) before the models load;
    it listens only once the server starts (connections before that are refused, not left hanging)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise InputError(f"--host {host}: cannot be resolved ({e.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise InputError(f"--host {host} --port {port}: cannot listen there ({e.strerror})") from None
    return sock


def _warm_up(engine, mode: str, longest_prompt: int) -> float:
    """Compile and run once (no slot changes) the decode program and the admission programs (`Engine.admission_shapes`;
    "minimal": one short single-request admission), logging progress; returns the compile seconds."""
    pairs = [(1, 1)] if mode == "minimal" else engine.admission_shapes(longest_prompt)
    seconds = 0.0
    for i, (n, length) in enumerate(pairs):
        seconds += engine.precompile([n], [length], warm=True)
        if len(pairs) > 1:
            _log(f"compiled admissions of {n} request(s) of up to {length} prompt tokens ({i + 1}/{len(pairs)})")
    return seconds


def _log(msg: str):
    print(f"pjax serve: {msg}", file=sys.stderr, flush=True)


def run(args) -> int:
    if args.drafting in ("parallel", "sequential") and args.head is None:
        raise InputError(f"--drafting {args.drafting} needs --head DIR (or use --drafting none)")
    if args.num_speculative_tokens is not None and (args.head is None or args.drafting == "none"):
        raise InputError("--k needs drafting: give --head DIR (and not --drafting none)")
    try:
        importlib.import_module("uvicorn")  # used by _serve: checked before the models load
        from pjax.serve.async_engine import AsyncEngine
        from pjax.serve.openai_api import create_app
    except ImportError as e:
        raise InputError(f"python -m pjax serve needs the `serve` extra ({e.name} is missing): "
                         "pip install 'pjax[serve]'") from None

    with contextlib.closing(_bind(args.host, args.port)) as sock:
        engine, model = _load(args)
        seconds = _warm_up(engine, args.warmup, model.max_len - model.slack - 1)
        _log(f"compiled ({args.warmup} warm-up) in {seconds:.1f} s")
        bridge = AsyncEngine(engine)
        try:
            host, port = sock.getsockname()[:2]
            url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
            started = _serve(create_app(bridge, model), sock, f"serving {model.name} on {url} (max "
                             f"{engine.max_slots} requests at once, {model.max_len} positions each)")
        finally:
            bridge.close()
    if not started:
        _log("the server failed to start")
        return 1
    return 0


def _load(args):
    """Tokenizer, target, head -> (the engine, the ServedModel)."""
    from pjax.checkpoint import load_drafter, load_target
    from pjax.decode.drafting import resolve
    from pjax.decode.engine import Engine
    from pjax.serve.openai_api import ServedModel
    from pjax.text.tokenizer import load_tokenizer

    t0 = time.perf_counter()
    tokenizer = (_checked("--target", load_tokenizer, args.target) if args.tokenizer is None
                 else _checked("--tokenizer", load_tokenizer, args.tokenizer))
    dtype = parse_dtype(args.dtype)
    target = _checked("--target", load_target, args.target, dtype=dtype)
    drafter = None if args.head is None else _checked("--head", load_drafter, args.head, dtype=dtype, target=target)
    vocab = target.config.vocab_size
    if tokenizer.vocab_size > vocab:
        _log(f"warning: the tokenizer has {tokenizer.vocab_size} tokens but the target's vocabulary is {vocab}: "
             "prompts holding the extra tokens will be refused")
    drafting, k = _checked("--drafting / --k", resolve, drafter, args.drafting, args.num_speculative_tokens)
    mpe = target.config.max_position_embeddings
    max_len = args.max_len or (min(DEFAULT_MAX_LEN, mpe) if mpe else DEFAULT_MAX_LEN)
    config = config_from_flags(args, drafting=drafting, num_speculative_tokens=k or None, max_len=max_len)
    engine = _checked("", Engine, target, drafter if drafting.speculative else None, config)
    slack = engine.slack
    if max_len - slack < 2:
        raise InputError(f"--max-len {max_len}: leaves no room for a prompt and a new token beside the {slack} "
                         f"positions kept for drafting (K = {k})")
    _log(f"loaded {args.target} ({drafting.value} drafting, K = {engine.spec.k}) in {time.perf_counter() - t0:.1f} s")
    model = ServedModel(name=args.served_model_name or args.target, tokenizer=tokenizer, vocab_size=vocab,
                        max_len=max_len, slack=slack, drafting=drafting.value, num_speculative_tokens=engine.spec.k,
                        root=str(args.target))
    return engine, model


def _serve(app, sock: socket.socket, ready_message: str) -> bool:
    """Run uvicorn on the bound socket until Ctrl-C / SIGTERM; logs ready_message once listening. Returns whether
    it started."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if self.started:
                _log(ready_message)

    server = Server(uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=SHUTDOWN_GRACE_S))
    server.run(sockets=[sock])
    return server.started


def _on_sigterm(signum, frame):
    raise _Terminated()


def main(argv=None, prog: str = "python -m pjax serve") -> int:
    args = build_parser(prog).parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if _main_thread() else None
    try:
        return run_command(lambda: run(args), user_errors=(InputError,))
    except _Terminated:
        _log("stopped (SIGTERM)")
        return 0
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _main_thread() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()


if __name__ == "__main__":
    sys.exit(main())

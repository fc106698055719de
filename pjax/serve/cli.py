"""`python -m pjax serve`: an OpenAI-compatible HTTP server over the continuous-batching engine.

    python -m pjax serve --target DIR [--head DIR] [--tokenizer DIR] [--drafting parallel|sequential|none] [--k K]
        [--max-slots N] [--max-admit-rows N] [--max-len N] [--dtype bfloat16|float32] [--host 127.0.0.1]
        [--port 8000] [--served-model-name NAME] [--rounds-per-step N] [--warmup full|minimal]
        [--shutdown-grace S] [--max-request-bytes N] [--request-timeout S] [--keep-alive-timeout S]

Loads the target (and head), builds the engine, compiles its programs (--warmup), then listens; clients speak the
OpenAI API (/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics), e.g. with the `openai` package.
Ctrl-C or SIGTERM stop accepting connections and requests (503), give requests in flight --shutdown-grace seconds to
finish, then abort the rest (finish_reason "abort") and stop the engine.
Exit codes: 0 stopped by SIGTERM, 1 the server failed, 2 bad usage or bad input (one line naming the flag, the
directory or the address), 130 Ctrl-C (SIGINT).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import math
import signal
import socket
import sys
import time

from pjax.command import InputError, checked, dtype_flag, run_command
from pjax.decode.settings import (DEFAULT_MAX_LEN, add_compilation_cache_flag, add_flags, add_mesh_flag,
                                  config_from_flags, mesh_from_flags, number_flag, use_compilation_cache_flag)
from pjax.decode.state import SAMPLING_MODES
from pjax.dtypes import parse_dtype
from pjax.serve.limits import ServerLimits

__all__ = ["build_parser", "main", "make_server"]

SHUTDOWN_GRACE_S = 5.0  # default seconds requests in flight get to finish after Ctrl-C / SIGTERM
ABORT_WAIT_S = 10.0  # then at most this long for the aborted requests to end (one engine step) before their handlers
# are cancelled (each still answers cleanly)


class _Terminated(BaseException):
    """SIGTERM: a requested, clean shutdown."""


_positive = number_flag(int, low=1)
_port = number_flag(int, low=0, high=65535)  # 0: any free port


def _seconds(text):
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"{text} must be a number of seconds > 0")
    return v


def build_parser(prog: str = "python -m pjax serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description=__doc__.split("\n\n")[0],
        epilog="endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (stream: true for "
               "server-sent events), GET /health, GET /metrics (Prometheus). Ctrl-C / SIGTERM: requests in flight "
               "get --shutdown-grace seconds, the rest are aborted, then the server stops (exit 130 / 0). Guide: "
               "docs/guides/serving.md")
    p.add_argument("--target", required=True, metavar="DIR",
                   help="Hugging Face target directory (config.json, safetensors, tokenizer.json)")
    p.add_argument("--head", metavar="DIR", help="P-EAGLE / EAGLE-3 head directory (default: no drafting)")
    p.add_argument("--tokenizer", metavar="DIR", help="tokenizer directory (default: --target)")
    add_flags(p, "drafting", "num_speculative_tokens", "tree_budget", "tree_score", "max_slots", "max_admit_rows",
              "max_len")
    p.add_argument("--dtype", type=dtype_flag, default="bfloat16",
                   help="parameter dtype: bfloat16 (default), float32, float16 (or bf16, f32, f16)")
    p.add_argument("--no-finite-check", action="store_true",
                   help="accept NaN / inf weights (by default every floating tensor is checked, on device)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0: all)")
    p.add_argument("--port", type=_port, default=8000, help="port (default 8000; 0: any free port, logged)")
    p.add_argument("--served-model-name", metavar="NAME",
                   help="the model name clients send (default: --target as given)")
    add_flags(p, "rounds_per_step", "prefill", "implementation", "cache_dtype")
    add_mesh_flag(p)
    p.add_argument("--warmup", choices=("full", "minimal"), default="full",
                   help="full (default): compile every program traffic can need before listening; minimal: the "
                        "decode program and a one-request short-prompt admission (others compile on first use)")
    add_compilation_cache_flag(p, " (a MoE target's full warm-up compiles for minutes)")
    limits = ServerLimits()
    p.add_argument("--shutdown-grace", type=_seconds, default=SHUTDOWN_GRACE_S, metavar="S",
                   help=f"after Ctrl-C / SIGTERM, seconds requests in flight get to finish before the rest are aborted "
                        f"(default {SHUTDOWN_GRACE_S:g}); the process exits about one engine step later")
    p.add_argument("--max-request-bytes", type=_positive, default=limits.max_body_bytes, metavar="N",
                   help=f"largest request body (default {limits.max_body_bytes}); larger ones get 413")
    p.add_argument("--request-timeout", type=_seconds, default=limits.body_timeout_s, metavar="S",
                   help=f"seconds a client has to send a request's head, and then its body (default "
                        f"{limits.body_timeout_s:g}); slower ones are closed / get 408")
    p.add_argument("--keep-alive-timeout", type=_seconds, default=5.0, metavar="S",
                   help="seconds an idle keep-alive connection stays open (default 5)")
    return p


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
    """Compile and run once (no slot changes) the decode programs and the admission programs (`Engine.admission_shapes`;
    "minimal": one short single-request admission, and no decode program for top-k / top-p), logging progress; returns
    the compile seconds."""
    pairs = [(1, 1)] if mode == "minimal" else engine.admission_shapes(longest_prompt)
    sampling = SAMPLING_MODES[:2] if mode == "minimal" else SAMPLING_MODES  # minimal: no top-k / top-p program
    seconds = 0.0
    for i, (n, length) in enumerate(pairs):
        seconds += engine.precompile([n], [length], warm=True, sampling=sampling)
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
        importlib.import_module("prometheus_client")
        from pjax.serve.async_engine import AsyncEngine
        from pjax.serve.openai_api import create_app
    except ImportError as e:
        raise InputError(f"python -m pjax serve needs the `serve` extra ({e.name} is missing): "
                         "pip install 'pjax[serve]'") from None

    use_compilation_cache_flag(args.compilation_cache, InputError)
    with contextlib.closing(_bind(args.host, args.port)) as sock:
        engine, model = _load(args)
        seconds = _warm_up(engine, args.warmup, model.max_len - model.slack - 1)
        _log(f"compiled ({args.warmup} warm-up) in {seconds:.1f} s")
        bridge = AsyncEngine(engine)
        try:
            host, port = sock.getsockname()[:2]
            url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
            limits = ServerLimits(max_body_bytes=args.max_request_bytes, body_timeout_s=args.request_timeout)
            started = _serve(create_app(bridge, model, limits=limits), sock,
                             f"serving {model.name} on {url} (max {engine.max_running} requests at once, "
                             f"{model.max_len} positions each)", grace_s=args.shutdown_grace,
                             head_timeout_s=args.request_timeout, keep_alive_s=args.keep_alive_timeout)
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
    tokenizer = (checked("--target", load_tokenizer, args.target) if args.tokenizer is None
                 else checked("--tokenizer", load_tokenizer, args.tokenizer))
    dtype = parse_dtype(args.dtype)
    check = not args.no_finite_check
    mesh = checked("--tensor-parallel", mesh_from_flags, args)
    target = checked("--target", load_target, args.target, dtype=dtype, check_finite=check, mesh=mesh)
    drafter = None if args.head is None else checked("--head", load_drafter, args.head, dtype=dtype, target=target,
                                                     check_finite=check, mesh=mesh)
    vocab = target.config.vocab_size
    if tokenizer.vocab_size > vocab:
        _log(f"warning: the tokenizer has {tokenizer.vocab_size} tokens but the target's vocabulary is {vocab}: "
             "prompts holding the extra tokens will be refused")
    drafting, k = checked("--drafting / --k", resolve, drafter, args.drafting, args.num_speculative_tokens)
    mpe = target.config.max_position_embeddings
    max_len = args.max_len or (min(DEFAULT_MAX_LEN, mpe) if mpe else DEFAULT_MAX_LEN)
    auto = "auto" in (args.num_speculative_tokens, args.tree_budget)
    config = config_from_flags(args, drafting=drafting, num_speculative_tokens="auto" if auto else k or None,
                               max_len=max_len)
    engine = checked("", Engine, target, drafter if drafting.speculative else None, config, mesh=mesh)
    slack = engine.slack
    if max_len - slack < 2:
        raise InputError(f"--max-len {max_len}: leaves no room for a prompt and a new token beside the {slack} "
                         f"positions kept for drafting (K = {k})")
    budget = f"K = auto ({', '.join(map(str, engine.budgets))})" if auto else f"K = {engine.spec.k}"
    _log(f"loaded {args.target} ({drafting.value} drafting, {budget}) in {time.perf_counter() - t0:.1f} s")
    model = ServedModel(name=args.served_model_name or args.target, tokenizer=tokenizer, vocab_size=vocab,
                        max_len=max_len, slack=slack, drafting=drafting.value, num_speculative_tokens=engine.spec.k,
                        root=str(args.target))
    return engine, model


def make_server(app, *, grace_s: float = SHUTDOWN_GRACE_S, head_timeout_s: float = ServerLimits.body_timeout_s,
                keep_alive_s: float = 5.0, ready_message: str = "", log_level: str = "info"):
    """A uvicorn server for `app` (`pjax.serve.openai_api.create_app`'s): its shutdown calls
    app.state.begin_shutdown(grace_s) first (requests in flight get grace_s, the rest are aborted); a connection whose
    request head has not arrived head_timeout_s after its first byte (or its opening) is closed."""
    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol

    _configure_logging()

    class Protocol(H11Protocol):
        _head_timer = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm_head_timer()

        def data_received(self, data: bytes):
            if self._head_timer is None and self._between_requests():
                self._arm_head_timer()
            super().data_received(data)

        def handle_events(self):
            super().handle_events()
            if self._head_timer is not None and not self._between_requests():  # a request's head arrived
                self._head_timer.cancel()
                self._head_timer = None

        def connection_lost(self, exc):
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

        def _between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm_head_timer(self):
            self._head_timer = self.loop.call_later(head_timeout_s, self._head_timeout)

        def _head_timeout(self):
            self._head_timer = None
            if self._between_requests() and not self.transport.is_closing():
                client = "%s:%d" % self.client if self.client else "a client"
                logging.getLogger("pjax.serve").info("%s sent no complete request head within %g s: connection "
                                                     "closed", client, head_timeout_s)
                self.transport.close()

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if self.started and ready_message:
                _log(ready_message)

        async def shutdown(self, sockets=None):
            app.state.begin_shutdown(grace_s)
            await super().shutdown(sockets=sockets)

    return Server(uvicorn.Config(app, log_level=log_level, http=Protocol, timeout_keep_alive=keep_alive_s,
                                 timeout_graceful_shutdown=grace_s + ABORT_WAIT_S))


def _configure_logging():
    """The app's one-line notices (clients that went away, slow connections) on stderr, as the other log lines."""
    log = logging.getLogger("pjax.serve")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("pjax serve: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def _serve(app, sock: socket.socket, ready_message: str, **options) -> bool:
    """Run the server (`make_server(app, **options)`) on the bound socket until Ctrl-C / SIGTERM; logs ready_message
    once listening. Returns whether it started."""
    server = make_server(app, ready_message=ready_message, **options)
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

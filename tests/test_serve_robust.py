"""The server against demanding and hostile clients, live on 127.0.0.1 (the tiny Llama of tests.text_utils, a random
P-EAGLE head): malformed bodies (a fuzzed schema and a corpus) are 4xx JSON errors, never 500s; a huge prompt does
not stall the other clients; body size and slow-client limits; clients that go away are one log line; /metrics
counts what the responses report; and `python -m pjax serve` shut down under load ends every request cleanly and
exits within its grace period.
"""
import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from prometheus_client.parser import text_string_to_metric_families

import pjax.text as T
from pjax.serve.async_engine import AsyncEngine
from pjax.serve.cli import _bind, make_server
from pjax.serve import Engine, EngineConfig, Event
from pjax.serve.openai_api import COMPLETION_FIELDS, CHAT_FIELDS, ServedModel, ServerLimits, create_app
from tests.engine_utils import FAST
from tests.text_utils import CHAT, V, build

ROOT = Path(__file__).resolve().parents[1]
NAME = "tiny-llama"
K = 3
MAX_LEN = 256
LIMIT = 8 * 2 ** 20
HEAD_TIMEOUT = 1.0
BODY_TIMEOUT = 1.5


class Notices(logging.Handler):
    """The app's one-line notices ("pjax.serve") and uvicorn's error log, as formatted text."""

    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(self.format(record) + (f"\n{record.exc_info}" if record.exc_info else ""))

    def text(self) -> str:
        return "\n".join(self.lines)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return build(tmp_path_factory.mktemp("serve_robust"))


@pytest.fixture(scope="module")
def gen(dirs):
    return T.load(*dirs, dtype="float32", compiler_options=FAST)


@pytest.fixture(scope="module")
def served(dirs, gen):
    """(url, notices): the command's uvicorn server (make_server) on a free port, from a background thread."""
    engine = Engine(gen.target, gen.drafter, EngineConfig(max_slots=4, max_len=MAX_LEN, num_speculative_tokens=K,
                                                          drafting="parallel", rounds_per_step=2,
                                                          compiler_options=FAST))
    bridge = AsyncEngine(engine)
    model = ServedModel(name=NAME, tokenizer=gen.tokenizer, vocab_size=V, max_len=MAX_LEN, slack=2 * K,
                        drafting="parallel", num_speculative_tokens=K, root=str(dirs[0]))
    app = create_app(bridge, model, limits=ServerLimits(max_body_bytes=LIMIT, body_timeout_s=BODY_TIMEOUT))
    server = make_server(app, head_timeout_s=HEAD_TIMEOUT, log_level="warning")
    notices = Notices()
    for name in ("pjax.serve", "uvicorn.error"):
        logging.getLogger(name).addHandler(notices)
    sock = _bind("127.0.0.1", 0)
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", notices
    server.should_exit = True
    thread.join(30)
    bridge.close()
    sock.close()
    for name in ("pjax.serve", "uvicorn.error"):
        logging.getLogger(name).removeHandler(notices)


def post(url, path, content, **kw):
    return httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=60, **kw)


def assert_json_error(r, status=None):
    assert 400 <= r.status_code < 500 and (status is None or r.status_code == status), (r.status_code, r.text[:300])
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["message"], e
    return e


# ------------------------------------------------------------------------------------------ malformed requests
BAD = [  # (path, raw body, param, message pattern)
    ("/v1/completions", '{"model": "tiny-llama", "prompt": "a\\ud800b", "max_tokens": 2}', "prompt",
     r"prompt: a lone surrogate '\\ud800' at character 1 is not Unicode text"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages",
     r"messages\[0\]\.content: a lone surrogate"),
    ("/v1/completions", '{"prompt": "hi", "stop": ["\\ud83d"]}', "stop", r"stop\[0\]: a lone surrogate"),
    ("/v1/completions", '{"prompt": "hi", "\\ud800": 1}', None, r"a lone surrogate"),
    ("/v1/completions", "[" * 100_000 + "]" * 100_000, None, r"nests deeper than 32 levels"),
    ("/v1/completions", '{"prompt": "hi", "metadata": ' + "[" * 40 + "]" * 40 + "}", "metadata",
     r"nests deeper than 32 levels"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 1' + "0" * 5000 + "}", None, r"not valid JSON"),
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', None, r"not valid JSON"),
    ("/v1/completions", '{"prompt": "hi", "temperature": NaN}', "temperature",
     r"temperature must be a finite number, got nan$"),
    ("/v1/completions", '{"prompt": "hi", "top_p": 1e400}', "top_p", r"top_p must be a finite number, got inf$"),
    ("/v1/completions", '{"prompt": {"a": 1}}', "prompt", r"prompt must be a string"),
    ("/v1/completions", '{"prompt": [1.5, 2]}', "prompt", r"prompt must be a string"),
    ("/v1/completions", '{"prompt": [[1, 2], [3]]}', "prompt", r"one prompt per request"),
    ("/v1/completions", '{"prompt": "hi", "stream": "yes"}', "stream", r"stream must be true or false"),
    ("/v1/completions", '{"prompt": "hi", "seed": 1e3}', "seed", r"seed must be an integer"),
    ("/v1/completions", '{"prompt": "hi", "stop_token_ids": [true]}', "stop_token_ids", r"array of token ids"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": []}',
     "chat_template_kwargs", r"must be an object"),
    ("/v1/chat/completions", '{"messages": [{"role": ["user"], "content": "hi"}]}', "messages", r""),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": 5}]}', "messages", r""),
    ("/v1/completions", "", None, r"not valid JSON"),
    ("/v1/completions", "null", None, r"must be a JSON object"),
]


def test_a_corpus_of_malformed_bodies_gets_4xx_json_errors(served):
    url, notices = served
    for path, body, param, pattern in BAD:
        e = assert_json_error(post(url, path, body), 400)
        assert e["param"] == param and re.search(pattern, e["message"]), (body[:80], e)
    assert "Traceback" not in notices.text() and "Exception in ASGI" not in notices.text()


def _json_values():
    text = st.text(st.characters(codec=None, categories=None), max_size=12) | st.sampled_from(
        ["\ud800", "a\udfffb", "hi", "", "tiny-llama", "user", "text", "\x00"])
    scalars = (st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.sampled_from([0, 1, 2, -1, 255, 256])
               | st.floats(allow_nan=True, allow_infinity=True) | text)
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.sampled_from(["role", "content", "type", "text", "include_usage"]) | text,
                                          inner, max_size=4), max_leaves=12)


def _bodies(fields):
    """Objects with some of the schema's fields (values of any JSON type, often near-valid ones), objects with other
    keys, and bare JSON values."""
    values = _json_values()
    near = {"max_tokens": st.integers(-2, 4), "max_completion_tokens": st.integers(-2, 4),
            "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "tool"]) | values,
                                                        "content": values}), max_size=3),
            "prompt": st.sampled_from(["hi", [5, 6], [[5]], ["a"], []])}
    keys = st.lists(st.sampled_from(sorted(fields)), max_size=6, unique=True)
    body = keys.flatmap(lambda ks: st.fixed_dictionaries({k: near[k] | values if k in near else values for k in ks}))
    return body | st.dictionaries(st.text(max_size=8), values, max_size=3) | values


def _fuzz(url, path, body):
    raw = json.dumps(body, ensure_ascii=True, allow_nan=True)  # lone surrogates travel as \ud800 escapes
    r = post(url, path, raw)
    if r.status_code == 200:
        if "text/event-stream" in r.headers["content-type"]:
            lines = [line for line in r.text.splitlines() if line]
            assert lines[-1] == "data: [DONE]" and '"finish_reason":"' in r.text, r.text[-300:]
        else:
            assert r.json()["choices"][0]["finish_reason"] in ("stop", "length", "error"), r.text
    else:
        assert_json_error(r)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
@given(body=_bodies(COMPLETION_FIELDS), chat=st.booleans(), chat_body=_bodies(CHAT_FIELDS))
def test_fuzzed_request_bodies_are_answered_or_4xx_json_errors(served, body, chat, chat_body):
    """Bodies drawn from the request schema's fields with values of every JSON type (lone surrogates, deep nesting,
    huge integers, NaN): each is a finished response or a 4xx JSON error, never a 500."""
    url, _ = served
    if chat:
        _fuzz(url, "/v1/chat/completions", chat_body)
    else:
        _fuzz(url, "/v1/completions", body)


def test_no_500_seen_while_fuzzing(served):
    text = served[1].text()
    assert "Traceback" not in text and "Exception in ASGI" not in text, text[-2000:]


# ------------------------------------------------------------------------------------------ stalls and limits
def test_a_huge_prompt_does_not_stall_other_clients(served, gen):
    """Three clients send 3 MB prompts (a chat and two completions) while another sends small requests: the small
    ones are answered at their usual speed, and the huge ones are refused as too long without being tokenized."""
    url, _ = served
    huge = "The quick brown fox jumps over the lazy dog. " * (3 * 2 ** 20 // 45)
    results, small = [], []

    def big(path, body):
        results.append(post(url, path, json.dumps(body)))

    threads = [threading.Thread(target=big, args=a) for a in (
        ("/v1/completions", {"prompt": huge, "max_tokens": 2}),
        ("/v1/completions", {"prompt": huge, "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}], "max_tokens": 2}))]
    with httpx.Client(timeout=60) as c:
        c.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}).raise_for_status()  # warm
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            t0 = time.perf_counter()
            r = c.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "temperature": 0})
            small.append(time.perf_counter() - t0)
            assert r.status_code == 200
    for t in threads:
        t.join()
    assert len(small) >= 1 and max(small) < 1.5, small
    for r in results:
        e = assert_json_error(r, 400)
        assert re.search(r"characters cannot fit: this server's max length 256 leaves at most 249 prompt tokens",
                         e["message"]), e


def raw_http(url, data: bytes, *, close_after=False, read=True, timeout=10.0) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(data)
        if close_after:
            return b""
        out = b""
        if read:
            while True:
                try:
                    chunk = s.recv(65536)
                except (ConnectionResetError, socket.timeout):
                    break
                if not chunk:
                    break
                out += chunk
        return out


def test_body_size_limit_is_413(served):
    url, _ = served
    # a Content-Length over the limit is refused before the body is sent
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {LIMIT + 1}\r\n\r\n").encode()
    reply = raw_http(url, head)
    assert reply.startswith(b"HTTP/1.1 413 ") and b"larger than this server's limit of 8388608 bytes" in reply
    # a chunked body that grows past the limit
    body = json.dumps({"prompt": "x" * (LIMIT + 10)}).encode()

    def chunks():
        for i in range(0, len(body), 2 ** 20):
            yield body[i:i + 2 ** 20]
    try:
        r = httpx.post(url + "/v1/completions", content=chunks(), timeout=60)
        assert_json_error(r, 413)
    except httpx.WriteError:  # the server answered 413 and closed while the rest was still being sent
        pass
    assert httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=60).status_code == 200


def test_slow_and_vanishing_clients(served):
    """A connection that never completes its request head is closed after the head timeout; a body that stops
    arriving is a 408 after the body timeout; a client that goes away mid-body or mid-stream is one log line, and
    nothing is a traceback."""
    url, notices = served
    del notices.lines[:]
    with httpx.Client(timeout=60) as c:  # an idle keep-alive connection is the keep-alive timeout's, not the head's
        c.get(url + "/health").raise_for_status()
        time.sleep(HEAD_TIMEOUT + 0.5)
        c.get(url + "/health").raise_for_status()
    assert notices.lines == []
    t0 = time.monotonic()
    assert raw_http(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n") == b""  # closed, no reply
    assert HEAD_TIMEOUT - 0.1 <= time.monotonic() - t0 < HEAD_TIMEOUT + 3
    assert raw_http(url, b"") == b""  # a connection that sends nothing at all
    partial = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n" \
              b"\r\n{\"prompt\": "
    t0 = time.monotonic()
    reply = raw_http(url, partial)
    assert reply.startswith(b"HTTP/1.1 408 ") and b"did not arrive within 1.5 s" in reply, reply
    assert BODY_TIMEOUT - 0.1 <= time.monotonic() - t0 < BODY_TIMEOUT + 3
    raw_http(url, partial, close_after=True)  # goes away mid-body
    with httpx.stream("POST", url + "/v1/completions", json={"prompt": "hi", "max_tokens": MAX_LEN - 2 * K - 8,
                                                             "ignore_eos": True, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # goes away mid-stream
    deadline = time.monotonic() + 10
    while len([line for line in notices.lines if "disconnected" in line]) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    while httpx.get(url + "/health").json()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    text = notices.text()
    assert re.search(r"127\.0\.0\.1:\d+ sent no complete request head within 1 s: connection closed", text), text
    assert re.search(r"127\.0\.0\.1:\d+ disconnected while sending its request", text), text
    assert re.search(r"127\.0\.0\.1:\d+ disconnected mid-stream: its request is cancelled", text), text
    assert all("\n" not in line for line in notices.lines), text
    assert "Traceback" not in text and "Exception" not in text, text


# ------------------------------------------------------------------------------------------ metrics
def scrape(url) -> dict:
    r = httpx.get(url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k not in ("model_name", "engine")}
            assert s.labels.get("model_name") == NAME and s.labels.get("engine") == "0", s
            out[(s.name, tuple(sorted(labels.items())))] = s.value
    return out


def test_metrics_count_what_the_responses_report(served):
    url, _ = served
    before = scrape(url)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    rs = [client.completions.create(model=NAME, prompt=p, max_tokens=n, temperature=0,
                                    extra_body={"ignore_eos": True})
          for p, n in (("The quick brown fox", 12), ("def add(a, b):", 20), ("Name three primes:", 7))]
    rs.append(client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=9, temperature=0.7, seed=3,
                                             extra_body={"ignore_eos": True}))
    chunks = list(client.completions.create(model=NAME, prompt="Hello", max_tokens=15, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    usage, stats = [r.usage for r in rs] + [chunks[-1].usage], [r.model_extra["pjax"] for r in rs]
    stats.append(next(ch.model_extra["pjax"] for ch in chunks if ch.choices and ch.choices[0].finish_reason))
    after = scrape(url)

    def delta(name, **labels):
        key = (name, tuple(sorted((k, str(v)) for k, v in labels.items())))
        return after[key] - before.get(key, 0.0)

    assert delta("vllm:prompt_tokens_total") == sum(u.prompt_tokens for u in usage)
    assert delta("vllm:generation_tokens_total") == sum(u.completion_tokens for u in usage) == 12 + 20 + 7 + 9 + 15
    assert delta("vllm:request_success_total", finished_reason="length") == 5
    drafts = sum(s["num_drafts"] for s in stats)
    assert drafts > 0 and delta("vllm:spec_decode_num_drafts_total") == drafts
    assert delta("vllm:spec_decode_num_draft_tokens_total") == K * drafts
    accepted = sum(s["num_accepted_tokens"] for s in stats)
    assert delta("vllm:spec_decode_num_accepted_tokens_total") == accepted
    per_pos = [delta("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=i) for i in range(K)]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    assert per_pos == [sum(round(s["acceptance_rates"][i] * s["num_drafts"]) for s in stats) for i in range(K)]
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:time_per_output_token_seconds"):
        assert delta(name + "_count") == 5, name
    assert delta("vllm:e2e_request_latency_seconds_sum") == pytest.approx(sum(s["e2e_s"] for s in stats), rel=1e-6)
    assert delta("vllm:time_to_first_token_seconds_sum") == pytest.approx(sum(s["ttft_s"] for s in stats), rel=1e-6)
    assert after[("vllm:num_requests_running", ())] == after[("vllm:num_requests_waiting", ())] == 0


def test_each_app_has_its_own_registry(gen):
    """Two apps in one process: separate registries, no duplicate-metric error."""
    model = ServedModel(name=NAME, tokenizer=gen.tokenizer, vocab_size=V, max_len=MAX_LEN, slack=0, drafting="none",
                        num_speculative_tokens=0)
    bridges = [AsyncEngine(_IdleEngine()) for _ in range(2)]
    try:
        apps = [create_app(b, model) for b in bridges]
        assert apps[0].state.metrics.registry is not apps[1].state.metrics.registry
        text = apps[0].state.metrics.exposition().decode()
        assert "vllm:num_requests_running{" in text and "spec_decode" not in text  # no drafting: no spec_decode
    finally:
        for b in bridges:
            b.close()


class _IdleEngine:
    has_work, num_running, num_waiting = False, 0, 0


# ------------------------------------------------------------------------------------------ shutdown under load
def run_serve(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))  # the suite's XLA flags (conftest.py)
    return subprocess.Popen([sys.executable, "-m", "pjax", "serve", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)


async def _one(client: httpx.AsyncClient, url: str, i: int, started: asyncio.Event) -> tuple:
    """One request of the load: ("json", status, body) or ("sse", status, lines) or ("broken", error)."""
    stream = i % 2 == 0
    body = {"model": NAME, "prompt": f"request {i}: The quick brown fox", "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    try:
        if not stream:
            r = await client.post(url + "/v1/completions", json=body)
            return ("json", r.status_code, r.json())
        lines = []
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line:
                    lines.append(line)
                    if len(lines) >= 3:
                        started.set()
        return ("sse", r.status_code, lines)
    except httpx.HTTPError as e:
        return ("broken", repr(e))


def test_shutdown_under_load_ends_every_request_cleanly(dirs):
    """48 requests (half streaming) on 2 slots; the signal comes once streams are flowing: every request ends as a
    finished or aborted 200 (a stream: its final chunk, then [DONE]) or a 503 JSON error, none broken, no traceback,
    all within the grace period (1 s) plus a step, and the process exits."""
    target, head = dirs
    p = run_serve("--target", target, "--head", head, "--k", K, "--dtype", "float32", "--max-len", MAX_LEN,
                  "--max-slots", 2, "--max-admit-rows", 1, "--port", 0, "--served-model-name", NAME,
                  "--warmup", "minimal", "--shutdown-grace", 1, "--rounds-per-step", 1)
    try:
        lines = []
        for line in p.stderr:
            lines.append(line)
            m = re.search(r"serving tiny-llama on (http://127\.0\.0\.1:\d+)", line)
            if m:
                break
        else:
            pytest.fail("".join(lines))
        url = m.group(1)

        async def load():
            started = asyncio.Event()
            async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=100)) as client:
                tasks = [asyncio.ensure_future(_one(client, url, i, started)) for i in range(48)]
                await asyncio.wait_for(started.wait(), 60)
                await asyncio.sleep(0.2)
                p.send_signal(signal.SIGTERM)  # Ctrl-C takes the same path (test_serve_api's SIGINT tests)
                t0 = time.monotonic()
                return await asyncio.gather(*tasks), t0, time.monotonic() - t0
        outcomes, signalled, responded = asyncio.run(load())
        _, err = p.communicate(timeout=30)
        exited = time.monotonic() - signalled
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err
    # every response ended within the grace period and a step; the process then stopped the engine and exited (the
    # interpreter's teardown with JAX takes about 2 s of it on an idle 2-core machine)
    assert responded < 1 + 3 and exited < 1 + 15, (responded, exited)
    assert "Traceback" not in err and "Exception in ASGI" not in err and "CancelledError" not in err, err
    finishes, unavailable = [], 0
    for kind, status, *rest in outcomes:
        assert kind != "broken", (status, err[-2000:])
        if status == 503:
            unavailable += 1
            assert kind == "json" and rest[0]["error"]["type"] == "service_unavailable", rest
            continue
        assert status == 200, (kind, status, rest)
        if kind == "json":
            finishes.append(rest[0]["choices"][0]["finish_reason"])
        else:
            events = rest[0]
            assert events[-1] == "data: [DONE]", events[-3:]
            last = json.loads(events[-2].removeprefix("data: "))
            finishes.append(last["choices"][0]["finish_reason"])
            assert all(json.loads(e.removeprefix("data: "))["choices"][0]["finish_reason"] is None
                       for e in events[:-2])
    assert set(finishes) <= {"length", "abort"} and "abort" in finishes, finishes
    assert unavailable >= 1  # queued non-streaming requests that never started


class _StuckEngine:
    """An engine that emits a token per running request every 20 ms and never ends one, even when cancelled (a
    device step that never returns, as far as the requests can tell)."""
    max_slots = 2

    def __init__(self):
        self.running = []

    def submit(self, prompt, params):
        self.running.append(len(self.running))
        return self.running[-1]

    def cancel(self, request_id, keep=None):
        pass

    has_work = property(lambda self: bool(self.running))
    num_running = property(lambda self: len(self.running))
    num_waiting = 0

    def step(self):
        time.sleep(0.02)
        return [Event(r, [5], False) for r in self.running]


@contextlib.contextmanager
def _stuck_server(gen):
    """(server, url, thread): the command's uvicorn server (grace 0.5 s) over an engine that never finishes a step,
    started on a free port in a background thread."""
    bridge = AsyncEngine(_StuckEngine())
    model = ServedModel(name=NAME, tokenizer=gen.tokenizer, vocab_size=V, max_len=MAX_LEN, slack=0, drafting="none",
                        num_speculative_tokens=0)
    server = make_server(create_app(bridge, model), grace_s=0.5, log_level="warning")
    sock = _bind("127.0.0.1", 0)
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.01)
        yield server, f"http://127.0.0.1:{sock.getsockname()[1]}", thread
    finally:
        bridge.close()
        sock.close()


def test_requests_that_outlive_the_shutdown_still_end_cleanly(gen, monkeypatch):
    """Requests the aborts cannot end (the engine is stuck) are ended by the server once its grace period and abort
    wait are over: a stream with an error chunk and [DONE], a plain request with a 503 JSON error; no traceback."""
    import pjax.serve.cli as cli

    monkeypatch.setattr(cli, "ABORT_WAIT_S", 0.5)
    notices = Notices()
    logging.getLogger("uvicorn.error").addHandler(notices)
    try:
        with _stuck_server(gen) as (server, url, thread):
            body = {"model": NAME, "prompt": "hi", "max_tokens": 100}
            out = {}

            def plain():
                out["plain"] = httpx.post(url + "/v1/completions", json=body, timeout=30)
            t = threading.Thread(target=plain)
            t.start()
            with httpx.stream("POST", url + "/v1/completions", json=dict(body, stream=True), timeout=30) as r:
                lines = []
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                    if len(lines) == 2:
                        t0 = time.monotonic()
                        server.should_exit = True
            t.join(30)
            thread.join(30)
            assert not thread.is_alive() and time.monotonic() - t0 < 0.5 + 0.5 + 2
    finally:
        logging.getLogger("uvicorn.error").removeHandler(notices)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2].removeprefix("data: "))["error"]["message"] == (
        "the server shut down before the request finished")
    r = out["plain"]
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable", r.text
    assert "Traceback" not in notices.text() and "Exception in ASGI" not in notices.text(), notices.text()


class _OneTokenEngine:
    """Finishes each request with one token at the next step."""
    max_slots, num_waiting = 1, 0

    def __init__(self):
        self.queued = []

    def submit(self, prompt, params):
        self.queued.append(len(self.queued))
        return self.queued[-1]

    has_work = property(lambda self: bool(self.queued))
    num_running = property(lambda self: len(self.queued))

    def step(self):
        events = [Event(r, [5], True, "length", {}) for r in self.queued]
        self.queued = []
        return events


def test_a_failing_listener_does_not_stop_the_engine():
    """A finished-request listener that raises (a metrics bug) is one warning: the request still gets its final
    event and the engine serves the next one."""
    bridge = AsyncEngine(_OneTokenEngine())
    bridge.add_listener(lambda event, stream: event.stats["prompt_tokens"])
    notices = Notices()
    logging.getLogger("pjax.serve").addHandler(notices)

    async def events_of_one():
        return [e async for e in await bridge.submit([1], None)]

    async def one():
        return await asyncio.wait_for(events_of_one(), 30)
    try:
        for _ in range(2):
            events = asyncio.run(one())
            assert [(e.new_tokens, e.finished) for e in events] == [([5], True)] and bridge.alive
    finally:
        bridge.close()  # joins the engine thread: the listeners run after a request's final event is delivered
        logging.getLogger("pjax.serve").removeHandler(notices)
    assert notices.lines == ["a finished-request listener failed: KeyError: 'prompt_tokens'"] * 2


def test_a_body_still_arriving_at_the_end_of_the_grace_period_gets_503(gen):
    """A client still sending its body when the grace period ends gets a 503 then, not at its body timeout or when the
    server stops waiting."""
    with _stuck_server(gen) as (server, url, thread):
        out = {}

        def slow_client():
            out["reply"] = raw_http(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            out["t"] = time.monotonic()
        t = threading.Thread(target=slow_client)
        t.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        server.should_exit = True
        t.join(30)
        thread.join(30)
    assert out["reply"].startswith(b"HTTP/1.1 503 ") and b"the server is shutting down" in out["reply"], out
    assert out["t"] - t0 < 0.5 + 2 and not thread.is_alive()

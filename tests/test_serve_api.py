"""`python -m pjax serve` and its pieces, with a real server and real clients: uvicorn on a free port (a background
thread; a subprocess for the command), the official `openai` client and httpx. A tiny Llama with a trained BPE
tokenizer and a chat template, and a random P-EAGLE head (tests.text_utils).

Greedy outputs equal pjax.text's TextGenerator for the same prompt / chat; streamed deltas concatenate to the
non-streamed text; stop strings and max_tokens end requests with vLLM's finish reasons; concurrent streaming clients
share the device batch and each gets its single-request output; bad fields are 400s naming the field; a client that
disconnects frees its slot; the command starts, serves and stops on SIGINT / SIGTERM with the documented exit codes.
"""
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

import pjax.text as T
from pjax.serve.async_engine import AsyncEngine
import pjax.serve.cli as cli
from pjax.serve.cli import _bind, _warm_up
from pjax.decode.engine import Engine, EngineConfig, Event, RequestParams
from pjax.serve.openai_api import ServedModel, _until_disconnect, create_app
from tests.engine_utils import FAST
from tests.text_utils import CHAT, V, build

ROOT = Path(__file__).resolve().parents[1]
NAME = "tiny-llama"
K = 3
MAX_LEN = 256
SLOTS = 4
NEW = 16


class LiveServer:
    """uvicorn serving `app` on a free loopback port from a background thread."""

    def __init__(self, app):
        sock = _bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs=dict(sockets=[sock]), daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.01)

    def close(self):
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return build(tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="module")
def gen(dirs):
    return T.load(*dirs, dtype="float32", compiler_options=FAST)


@pytest.fixture(scope="module")
def served(dirs, gen):
    """(url, engine, bridge, steps): a live server over an engine of SLOTS slots; steps records (running, waiting)
    after every engine step and every event."""
    engine = Engine(gen.target, gen.drafter, EngineConfig(max_slots=SLOTS, max_len=MAX_LEN, num_speculative_tokens=K,
                                                          drafting="parallel", rounds_per_step=2,
                                                          compiler_options=FAST))
    steps, step = [], engine.step

    def recording_step():
        events = step()
        steps.append((engine.num_running, engine.num_waiting, events))
        return events
    engine.step = recording_step
    bridge = AsyncEngine(engine)
    model = ServedModel(name=NAME, tokenizer=gen.tokenizer, vocab_size=V, max_len=MAX_LEN, slack=2 * K,
                        drafting="parallel", num_speculative_tokens=K, root=str(dirs[0]))
    server = LiveServer(create_app(bridge, model))
    yield server.url, engine, bridge, steps
    server.close()
    bridge.close()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="none", max_retries=0, timeout=120)


def want(gen, prompt, **kw):
    kw.setdefault("max_new_tokens", NEW)
    return gen.generate(prompt, k=K, **kw)


def test_models_and_health(client, served):
    models = client.models.list().data
    assert [m.id for m in models] == [NAME] and models[0].model_extra["max_model_len"] == MAX_LEN
    r = httpx.get(served[0] + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok", "running": 0, "waiting": 0}


def test_completion_equals_text_generator(client, gen):
    prompt = "The quick brown fox"
    ref = want(gen, prompt)
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=NEW, temperature=0)
    c = r.choices[0]
    assert c.text == ref.text and c.finish_reason == ref.finish_reason
    ids = gen.tokenizer.encode(prompt)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(ref.token_ids))
    assert r.usage.total_tokens == len(ids) + len(ref.token_ids) and r.id.startswith("cmpl-")
    stats = r.model_extra["pjax"]
    assert stats["drafting"] == "parallel" and stats["num_speculative_tokens"] == K
    assert stats["num_drafts"] >= 1 and 1.0 <= stats["mean_acceptance_length"] <= K + 1
    assert len(stats["acceptance_rates"]) == K
    # token ids in, the same text out; streamed deltas concatenate to it, the last chunk carries the finish reason
    assert client.completions.create(model=NAME, prompt=ids, max_tokens=NEW, temperature=0).choices[0].text == ref.text
    chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=NEW, temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == ref.text
    assert [ch.choices[0].finish_reason for ch in chunks][-1] == ref.finish_reason
    assert all(ch.choices[0].finish_reason is None for ch in chunks[:-1]) and "pjax" in chunks[-1].model_extra


def test_chat_equals_text_generator_streamed_with_usage(client, gen):
    ref = want(gen, CHAT)
    r = client.chat.completions.create(model=NAME, messages=CHAT, max_completion_tokens=NEW, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason and r.object == "chat.completion"
    assert r.usage.prompt_tokens == len(gen.tokenizer.render(CHAT))
    chunks = list(client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=NEW, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks[:-1]) == ref.text
    assert chunks[-2].choices[0].finish_reason == ref.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == r.usage.model_dump()
    assert all(ch.usage is None for ch in chunks[:-1])


def test_stop_string_and_length(client, gen, served):
    free = want(gen, "Name three prime numbers.", chat=True, ignore_eos=True)
    at = next(i for i in range(len(free.text) // 2, len(free.text) - 1) if "\ufffd" not in free.text[i:i + 2])
    stop = free.text[at:at + 2]
    ref = want(gen, "Name three prime numbers.", chat=True, ignore_eos=True, stop=[stop])
    assert ref.finish_reason == "stop" and len(ref.token_ids) < NEW
    msgs = [{"role": "user", "content": "Name three prime numbers."}]
    kw = dict(model=NAME, messages=msgs, max_tokens=NEW, temperature=0, stop=[stop, "never seen"],
              extra_body={"ignore_eos": True})
    steps = served[3]
    del steps[:]
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert (c.message.content, c.finish_reason, c.model_extra["stop_reason"]) == (ref.text, "stop", stop)
    assert r.usage.completion_tokens == len(ref.token_ids)
    # the stop string cancelled the request on the engine, its output cut where the stop string ended
    [end] = [e for *_, events in steps for e in events if e.finished]
    assert (end.stop_reason, end.stats["output_tokens"]) == ("stop", len(ref.token_ids))
    streamed = list(client.chat.completions.create(stream=True, **kw))
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed) == ref.text
    assert streamed[-1].choices[0].finish_reason == "stop"
    # no stop: max_tokens ends it
    r = client.completions.create(model=NAME, prompt="def add(a, b):", max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    assert r.choices[0].text == want(gen, "def add(a, b):", max_new_tokens=5, ignore_eos=True).text


def test_concurrent_streaming_clients_share_the_batch(served, gen):
    """Six streaming clients at once (four slots): the engine ran several of them in one device batch, and each
    client's text equals its single-request output (greedy and seeded sampling)."""
    url, engine, bridge, steps = served
    jobs = [("The quick brown fox", dict(max_tokens=NEW)),
            ("def add(a, b):", dict(max_tokens=12)),
            ("Name three prime numbers:", dict(max_tokens=NEW, temperature=0.8, seed=7)),
            ("Héllo wörld!", dict(max_tokens=10)),
            ("Speculative decoding:", dict(max_tokens=NEW, temperature=1.0, top_k=20, seed=3)),
            ("What is 12 * 7?", dict(max_tokens=14))]
    refs = [want(gen, p, max_new_tokens=kw["max_tokens"], temperature=kw.get("temperature", 0.0),
                 top_k=kw.get("top_k"), seed=kw.get("seed", 0), ignore_eos=True) for p, kw in jobs]
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)

    async def one(prompt, kw):
        kw = dict(kw)
        extra = {"ignore_eos": True} | ({"top_k": kw.pop("top_k")} if "top_k" in kw else {})
        kw.setdefault("temperature", 0.0)
        text, finish = [], None
        async for ch in await client.completions.create(model=NAME, prompt=prompt, stream=True, extra_body=extra,
                                                        **kw):
            text.append(ch.choices[0].text)
            finish = ch.choices[0].finish_reason or finish
        return "".join(text), finish

    async def all_of():
        return await asyncio.gather(*(one(p, kw) for p, kw in jobs))
    del steps[:]
    outs = asyncio.run(all_of())
    assert [o[0] for o in outs] == [r.text for r in refs]
    assert [o[1] for o in outs] == ["length"] * len(jobs)
    assert max(running for running, _, _ in steps) == SLOTS  # the batch was full
    assert max(waiting for _, waiting, _ in steps) >= 1  # and the rest queued for a slot
    assert max(len(events) for *_, events in steps) >= 2  # one step advanced several clients


def test_disconnect_frees_the_slot(served):
    """A streaming client and a non-streaming one go away mid-request: the server cancels both (stop reason
    "stop", fewer tokens than asked for) and the engine is idle again."""
    url, engine, bridge, steps = served
    body = dict(model=NAME, prompt="The quick brown fox", max_tokens=MAX_LEN - 2 * K - 8, temperature=0,
                ignore_eos=True)
    del steps[:]
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", url + "/v1/completions", json=dict(body, stream=True)) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break  # one chunk, then the connection closes
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.3))
    deadline = time.monotonic() + 30
    while httpx.get(url + "/health").json() != {"status": "ok", "running": 0, "waiting": 0}:
        assert time.monotonic() < deadline, "the cancelled requests still hold their slots"
        time.sleep(0.05)
    ends = [e for *_, events in steps for e in events if e.finished]
    assert [e.stop_reason for e in ends] == ["stop", "stop"]
    assert all(e.stats["output_tokens"] < body["max_tokens"] for e in ends)


def test_bridge_stream_submit_errors_and_early_close(served, gen):
    """AsyncEngine.stream yields a request's events (the tokens of a single-request generation); the engine's
    ValueError for a bad request reaches the submitting coroutine; leaving a stream early cancels its request."""
    _, engine, bridge, steps = served
    prompt = gen.tokenizer.encode("def add(a, b):")
    ref = gen.generate(prompt, max_new_tokens=NEW, k=K, ignore_eos=True)

    async def scenario():
        events = [e async for e in bridge.stream(prompt, RequestParams(max_new_tokens=NEW))]
        with pytest.raises(ValueError, match=r"prompt has token ids outside the vocabulary"):
            await bridge.submit([1, V + 1], RequestParams(max_new_tokens=4))
        async for first in bridge.stream(prompt, RequestParams(max_new_tokens=MAX_LEN - 2 * K - len(prompt))):
            break
        return events, first
    del steps[:]
    events, first = asyncio.run(scenario())
    assert [t for e in events for t in e.new_tokens] == ref.token_ids
    assert events[-1].finished and events[-1].stop_reason == "length" and not any(e.finished for e in events[:-1])
    assert not first.finished
    deadline = time.monotonic() + 30
    while bridge.num_running or bridge.num_waiting:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    ends = [e for *_, evs in steps for e in evs if e.finished]
    assert [e.stop_reason for e in ends] == ["length", "stop"]


class BrokenEngine:
    """An engine whose device fails at its second step (stands in for a lost GPU)."""
    max_slots = 1

    def __init__(self):
        self.steps, self.queued = 0, []

    def submit(self, prompt, params):
        self.queued.append(prompt)
        return len(self.queued) - 1

    def cancel(self, request_id, keep=None):
        pass

    has_work = property(lambda self: bool(self.queued))
    num_running = property(lambda self: len(self.queued))
    num_waiting = 0

    def step(self):
        self.steps += 1
        if self.steps == 2:
            raise RuntimeError("device lost")
        return [Event(0, [5], False)]


def test_a_failed_engine_ends_requests_with_503(gen):
    bridge = AsyncEngine(BrokenEngine())
    model = ServedModel(name=NAME, tokenizer=gen.tokenizer, vocab_size=V, max_len=MAX_LEN, slack=0, drafting="none",
                        num_speculative_tokens=0)
    server = LiveServer(create_app(bridge, model))
    try:
        body = dict(model=NAME, prompt="hi", max_tokens=8)
        lines = [line for line in httpx.post(server.url + "/v1/completions", json=dict(body, stream=True),
                                             timeout=60).text.splitlines() if line]
        assert json.loads(lines[-2].removeprefix("data: "))["error"]["message"] == (
            "the engine stopped: RuntimeError: device lost")
        assert lines[-1] == "data: [DONE]"
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 503 and "device lost" in r.json()["error"]["message"]
        r = httpx.get(server.url + "/health")
        assert r.status_code == 503 and "device lost" in r.json()["error"]["message"]
    finally:
        server.close()
        bridge.close()


class SlowEngine:
    """An engine that emits one token per request every 20 ms and never finishes on its own."""
    max_slots = 1

    def __init__(self):
        self.running, self.cancelled, self.ended = set(), [], []

    def submit(self, prompt, params):
        self.running.add(len(self.cancelled) + len(self.running))
        return max(self.running)

    def cancel(self, request_id, keep=None):
        self.cancelled.append(request_id)
        self.running.discard(request_id)
        self.ended.append(request_id)

    has_work = property(lambda self: bool(self.running or self.ended))
    num_running = property(lambda self: len(self.running))
    num_waiting = 0

    def step(self):
        time.sleep(0.02)
        stats = {"prompt_tokens": 1, "output_tokens": 0, "num_drafts": 0, "num_accepted_tokens": 0,
                 "acceptance_rates": [], "ttft_s": None, "tpot_s": None, "e2e_s": 0.1}
        events = [Event(r, [], True, "stop", stats) for r in self.ended] + [Event(r, [5], False) for r in self.running]
        self.ended = []
        return events


def test_ctrl_c_gives_requests_in_flight_the_grace_period(gen):
    """The command's server on SIGINT: a stream in flight runs on for the grace period, is then aborted on the
    engine (a final chunk with finish_reason "abort", then [DONE]), and the server returns by re-raising the interrupt
    (the command's exit 130)."""
    engine = SlowEngine()
    bridge = AsyncEngine(engine)
    model = ServedModel(name=NAME, tokenizer=gen.tokenizer, vocab_size=V, max_len=MAX_LEN, slack=0, drafting="none",
                        num_speculative_tokens=0)
    sock = _bind("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    seen = {}

    def client():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                httpx.get(url + "/health")
                break
            except httpx.ConnectError:
                time.sleep(0.02)
        body = dict(model=NAME, prompt="hi", max_tokens=200, temperature=0, stream=True)
        chunks = 0
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
                for line in r.iter_lines():
                    chunks += line.startswith("data: {")
                    if chunks == 1 and "signalled" not in seen:
                        seen["signalled"] = time.monotonic()
                        os.kill(os.getpid(), signal.SIGINT)
                    seen["lines"] = seen.get("lines", []) + [line] if line else seen.get("lines", [])
        except httpx.HTTPError as e:
            seen["error"] = e
        seen["ended"], seen["chunks"] = time.monotonic(), chunks
    t = threading.Thread(target=client)
    t.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            assert cli._serve(create_app(bridge, model), sock, "ready", grace_s=1)
    finally:
        returned = time.monotonic()
        t.join(30)
        bridge.close()
        sock.close()
    assert 0.9 <= returned - seen["signalled"] < 5  # the grace period, then the stream was cancelled
    assert seen["chunks"] > 20 and engine.cancelled == [0]  # it streamed on meanwhile; its slot was freed
    assert "error" not in seen and seen["lines"][-1] == "data: [DONE]"
    assert json.loads(seen["lines"][-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "abort"


def test_bad_requests_name_the_field(served, client):
    url = served[0]

    def error(path, body, status=400):
        r = httpx.post(url + path, content=body if isinstance(body, str) else json.dumps(body), timeout=60)
        assert r.status_code == status, r.text
        e = r.json()["error"]
        assert set(e) == {"message", "type", "param", "code"} and e["type"] == "invalid_request_error"
        return e

    base = dict(model=NAME, prompt="hi", max_tokens=4)
    chat = dict(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    cases = [  # (path, body, param, message pattern)
        ("/v1/completions", dict(base, temperature=-1), "temperature", r"temperature must be a number in \[0"),
        ("/v1/completions", dict(base, temperature="hot"), "temperature", r"must be a number, got a string"),
        ("/v1/completions", dict(base, top_p=0), "top_p", r"top_p must be a number in \(0"),
        ("/v1/completions", dict(base, top_k=2.5), "top_k", r"top_k must be an integer"),
        ("/v1/completions", dict(base, max_tokens=0), "max_tokens", r"max_tokens must be an integer in \[1"),
        ("/v1/completions", dict(base, max_tokens=MAX_LEN), "max_tokens", r"at most \d+ new tokens"),
        ("/v1/completions", dict(base, seed=-3), "seed", r"seed must be an integer in \[0, 4294967295\]"),
        ("/v1/completions", dict(base, n=2), "n", r"n=2 is not supported"),
        ("/v1/completions", dict(base, echo=True), "echo", r"echo=true is not supported"),
        ("/v1/completions", dict(base, logprobs=1), "logprobs", r"not supported"),
        ("/v1/completions", dict(base, stop=[""]), "stop", r"stop\[0\] is empty"),
        ("/v1/completions", dict(base, stop=3), "stop", r"stop must be a string or a list"),
        ("/v1/completions", dict(base, stream_options={"include_usage": True}), "stream_options",
         r"only allowed with stream"),
        ("/v1/completions", dict(base, stream=True, stream_options={"continuous_usage_stats": True}),
         "stream_options", r"include_usage \(true / false\) only"),
        ("/v1/completions", dict(base, frobnicate=1), "frobnicate", r"unrecognized request field 'frobnicate'"),
        ("/v1/completions", dict(base, prompt=[1, V + 5]), "prompt", rf"token id {V + 5} outside"),
        ("/v1/completions", dict(base, prompt=["a", "b"]), "prompt", r"one prompt per request"),
        ("/v1/completions", dict(base, prompt=[]), "prompt", r"prompt must be a string or a non-empty array"),
        ("/v1/completions", {k: v for k, v in base.items() if k != "prompt"}, "prompt", r"prompt is required"),
        ("/v1/completions", dict(base, prompt=list(range(5, 5 + MAX_LEN))), "prompt",
         rf"the prompt has {MAX_LEN} tokens, too long for this server's max length {MAX_LEN}"),
        ("/v1/completions", dict(base, stop_token_ids=[V]), "stop_token_ids", r"outside"),
        ("/v1/completions", dict(base, stop_token_ids=list(range(10, 17))), "stop_token_ids",
         r"9 stop ids with the model's EOS ids \[1, 4\], more than the engine's 8"),
        ("/v1/chat/completions", dict(chat, messages=[{"content": "x"}]), "messages", r"messages\[0\] has no 'role'"),
        ("/v1/chat/completions", dict(chat, messages="hi"), "messages", r"messages must be a non-empty list"),
        ("/v1/chat/completions", dict(chat, messages=[{"role": "tool", "content": "x"}]), "messages",
         r"chat template failed: .*unknown role: tool"),
        ("/v1/chat/completions", dict(chat, messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
         "messages", r"only text parts"),
        ("/v1/chat/completions", dict(chat, max_completion_tokens=0), "max_completion_tokens", r"in \[1"),
        ("/v1/chat/completions", dict(chat, tools=[{"type": "function"}]), "tools", r"tool calling"),
        ("/v1/chat/completions", dict(chat, logprobs=True), "logprobs", r"not supported"),
        ("/v1/chat/completions", dict(chat, response_format={"type": "json_object"}), "response_format",
         r"not supported"),
    ]
    for path, body, param, pattern in cases:
        e = error(path, body)
        assert e["param"] == param and re.search(pattern, e["message"]), (body, e)
    e = error("/v1/completions", dict(base, model="gpt-4"), status=404)
    assert e["param"] == "model" and e["code"] == "model_not_found" and "gpt-4" in e["message"]
    assert error("/v1/completions", "{not json")["message"].startswith("the request body is not valid JSON")
    assert "must be a JSON object" in error("/v1/chat/completions", "[1, 2]")["message"]
    # the official client raises its typed errors with the same JSON
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=NAME, prompt="hi", max_tokens=4, temperature=-1)
    assert info.value.param == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert httpx.get(url + "/health").json()["running"] == 0


def run_serve(*args, **kw):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))  # the suite's XLA flags (conftest.py)
    return subprocess.Popen([sys.executable, "-m", "pjax", "serve", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT, **kw)


def test_help_and_bad_input(capsys):
    """--help from the command; bad input (checked in-process: the command's main) is exit 2 with one line."""
    r = subprocess.run([sys.executable, "-m", "pjax", "serve", "--help"], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert r.returncode == 0 and "--served-model-name" in r.stdout and "--max-slots" in r.stdout

    def serve(*args):
        code = cli.main(list(map(str, args)))
        return code, capsys.readouterr().err.strip().splitlines()
    assert serve("--target", ROOT / "no-such-dir") == (2, [
        f"error: --target: {ROOT / 'no-such-dir'}: no such directory (expected a Hugging Face model directory with "
        "tokenizer.json and tokenizer_config.json)"])
    with _bind("127.0.0.1", 0) as taken:  # the port is checked before anything loads
        taken.listen()
        port = taken.getsockname()[1]
        assert serve("--target", ROOT / "no-such-dir", "--port", port) == (2, [
            f"error: --host 127.0.0.1 --port {port}: cannot listen there (Address already in use)"])
    assert serve("--target", ROOT, "--k", 3) == (2, ["error: --k needs drafting: give --head DIR (and not "
                                                     "--drafting none)"])
    assert serve("--target", ROOT, "--compilation-cache", ROOT / "README.md") == (2, [
        f"error: --compilation-cache {ROOT / 'README.md'}: exists and is not a directory"])


# the default run keeps SIGINT (exit 130); the command's SIGTERM (exit 0) is also checked by test_serve_robust's
# shutdown under load
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), pytest.param(signal.SIGTERM, 0, marks=pytest.mark.full)])
def test_command_serves_then_stops(dirs, gen, sig, code, tmp_path):
    """The command loads, compiles (into its --compilation-cache), logs its URL, answers a chat request (text equal
    to pjax.text's), and exits cleanly on SIGINT (130) / SIGTERM (0)."""
    target, head = dirs
    cache = tmp_path / "programs"
    p = run_serve("--target", target, "--head", head, "--k", K, "--dtype", "float32", "--max-len", MAX_LEN,
                  "--max-slots", 2, "--max-admit-rows", 1, "--port", 0, "--served-model-name", NAME,
                  "--warmup", "minimal", "--rounds-per-step", 1, "--compilation-cache", cache)
    try:
        lines = []
        for line in p.stderr:
            lines.append(line)
            m = re.search(r"serving tiny-llama on (http://127\.0\.0\.1:\d+)", line)
            if m:
                break
        else:
            pytest.fail("".join(lines))
        client = openai.OpenAI(base_url=m.group(1) + "/v1", api_key="none", max_retries=0, timeout=120)
        r = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=NEW, temperature=0)
        assert r.choices[0].message.content == want(gen, CHAT).text
        p.send_signal(sig)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == code, err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == ("interrupted" if code else
                                                                       "pjax serve: stopped (SIGTERM)")
    assert any(cache.iterdir())  # the programs it compiled, for the next start


def _warm_up_then_bursts(engine, bridge, url, longest, bursts):
    """_warm_up "full" for prompts of up to `longest` tokens, then the bursts of concurrent requests (prompt lengths)
    through the server at `url`: True when no request compiled."""
    # the engine thread sleeps while nothing runs, so this thread may use the engine meanwhile
    assert bridge.num_running == bridge.num_waiting == 0 and not engine.has_work
    assert _warm_up(engine, "full", longest) >= 0.0
    before = engine.compile_s

    async def burst(lengths):
        aclient = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        return await asyncio.gather(*(aclient.completions.create(model=NAME, prompt=list(range(5, 5 + n)),
                                                                 max_tokens=2, temperature=0) for n in lengths))
    for lengths in bursts:
        asyncio.run(burst(lengths))
    return engine.compile_s == before


def test_full_warm_up_compiles_what_traffic_needs_small(gen):
    """After the command's full warm-up no request compiles: prompts of every length bucket, admitted alone and
    several at once (padded and packed), on a server of 2 slots and 32 positions without drafting (few programs)."""
    max_len = 32
    engine = Engine(gen.target, None, EngineConfig(max_slots=2, max_len=max_len, drafting="none", rounds_per_step=2,
                                                   compiler_options=FAST))
    bridge = AsyncEngine(engine)
    model = ServedModel(name=NAME, tokenizer=gen.tokenizer, vocab_size=V, max_len=max_len, slack=engine.slack,
                        drafting="none", num_speculative_tokens=0)
    server = LiveServer(create_app(bridge, model))
    try:
        longest = max_len - engine.slack - 2  # the longest prompt with room for 2 new tokens
        assert _warm_up_then_bursts(engine, bridge, server.url, max_len - engine.slack - 1,  # the command's bound
                                    ([1], [longest], [3, 20], [9, 5], [longest, 12], [17, 9]))
    finally:
        server.close()
        bridge.close()


@pytest.mark.full  # test_full_warm_up_compiles_what_traffic_needs_small checks the same on a smaller server
def test_full_warm_up_compiles_what_traffic_needs(served, client):
    """After the command's full warm-up no request compiles: prompts of every length bucket, admitted alone and
    several at once (the concurrent clients of another test may have compiled some programs already: the point is
    that none is left)."""
    _, engine, bridge, _ = served
    assert _warm_up_then_bursts(engine, bridge, served[0], MAX_LEN - 2 * K - 1,
                                ([1], [MAX_LEN - 2 * K - 2], [3, 40], [17, 100, 9, 64], [200, 30, 31]))


# ------------------------------------------------------------------------------------------ handler cancellation
class _CountingStream:
    cancelled = 0

    def cancel(self, keep=None):
        self.cancelled += 1


class _ConnectedRequest:
    async def receive(self):
        await asyncio.Event().wait()  # the client stays connected


def test_a_cancelled_handler_cancels_its_request():
    """uvicorn cancels handlers past its graceful-shutdown timeout: the work task and the engine request end too."""
    async def main():
        started = asyncio.Event()

        async def work():
            started.set()
            await asyncio.Event().wait()  # the request's events never end
        stream = _CountingStream()
        handler = asyncio.ensure_future(_until_disconnect(_ConnectedRequest(), work(), stream))
        await started.wait()
        handler.cancel()
        try:
            await handler
        except asyncio.CancelledError:
            pass
        await asyncio.sleep(0)
        pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        return stream.cancelled, pending
    cancelled, pending = asyncio.run(main())
    assert cancelled == 1 and not pending, (cancelled, pending)

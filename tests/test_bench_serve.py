"""examples/benchmarks/bench_serve.py's load: client processes sharing c streams against the real app and uvicorn
server deliver every token, and the row reports how busy the clients, the event loop and the engine thread were.
The engine is a stub (no model): each step gives every running request a few tokens."""
import socket
import threading
import time

import pytest

from tests.example_utils import load_example

pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

V = 50


class StubEngine:
    """`pjax.serve.Engine`'s face for the server: each step gives every running request `per_step` tokens."""
    budget = 3

    def __init__(self, slots: int, per_step: int = 3):
        self.slots, self.per_step, self.queue, self.running, self.ids = slots, per_step, [], {}, 0

    def submit(self, prompt, params):
        self.ids += 1
        self.queue.append((self.ids, params.max_new_tokens))
        return self.ids

    def cancel(self, rid, keep=None):
        self.running.pop(rid, None)

    @property
    def has_work(self):
        return bool(self.queue or self.running)

    @property
    def num_running(self):
        return len(self.running)

    @property
    def num_waiting(self):
        return len(self.queue)

    def step(self, final=False):
        from pjax.serve import Event
        while self.queue and len(self.running) < self.slots:
            rid, most = self.queue.pop(0)
            self.running[rid] = [most, 0]
        time.sleep(0.002)
        events = []
        for rid, (most, done) in list(self.running.items()):
            n = min(self.per_step, most - done)
            self.running[rid][1] += n
            finished = done + n == most
            stats = dict(prompt_tokens=4, output_tokens=most, ttft_s=0.01, tpot_s=0.001, e2e_s=0.1, queue_s=0.0,
                         num_drafts=0, num_draft_tokens=0, num_accepted_tokens=0, accepted_per_position=[0, 0, 0])
            events.append(Event(rid, [1 + (rid + i) % (V - 1) for i in range(n)], finished,
                                "length" if finished else None, stats if finished else None))
            if finished:
                del self.running[rid]
        return events


def test_client_processes_share_the_load():
    bs = load_example("benchmarks/bench_serve.py")
    from pjax.serve import AsyncEngine
    from pjax.serve.cli import make_server
    from pjax.serve.openai_api import ServedModel, create_app

    c, prompts, new = 4, [[1, 2, 3, 4]] * 24, 40
    model = ServedModel(name="bench", tokenizer=bs.word_tokenizer(V), vocab_size=V, max_len=64, slack=6,
                        drafting="parallel", num_speculative_tokens=3)
    bridge = AsyncEngine(StubEngine(c), name="stub-engine")
    server = make_server(create_app(bridge, model), log_level="warning")
    sock = socket.create_server(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.01)
        engine = next(t for t in threading.enumerate() if t.name == "stub-engine")
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1/completions"
        got = bs.run_clients(url, prompts, new, c, 3, {"event loop": thread.native_id, "engine": engine.native_id})
        few = bs.run_clients(url, prompts[:2], new, c, 8, {})  # fewer prompts than streams and processes
    finally:
        server.should_exit = True
        thread.join(30)
        bridge.close()
        sock.close()
    assert got["output_tokens"] == len(prompts) * new and got["client_processes"] == 3
    assert few["output_tokens"] == 2 * new and few["client_processes"] == 2 and few["server_cpu_share"] == {}
    assert got["wall_s"] > 0 and got["output_tokens_per_s"] == got["output_tokens"] / got["wall_s"]
    assert 0 < got["client_cpu_share"] < 2
    assert set(got["server_cpu_share"]) == {"event loop", "engine"}
    assert 0 < got["server_cpu_share"]["event loop"] < 2 and 0 <= got["server_cpu_share"]["engine"] < 2


def test_thread_cpu_seconds_grow_with_work():
    bs = load_example("benchmarks/bench_serve.py")
    before = bs.thread_cpu_s(threading.get_native_id())
    end = time.process_time() + 0.2
    while time.process_time() < end:
        pass
    assert 0.1 < bs.thread_cpu_s(threading.get_native_id()) - before < 5

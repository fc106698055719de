"""The engine behind an asyncio server: one thread owns the `Engine` and runs `step()` while it has work (it sleeps
on a condition when idle); coroutines submit requests and read their events.

    bridge = AsyncEngine(engine)                         # starts the engine thread
    stream = await bridge.submit(prompt_ids, params)     # ValueError from Engine.submit (bad field) raised here
    async for event in stream: ...                       # `Event`s of this request, the last one finished
    stream.cancel(keep=n)                                # end it before the next device chunk (e.g. a stop string)
    bridge.abort_all()                                   # a server's shutdown: every request ends, new ones refused
    bridge.close()

Submissions and cancellations go to the engine thread through one FIFO inbox and are applied before its next step,
so requests of many concurrent clients join the same device batch. A stream closed before its request finished (a
client disconnect, a cancelled task) cancels the request, which frees its slot. Listeners (`add_listener`) see every
finished request's final event on the engine thread (e.g. metrics).
"""
from __future__ import annotations

import asyncio
import logging
import threading
from typing import Optional, Sequence

__all__ = ["AsyncEngine", "EngineDeadError", "RequestStream"]

_log = logging.getLogger("pjax.serve")


class EngineDeadError(RuntimeError):
    """The engine thread stopped (a step raised, or the bridge was closed); no further request can run."""


class RequestStream:
    """The events of one submitted request, in order: `async for event in stream`; iteration ends after the
    finished event. `cancel(keep=None)` ends the request before the engine's next chunk (thread-safe, idempotent)."""

    def __init__(self, bridge: "AsyncEngine", loop: asyncio.AbstractEventLoop):
        self._bridge = bridge
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self._accepted: asyncio.Future = loop.create_future()
        self.request_id: Optional[int] = None
        self._rid: Optional[int] = None  # the same, set on the engine thread
        self.finished = False
        self._cancelled = False
        self.cut = False  # cancelled with keep= (the text layer ended it, e.g. a stop string), not aborted

    # -- called on the event loop (scheduled by the engine thread) --------------------------------------------
    def _accept(self, request_id: Optional[int], error: Optional[BaseException]):
        if self._accepted.done():
            return
        if error is not None:
            self._accepted.set_exception(error)
        else:
            self.request_id = request_id
            self._accepted.set_result(request_id)

    def _put(self, item):
        self._queue.put_nowait(item)

    # -- public ---------------------------------------------------------------------------------------------
    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def cancel(self, keep: Optional[int] = None):
        """End the request (engine stop reason "stop"); keep: cut its output to its first `keep` tokens. A finished
        request is left alone; after a cancel the stream still delivers the request's remaining events."""
        if self.finished or self._cancelled:
            return
        self._cancelled = True
        self.cut = keep is not None
        self._bridge._post(("cancel", self, keep))


class AsyncEngine:
    """Runs `engine` (a `pjax.serve.Engine`) on its own thread; `submit` / `stream` from coroutines.

    num_running / num_waiting: the engine's counts after its last step (read from any thread). error: the exception
    that stopped the engine thread, or None.
    """

    def __init__(self, engine, *, name: str = "pjax-engine"):
        self.engine = engine
        self._cv = threading.Condition()
        self._inbox: list = []
        self._closed = False
        self.error: Optional[BaseException] = None
        self.num_running = 0
        self.num_waiting = 0
        self._live: dict[int, RequestStream] = {}  # engine request id -> stream (engine thread only)
        self._cancelled: set[int] = set()  # live ids already cancelled on the engine (engine thread only)
        self._refusing: Optional[str] = None  # set by abort_all: why new submissions are refused
        self._listeners: list = []
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- the asyncio face -----------------------------------------------------------------------------------
    async def submit(self, prompt: Sequence[int], params) -> RequestStream:
        """Queue a request (prompt token ids, a `RequestParams`); returns its stream once the engine accepted it.
        Raises the engine's ValueError / TypeError for a bad request, EngineDeadError when the engine stopped."""
        stream = RequestStream(self, asyncio.get_running_loop())
        self._post(("submit", stream, (list(prompt), params)))
        try:
            await stream._accepted
        except asyncio.CancelledError:
            stream.cancel()  # applied after the submission: the request never runs past its next chunk
            raise
        return stream

    async def stream(self, prompt: Sequence[int], params):
        """Async generator of a request's `Event`s; closing it early (or cancelling the task) cancels the request."""
        s = await self.submit(prompt, params)
        try:
            async for event in s:
                yield event
        finally:
            if not s.finished:
                s.cancel()

    def abort_all(self, reason: str = "the server is shutting down"):
        """End every request before the engine's next chunk (they finish with stop reason "stop", their streams
        deliver the final event) and refuse later submissions with EngineDeadError(reason). Thread-safe."""
        self._post(("abort_all", None, reason))

    def add_listener(self, fn):
        """Call fn(event, stream) on the engine thread with the final event of every request (fn must not block)."""
        self._listeners.append(fn)

    def close(self, timeout: Optional[float] = 30.0):
        """Cancel every request (their streams raise EngineDeadError) and stop the engine thread."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closed

    # -- the engine thread ----------------------------------------------------------------------------------
    def _post(self, op):
        with self._cv:
            if self._closed or self.error is not None:
                dead = self.error or EngineDeadError("the engine is shut down")
                if op[0] == "submit":
                    _call(op[1]._loop, op[1]._accept, None, EngineDeadError(str(dead)))
                return
            self._inbox.append(op)
            self._cv.notify()

    def _apply(self, op):
        kind, stream, arg = op
        if kind == "abort_all":
            self._refusing = arg
            for rid in list(self._live):
                if rid not in self._cancelled:
                    self.engine.cancel(rid)
                    self._cancelled.add(rid)
        elif kind == "submit" and self._refusing is not None:
            _call(stream._loop, stream._accept, None, EngineDeadError(self._refusing))
        elif kind == "submit":
            try:
                rid = self.engine.submit(*arg)
            except Exception as e:  # the engine's validation: handed to the submitting coroutine
                _call(stream._loop, stream._accept, None, e)
                return
            stream._rid = rid
            self._live[rid] = stream
            _call(stream._loop, stream._accept, rid, None)
        elif stream._rid in self._live and stream._rid not in self._cancelled:  # once; none for a finished one
            self.engine.cancel(stream._rid, keep=arg)
            self._cancelled.add(stream._rid)

    def _run(self):
        busy = False
        try:
            while True:
                with self._cv:
                    while not (self._inbox or self._closed or busy):
                        self._cv.wait()
                    ops, self._inbox = self._inbox, []
                    closing = self._closed
                for op in ops:
                    self._apply(op)
                if closing:
                    break
                events = self.engine.step() if self.engine.has_work else []
                # counts first: a client that reads its event sees the engine as it is after this step
                self.num_running, self.num_waiting = self.engine.num_running, self.engine.num_waiting
                busy = self.engine.has_work
                by_loop: dict = {}  # one wake-up of each event loop per step, not one per event
                for event in events:
                    stream = self._live.get(event.request_id)
                    if stream is None:
                        continue
                    if event.finished:
                        del self._live[event.request_id]
                        self._cancelled.discard(event.request_id)
                    by_loop.setdefault(stream._loop, []).append((stream, event))
                for loop, items in by_loop.items():
                    _call(loop, _deliver, items)
                for stream, event in (item for items in by_loop.values() for item in items if item[1].finished):
                    self._notify(event, stream)
            self._fail(EngineDeadError("the engine was shut down"), cancel=True)
        except BaseException as e:  # a failed step: every request ends with the error, new ones are refused
            with self._cv:
                self.error = e
            self._fail(EngineDeadError(f"the engine stopped: {type(e).__name__}: {e}"), cancel=False)
            if not isinstance(e, Exception):
                raise

    def _notify(self, event, stream):
        for listener in self._listeners:
            try:
                listener(event, stream)
            except Exception as e:  # a listener's bug (e.g. metrics) must not stop the engine
                _log.warning("a finished-request listener failed: %s: %s", type(e).__name__, e)

    def _fail(self, error: EngineDeadError, *, cancel: bool):
        with self._cv:
            pending, self._inbox = self._inbox, []
            self._closed = True
        for kind, stream, _ in pending:
            if kind == "submit":
                _call(stream._loop, stream._accept, None, error)
        for rid, stream in list(self._live.items()):
            if cancel and rid not in self._cancelled:
                try:
                    self.engine.cancel(rid)
                except Exception:  # the engine is going away either way
                    pass
            _call(stream._loop, stream._put, error)
        self._live.clear()
        self.num_running = self.num_waiting = 0


def _deliver(items):
    for stream, event in items:
        stream._put(event)


def _call(loop: asyncio.AbstractEventLoop, fn, *args):
    """Run fn(*args) on `loop` (from the engine thread); a closed loop (its client is gone) is skipped."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass

"""The OpenAI-compatible HTTP API over the continuous-batching engine (an ASGI app: Starlette; served by uvicorn).

    GET  /health                 {"status": "ok", "running": N, "waiting": M} (503 once the engine stopped)
    GET  /v1/models              the served model ({"object": "list", "data": [{"id": NAME, ...}]})
    POST /v1/completions         prompt: a string or a list of token ids
    POST /v1/chat/completions    messages, rendered with the model's chat template

Shapes follow the OpenAI API as vLLM serves it: sampling fields temperature, top_p, top_k (vLLM's extension; 0 or -1
= off), seed, stop (a string or a list), max_tokens (chat: max_completion_tokens too), stream (server-sent events
`data: {...}`, then `data: [DONE]`) with stream_options.include_usage; vLLM's extensions stop_token_ids, ignore_eos,
skip_special_tokens, include_stop_str_in_output and (chat) chat_template_kwargs, add_generation_prompt. n=1, echo
and logprobs are not supported (400). Text is the tokenizer's incremental detokenization (`pjax.text.OutputText`): a
stop string cuts the text (excluded unless include_stop_str_in_output) and cancels the request, so its slot frees at
the next device chunk.

finish_reason: "stop" (EOS, a stop token or a stop string; choice.stop_reason holds the stop string or the
stop_token_ids id that ended it, null for EOS, as vLLM), "length" (max_tokens, or the KV capacity), "error" (the
target's logits turned NaN / inf), "abort" (the server cancelled it). Every finished choice comes with the pjax
extension key "pjax" beside "usage" (a final stream chunk carries it too): the request's speculative-decoding
statistics, {"drafting", "num_speculative_tokens", "num_drafts", "num_accepted_tokens", "mean_acceptance_length",
"acceptance_rates" (per draft position), "rounds", "queue_s", "ttft_s", "e2e_s", "tpot_s"}. Clients that do not know
the key ignore it.

Errors are OpenAI's JSON: {"error": {"message", "type": "invalid_request_error", "param": FIELD, "code": null}} with
400 for a bad field (the message says what was expected), 404 for an unknown model, 503 once the engine stopped. A
client that disconnects (streaming or not) cancels its request.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
import time
import uuid
from typing import Any, Optional

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pjax.decode.inputs import SEED_LIMIT, is_int, is_real
from pjax.serve.async_engine import AsyncEngine, EngineDeadError
from pjax.decode.engine import STOP_WIDTH, RequestParams
from pjax.text.detokenize import OutputText, check_stop_strings
from pjax.text.template import TemplateError
from pjax.text.tokenizer import Tokenizer, TokenizerError, check_messages

__all__ = ["APIError", "ServedModel", "create_app"]

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the legacy completions API's (and vLLM's) default; chat fills the context
# engine stop reasons -> OpenAI finish reasons ("stop" here is a cancel the text layer did not ask for)
FINISH = {"eos": "stop", "length": "length", "capacity": "length", "nonfinite": "error", "stop": "abort"}
STATS_KEYS = ("num_drafts", "num_accepted_tokens", "mean_acceptance_length", "acceptance_rates", "rounds", "queue_s",
              "ttft_s", "e2e_s", "tpot_s")
# accepted and ignored: bookkeeping fields of the OpenAI API that do not change the output
IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls"}
SAMPLING_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options",
                   "n", "presence_penalty", "frequency_penalty", "logit_bias", "stop_token_ids", "ignore_eos",
                   "skip_special_tokens", "include_stop_str_in_output"}
COMPLETION_FIELDS = SAMPLING_FIELDS | IGNORED | {"prompt", "echo", "logprobs", "best_of", "suffix"}
CHAT_FIELDS = SAMPLING_FIELDS | IGNORED | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools",
                                           "tool_choice", "response_format", "chat_template_kwargs",
                                           "add_generation_prompt"}


class APIError(Exception):
    """An error answered as OpenAI's error JSON."""

    def __init__(self, message: str, param: Optional[str] = None, *, status: int = 400,
                 type: str = "invalid_request_error", code: Optional[str] = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """What the API serves: name (the "model" of requests), the tokenizer, the target's vocabulary, max_len (KV
    positions per request: prompt + new tokens + slack must fit), slack (positions the engine reserves for
    drafting: 2K), drafting / num_speculative_tokens (reported in the statistics), root (the target directory)."""
    name: str
    tokenizer: Tokenizer
    vocab_size: int
    max_len: int
    slack: int
    drafting: str
    num_speculative_tokens: int
    root: str = ""
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))


@dataclasses.dataclass
class Job:
    """One parsed request: prompt ids, engine parameters, and the text rules of its output."""
    prompt: list[int]
    params: RequestParams
    stop: tuple[str, ...]
    user_stop_ids: frozenset
    eos_ids: frozenset
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    stream: bool
    include_usage: bool


# ---------------------------------------------------------------------------------------------- validation

class _Fields:
    """A request body's fields, checked one by one; null means "not given" (OpenAI clients send nulls)."""

    def __init__(self, body, allowed: set):
        if not isinstance(body, dict):
            raise APIError(f"the request body must be a JSON object, got {_json_type(body)}")
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise APIError(f"unrecognized request field {unknown[0]!r} (supported: {', '.join(sorted(allowed))})",
                           unknown[0])
        self.body = body

    def get(self, name, default=None):
        v = self.body.get(name)
        return default if v is None else v

    def integer(self, name, default=None, *, low=None, high=None):
        v = self.body.get(name)
        if v is None:
            return default
        if not is_int(v):
            raise APIError(f"{name} must be an integer, got {_json_type(v)} {_show(v)}", name)
        if (low is not None and v < low) or (high is not None and v > high):
            raise APIError(f"{name} must be an integer in {_range(low, high)}, got {v}", name)
        return int(v)

    def number(self, name, default=None, *, low=None, high=None, low_open=False):
        v = self.body.get(name)
        if v is None:
            return default
        if not is_real(v) or not math.isfinite(v):
            raise APIError(f"{name} must be a number, got {_json_type(v)} {_show(v)}", name)
        if (low is not None and (v < low or (low_open and v == low))) or (high is not None and v > high):
            raise APIError(f"{name} must be a number in {_range(low, high, low_open)}, got {v}", name)
        return float(v)

    def boolean(self, name, default=False):
        v = self.body.get(name)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise APIError(f"{name} must be true or false, got {_json_type(v)} {_show(v)}", name)
        return v

    def only(self, name, allowed: tuple, why: str):
        """An OpenAI field pjax does not implement: only its no-op values pass."""
        v = self.body.get(name)
        if v is not None and v not in allowed:
            raise APIError(f"{name}={_show(v)} is not supported: {why}", name)


def _json_type(v) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object", type(None): "null"}.get(type(v), type(v).__name__)


def _show(v) -> str:
    s = json.dumps(v, ensure_ascii=False) if not isinstance(v, float) or math.isfinite(v) else str(v)
    return s if len(s) <= 60 else s[:57] + "..."


def _range(low, high, low_open=False) -> str:
    return f"{'(' if low_open else '['}{'-inf' if low is None else low}, {'inf' if high is None else high}]"


def _check_model(fields: _Fields, model: ServedModel):
    name = fields.body.get("model")
    if name is not None and name != model.name:
        raise APIError(f"The model `{name}` does not exist. This server serves `{model.name}`.", "model",
                       status=404, code="model_not_found")


def _prompt_ids(fields: _Fields, model: ServedModel) -> list[int]:
    p = fields.body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and (isinstance(p[0], str) or isinstance(p[0], list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        ids = model.tokenizer.render(p)
        if not ids:
            raise APIError("prompt renders to no tokens (an empty prompt and no BOS token to start from)", "prompt")
    elif isinstance(p, list) and p and all(is_int(t) for t in p):
        ids = [int(t) for t in p]
    elif isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        raise APIError(f"prompt: one prompt per request (got a batch of {len(p)})", "prompt")
    else:
        raise APIError("prompt must be a string or a non-empty array of token ids, got "
                       + ("an empty array" if p == [] else f"{_json_type(p)}"), "prompt")
    _check_vocab(ids, model, "prompt")
    return ids


def _check_vocab(ids: list[int], model: ServedModel, param: str):
    bad = next((t for t in ids if not 0 <= t < model.vocab_size), None)
    if bad is not None:
        raise APIError(f"{param}: token id {bad} outside the model's vocabulary [0, {model.vocab_size})", param)


def _messages(fields: _Fields) -> list[dict]:
    """messages -> the chat for the template; text content parts are joined with newlines (as vLLM does)."""
    try:
        messages = check_messages(fields.body.get("messages"))
    except (TypeError, ValueError) as e:
        raise APIError(str(e), "messages") from None
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    kind = part.get("type") if isinstance(part, dict) else _json_type(part)
                    raise APIError(f"messages[{i}].content[{j}]: only text parts ({{\"type\": \"text\", \"text\": "
                                   f"...}}) are supported, got {kind!r}", "messages")
                texts.append(part["text"])
            m = dict(m, content="\n".join(texts))
        out.append(m)
    return out


def _chat_ids(fields: _Fields, model: ServedModel) -> list[int]:
    messages = _messages(fields)
    kwargs = fields.get("chat_template_kwargs", {})
    if not isinstance(kwargs, dict):
        raise APIError(f"chat_template_kwargs must be an object, got {_json_type(kwargs)}", "chat_template_kwargs")
    if not model.tokenizer.has_chat_template:
        raise APIError(f"the model {model.name} has no chat template: use /v1/completions with a text prompt",
                       "messages")
    try:
        ids = model.tokenizer.apply_chat_template(
            messages, add_generation_prompt=fields.boolean("add_generation_prompt", True), **kwargs)
    except (TemplateError, TokenizerError, TypeError, ValueError) as e:
        raise APIError(f"messages: the chat template failed: {e}", "messages") from None
    if not ids:
        raise APIError("messages render to no tokens", "messages")
    _check_vocab(ids, model, "messages")
    return ids


def _max_tokens(fields: _Fields, model: ServedModel, prompt: list[int], *, chat: bool, prompt_param: str) -> int:
    room = model.max_len - len(prompt) - model.slack
    slack = f" ({model.slack} positions are kept for drafting)" if model.slack else ""
    if room < 1:
        raise APIError(f"{prompt_param}: the prompt has {len(prompt)} tokens, too long for this server's max length "
                       f"{model.max_len}{slack}: at most {model.max_len - model.slack - 1} prompt tokens fit",
                       prompt_param)
    name = "max_tokens"
    value = fields.integer("max_tokens", low=1)
    if chat and fields.body.get("max_completion_tokens") is not None:
        name, value = "max_completion_tokens", fields.integer("max_completion_tokens", low=1)
    if value is None:
        return room if chat else min(COMPLETIONS_DEFAULT_MAX_TOKENS, room)
    if value > room:
        raise APIError(f"{name}={value} does not fit: the prompt has {len(prompt)} tokens and the server's max length "
                       f"is {model.max_len}{slack}, so at most {room} new tokens", name)
    return value


def _job(fields: _Fields, model: ServedModel, prompt: list[int], *, chat: bool) -> Job:
    max_new = _max_tokens(fields, model, prompt, chat=chat, prompt_param="messages" if chat else "prompt")
    fields.only("n", (1,), "one choice per request (n=1)")
    fields.only("presence_penalty", (0, 0.0), "pjax samples without penalties")
    fields.only("frequency_penalty", (0, 0.0), "pjax samples without penalties")
    fields.only("logit_bias", ({},), "pjax samples without logit biases")
    temperature = fields.number("temperature", 1.0, low=0.0)
    top_p = fields.number("top_p", 1.0, low=0.0, high=1.0, low_open=True)
    top_k = fields.integer("top_k", 0, low=-1)
    seed = fields.integer("seed", low=0, high=SEED_LIMIT - 1)
    try:
        stop = check_stop_strings(fields.body.get("stop"))
    except (TypeError, ValueError) as e:
        raise APIError(str(e), "stop") from None
    raw_ids = fields.get("stop_token_ids", [])
    if not isinstance(raw_ids, list) or not all(is_int(t) for t in raw_ids):
        raise APIError(f"stop_token_ids must be an array of token ids, got {_show(raw_ids)}", "stop_token_ids")
    _check_vocab(raw_ids, model, "stop_token_ids")
    eos = () if fields.boolean("ignore_eos") else model.tokenizer.eos_token_ids
    stream = fields.boolean("stream")
    options = fields.get("stream_options", {})
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise APIError(f"stream_options must be an object with include_usage (true / false) only, got "
                       f"{_show(options)}", "stream_options")
    if fields.body.get("stream_options") is not None and not stream:
        raise APIError("stream_options is only allowed with stream: true", "stream_options")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise APIError("stream_options.include_usage must be true or false", "stream_options")
    stop_ids = tuple(dict.fromkeys([*eos, *(int(t) for t in raw_ids)]))
    if len(stop_ids) > STOP_WIDTH:
        raise APIError(f"stop_token_ids: {len(stop_ids)} stop ids with the model's EOS ids {list(eos)}, more than the "
                       f"engine's {STOP_WIDTH}", "stop_token_ids")
    params = RequestParams(max_new_tokens=max_new, temperature=temperature, top_k=max(top_k, 0), top_p=top_p,
                           seed=random.randrange(SEED_LIMIT) if seed is None else seed, stop_token_ids=stop_ids)
    return Job(prompt, params, stop, frozenset(int(t) for t in raw_ids), frozenset(eos),
               fields.boolean("include_stop_str_in_output"), fields.boolean("skip_special_tokens", True), stream,
               include_usage)


def parse_completion(body, model: ServedModel) -> Job:
    """A /v1/completions body -> Job (APIError naming the field otherwise)."""
    fields = _Fields(body, COMPLETION_FIELDS)
    _check_model(fields, model)
    fields.only("echo", (False,), "the prompt is not echoed (echo=false)")
    fields.only("logprobs", (), "pjax returns no log probabilities")
    fields.only("best_of", (1,), "one sequence per request (best_of=1)")
    fields.only("suffix", ("",), "no suffix (insertion) completions")
    if "prompt" not in body:
        raise APIError("prompt is required (a string or an array of token ids)", "prompt")
    return _job(fields, model, _prompt_ids(fields, model), chat=False)


def parse_chat(body, model: ServedModel) -> Job:
    """A /v1/chat/completions body -> Job (APIError naming the field otherwise)."""
    fields = _Fields(body, CHAT_FIELDS)
    _check_model(fields, model)
    fields.only("logprobs", (False,), "pjax returns no log probabilities")
    fields.only("top_logprobs", (0,), "pjax returns no log probabilities")
    fields.only("tools", ([],), "tool calling is not implemented")
    fields.only("tool_choice", ("none",), "tool calling is not implemented")
    fmt = fields.body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise APIError(f"response_format={_show(fmt)} is not supported: only {{\"type\": \"text\"}} (no constrained "
                       "decoding)", "response_format")
    if "messages" not in body:
        raise APIError("messages is required (an array of {\"role\", \"content\"} messages)", "messages")
    return _job(fields, model, _chat_ids(fields, model), chat=True)


# ---------------------------------------------------------------------------------------------- outputs

class OutputFollower:
    """One request's text as its events arrive: `feed(event) -> new text`; a stop string cancels the request
    (keep = the tokens up to the one that completed it). finish_reason / stop_reason / stats once it ended."""

    def __init__(self, job: Job, tokenizer: Tokenizer, stream):
        self.job, self.stream = job, stream
        self.out = OutputText(tokenizer, job.prompt, stop=job.stop, skip_special_tokens=job.skip_special_tokens,
                              include_stop_str_in_output=job.include_stop_str_in_output)
        self.finish_reason: Optional[str] = None
        self.stop_reason: Any = None
        self.stats: Optional[dict] = None

    def feed(self, event) -> str:
        new = event.new_tokens
        if self.finish_reason is None:
            for j, t in enumerate(new):
                stop_token = event.finished and event.stop_reason == "eos" and j == len(new) - 1
                if self.out.add(t, is_stop_token=stop_token):
                    self.finish_reason, self.stop_reason = "stop", self.out.stop_string
                    self.stream.cancel(keep=len(self.out.token_ids))
                    break
            else:
                if event.finished:
                    self.finish_reason = FINISH.get(event.stop_reason, event.stop_reason)
                    if event.stop_reason == "eos" and new and new[-1] in self.job.user_stop_ids \
                            and new[-1] not in self.job.eos_ids:
                        self.stop_reason = new[-1]
        if event.finished:
            self.stats = event.stats or {}
        return self.out.take(final=self.finish_reason is not None)

    @property
    def done(self) -> bool:
        return self.stats is not None

    def usage(self) -> dict:
        n, m = len(self.job.prompt), len(self.out.token_ids)
        return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}


def pjax_stats(stats: dict, model: ServedModel) -> dict:
    """The "pjax" extension key: a request's speculative-decoding statistics."""
    out = {"drafting": model.drafting, "num_speculative_tokens": model.num_speculative_tokens}
    out.update({k: stats[k] for k in STATS_KEYS if k in stats})
    return out


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


# ---------------------------------------------------------------------------------------------- the app

class _API:
    def __init__(self, bridge: AsyncEngine, model: ServedModel):
        self.bridge, self.model = bridge, model

    async def health(self, request: Request) -> Response:
        if not self.bridge.alive:
            return APIError(f"the engine stopped: {self.bridge.error or 'shut down'}", status=503,
                            type="service_unavailable").response()
        return JSONResponse({"status": "ok", "running": self.bridge.num_running, "waiting": self.bridge.num_waiting})

    def _card(self) -> dict:
        m = self.model
        return {"id": m.name, "object": "model", "created": m.created, "owned_by": "pjax", "root": m.root or m.name,
                "parent": None, "max_model_len": m.max_len}

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._card()]})

    async def model_card(self, request: Request) -> Response:
        name = request.path_params["model"]
        if name != self.model.name:
            return APIError(f"The model `{name}` does not exist.", "model", status=404,
                            code="model_not_found").response()
        return JSONResponse(self._card())

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    async def _serve(self, request: Request, *, chat: bool) -> Response:
        try:
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise APIError(f"the request body is not valid JSON ({e})") from None
            job = (parse_chat if chat else parse_completion)(body, self.model)
            try:
                stream = await self.bridge.submit(job.prompt, job.params)
            except EngineDeadError as e:
                raise APIError(str(e), status=503, type="service_unavailable") from None
            except (TypeError, ValueError) as e:  # the engine's own checks (after ours: rarely reached)
                raise APIError(str(e)) from None
        except APIError as e:
            return e.response()
        follower = OutputFollower(job, self.model.tokenizer, stream)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if job.stream:
            return _EventStream(self._events(follower, rid, chat), follower.stream)
        return await _until_disconnect(request, self._whole(follower, rid, chat), stream)

    async def _whole(self, f: OutputFollower, rid: str, chat: bool) -> Response:
        text = []
        try:
            async for event in f.stream:
                text.append(f.feed(event))
        except EngineDeadError as e:
            return APIError(str(e), status=503, type="service_unavailable").response()
        text = "".join(text)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None}
                  if chat else {"index": 0, "text": text, "logprobs": None})
        choice.update(finish_reason=f.finish_reason, stop_reason=f.stop_reason)
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                             "created": int(time.time()), "model": self.model.name, "choices": [choice],
                             "usage": f.usage(), "pjax": pjax_stats(f.stats, self.model)})

    async def _events(self, f: OutputFollower, rid: str, chat: bool):
        created, name = int(time.time()), self.model.name
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": name}
        usage = {"usage": None} if f.job.include_usage else {}

        def chunk(text, finish=None, first=False, **extra):
            if chat:
                delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            if finish is not None:
                choice["stop_reason"] = f.stop_reason
            return _sse({**head, "choices": [choice], **usage, **extra})

        try:
            if chat:
                yield chunk("", first=True)
            async for event in f.stream:
                text = f.feed(event)
                if f.done:
                    yield chunk(text, f.finish_reason, pjax=pjax_stats(f.stats, self.model))
                elif text:
                    yield chunk(text)
            if f.job.include_usage:
                yield _sse({**head, "choices": [], "usage": f.usage()})
        except EngineDeadError as e:
            yield _sse(APIError(str(e), status=503, type="service_unavailable").body())
        yield "data: [DONE]\n\n"


class _EventStream(StreamingResponse):
    """Server-sent events of one request; however the response ends before the request did (the client went away,
    even before the first event; the server's shutdown cancelled it), the request is cancelled: its slot frees."""

    def __init__(self, events, stream):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.stream = stream

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.stream.cancel()  # a no-op once the request finished


async def _until_disconnect(request: Request, work, stream) -> Response:
    """Await `work` (a coroutine making the response); a client disconnect first cancels it and the request."""
    task = asyncio.ensure_future(work)

    async def disconnected():
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the handler itself was cancelled (the server's shutdown): end the request too
        task.cancel()
        stream.cancel()
        raise
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        stream.cancel()
        return Response(status_code=499)  # nobody reads it: the connection is gone
    return task.result()


async def _internal_error(request: Request, exc: Exception) -> Response:
    return APIError(f"the request could not be handled: {type(exc).__name__}: {exc}", status=500,
                    type="internal_server_error").response()


def create_app(bridge: AsyncEngine, model: ServedModel, *, lifespan=None) -> Starlette:
    """The ASGI app serving `model` through `bridge`; lifespan: Starlette's lifespan context (startup /
    shutdown)."""
    api = _API(bridge, model)
    routes = [Route("/health", api.health, methods=["GET"]),
              Route("/v1/models", api.models, methods=["GET"]),
              Route("/v1/models/{model:path}", api.model_card, methods=["GET"]),
              Route("/v1/completions", api.completions, methods=["POST"]),
              Route("/v1/chat/completions", api.chat, methods=["POST"])]
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={500: _internal_error})

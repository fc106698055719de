"""The OpenAI-compatible HTTP API over the continuous-batching engine (an ASGI app: Starlette; served by uvicorn).

    GET  /health                 {"status": "ok", "running": N, "waiting": M} (503 once the engine stopped or while
                                 the server shuts down)
    GET  /metrics                Prometheus metrics under vLLM's names (`pjax.serve.metrics`)
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
"acceptance_rates" (per draft position), "mean_budget" (draft tokens verified per round: K, or what --k auto
chose), "rounds", "queue_s", "ttft_s", "e2e_s", "tpot_s"}. Clients that do not know the key ignore it.

Errors are OpenAI's JSON: {"error": {"message", "type": "invalid_request_error", "param": FIELD, "code": null}} with
400 for a bad field (the message says what was expected) or a body that is not JSON text (deep nesting, lone
surrogates), 404 for an unknown model, 408 / 413 for a body too slow / too large (`ServerLimits`), 503 once the
engine stopped or while the server shuts down: never a 500 for a malformed request. Bodies are decoded, checked and
tokenized on a thread pool, off the event loop. A client that disconnects (streaming or not) cancels its request
(one log line on the "pjax.serve" logger). Shutdown (`app.state.begin_shutdown(grace_s)`): new requests get 503,
requests in flight get grace_s, then the rest are aborted and each response still ends cleanly.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import math
import random
import time
import uuid
from typing import Any, Optional

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pjax.decode.budget import draft_tokens
from pjax.decode.inputs import SEED_LIMIT, is_int, is_real
from pjax.serve.async_engine import AsyncEngine, EngineDeadError
from pjax.decode.engine import STOP_WIDTH, RequestParams
from pjax.serve.limits import ServerLimits
from pjax.serve.metrics import CONTENT_TYPE, Metrics
from pjax.text.detokenize import OutputText, check_stop_strings
from pjax.text.template import TemplateError
from pjax.text.tokenizer import Tokenizer, TokenizerError, check_messages

__all__ = ["APIError", "ServedModel", "ServerLimits", "create_app"]

_log = logging.getLogger("pjax.serve")

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the legacy completions API's (and vLLM's) default; chat fills the context
# engine stop reasons -> OpenAI finish reasons ("stop" here is a cancel the text layer did not ask for)
FINISH = {"eos": "stop", "length": "length", "capacity": "length", "nonfinite": "error", "stop": "abort"}
STATS_KEYS = ("num_drafts", "num_accepted_tokens", "mean_acceptance_length", "acceptance_rates", "mean_budget",
              "rounds", "queue_s", "ttft_s", "e2e_s", "tpot_s")
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
        return _AsciiJSONResponse(self.body(), status_code=self.status)


class _AsciiJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: an error may quote a client's lone surrogate, which UTF-8 cannot encode."""

    def render(self, content) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


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

MAX_JSON_DEPTH = 32  # no field of the API nests deeper than a few levels


def decode_body(raw: bytes):
    """A request body -> its JSON value; APIError (400) for anything that is not JSON text the API can hold: invalid
    UTF-8 or JSON, nesting deeper than MAX_JSON_DEPTH, a lone surrogate in a string (not Unicode text)."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise APIError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of too many digits
        raise APIError(f"the request body is not valid JSON ({e})") from None
    todo = [(value, "", 0)]
    while todo:
        v, where, depth = todo.pop()
        if depth > MAX_JSON_DEPTH:
            raise APIError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels", _field(where))
        if isinstance(v, dict):
            for key, item in v.items():
                todo.append((key, where, depth + 1))
                todo.append((item, f"{where}.{key}" if where else key, depth + 1))
        elif isinstance(v, list):
            todo.extend((item, f"{where}[{i}]", depth + 1) for i, item in enumerate(v))
        elif isinstance(v, str) and not v.isascii():
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                raise APIError(f"{where or 'the request body'}: a lone surrogate {v[e.start]!r} at character "
                               f"{e.start} is not Unicode text", _field(where)) from None
    return value


def _field(where: str) -> Optional[str]:
    """The top-level field of a path like "messages[0].content"."""
    return where.split(".")[0].split("[")[0] or None


def max_token_chars(tokenizer: Tokenizer) -> Optional[int]:
    """The most characters one token of `tokenizer` stands for (its longest token, as text or as decoded), so a text
    of n characters has at least n / this many tokens; None when a normalizer may rewrite the text first (no bound)."""
    if getattr(tokenizer.backend, "normalizer", None) is not None:
        return None
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    return max(max(len(piece), len(tokenizer.decode([i], skip_special_tokens=False))) for piece, i in vocab.items())


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
        if not is_real(v):
            raise APIError(f"{name} must be a number, got {_json_type(v)} {_show(v)}", name)
        if not math.isfinite(v):
            raise APIError(f"{name} must be a finite number, got {_show(v)}", name)
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
    s = json.dumps(v) if not isinstance(v, float) or math.isfinite(v) else str(v)  # ASCII: lone surrogates escaped
    return s if len(s) <= 60 else s[:57] + "..."


def _range(low, high, low_open=False) -> str:
    return f"{'(' if low_open else '['}{'-inf' if low is None else low}, {'inf' if high is None else high}]"


def _check_model(fields: _Fields, model: ServedModel):
    name = fields.body.get("model")
    if name is not None and name != model.name:
        raise APIError(f"The model `{name}` does not exist. This server serves `{model.name}`.", "model",
                       status=404, code="model_not_found")


def _check_text_fits(text: str, model: ServedModel, max_chars: Optional[int], param: str):
    """A text too long to fit in any tokenization is refused before it is tokenized (the heavy part)."""
    if max_chars is not None and len(text) > max_chars:
        raise APIError(f"{param}: {len(text)} characters cannot fit: this server's max length {model.max_len} leaves "
                       f"at most {model.max_len - model.slack - 1} prompt tokens, at most {max_chars} characters "
                       "with this tokenizer", param)


def _prompt_ids(fields: _Fields, model: ServedModel, max_chars: Optional[int]) -> list[int]:
    p = fields.body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and (isinstance(p[0], str) or isinstance(p[0], list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        _check_text_fits(p, model, max_chars, "prompt")
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


def _chat_ids(fields: _Fields, model: ServedModel, max_chars: Optional[int]) -> list[int]:
    messages = _messages(fields)
    kwargs = fields.get("chat_template_kwargs", {})
    if not isinstance(kwargs, dict):
        raise APIError(f"chat_template_kwargs must be an object, got {_json_type(kwargs)}", "chat_template_kwargs")
    if not model.tokenizer.has_chat_template:
        raise APIError(f"the model {model.name} has no chat template: use /v1/completions with a text prompt",
                       "messages")
    try:
        text = model.tokenizer.apply_chat_template(
            messages, add_generation_prompt=fields.boolean("add_generation_prompt", True), tokenize=False, **kwargs)
    except (TemplateError, TokenizerError, TypeError, ValueError, RecursionError) as e:
        raise APIError(f"messages: the chat template failed: {e}", "messages") from None
    _check_text_fits(text, model, max_chars, "messages")
    ids = model.tokenizer.encode(text, add_special_tokens=False)  # the template wrote the special tokens
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


def parse_completion(body, model: ServedModel, max_chars: Optional[int] = None) -> Job:
    """A /v1/completions body -> Job (APIError naming the field otherwise); max_chars: longer text prompts are
    refused before they are tokenized."""
    fields = _Fields(body, COMPLETION_FIELDS)
    _check_model(fields, model)
    fields.only("echo", (False,), "the prompt is not echoed (echo=false)")
    fields.only("logprobs", (), "pjax returns no log probabilities")
    fields.only("best_of", (1,), "one sequence per request (best_of=1)")
    fields.only("suffix", ("",), "no suffix (insertion) completions")
    if "prompt" not in body:
        raise APIError("prompt is required (a string or an array of token ids)", "prompt")
    return _job(fields, model, _prompt_ids(fields, model, max_chars), chat=False)


def parse_chat(body, model: ServedModel, max_chars: Optional[int] = None) -> Job:
    """A /v1/chat/completions body -> Job (APIError naming the field otherwise); max_chars: as parse_completion's,
    for the rendered chat."""
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
    return _job(fields, model, _chat_ids(fields, model, max_chars), chat=True)


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

def finish_reason(event, stream) -> str:
    """The OpenAI finish reason of a request's final engine event (a cancel is "stop" when the text layer cut the
    output at a stop string, else "abort")."""
    if event.stop_reason == "stop" and stream.cut:
        return "stop"
    return FINISH.get(event.stop_reason, event.stop_reason)


def _shutting_down() -> APIError:
    return APIError("the server is shutting down", status=503, type="service_unavailable")


def _client(request: Request) -> str:
    c = request.client
    return f"{c.host}:{c.port}" if c else "a client"


class _API:
    def __init__(self, bridge: AsyncEngine, model: ServedModel, limits: ServerLimits):
        self.bridge, self.model, self.limits = bridge, model, limits
        chars = max_token_chars(model.tokenizer)
        self.max_chars = None if chars is None else chars * (model.max_len - model.slack - 1)
        self.pool = concurrent.futures.ThreadPoolExecutor(limits.parse_threads, thread_name_prefix="pjax-parse")
        self.draining = False
        self.aborted = asyncio.Event()  # set when the shutdown's grace period is over
        self.metrics = Metrics(model.name, model.num_speculative_tokens if model.drafting != "none" else 0,
                               running=lambda: bridge.num_running, waiting=lambda: bridge.num_waiting,
                               budget=lambda: draft_tokens(bridge.engine.budget))
        bridge.add_listener(lambda event, stream: self.metrics.observe(event.stats, finish_reason(event, stream)))

    def begin_shutdown(self, grace_s: float):
        """The server stops: new requests get 503 at once; requests in flight get grace_s seconds to finish, then
        every request still running or queued is aborted (its response ends with finish_reason "abort")."""
        self.draining = True
        asyncio.get_running_loop().call_later(grace_s, self._abort)

    def _abort(self):
        self.aborted.set()  # bodies still arriving are refused
        self.bridge.abort_all()

    def _unavailable(self) -> Optional[APIError]:
        if self.draining:
            return _shutting_down()
        if not self.bridge.alive:
            return APIError(f"the engine stopped: {self.bridge.error or 'shut down'}", status=503,
                            type="service_unavailable")
        return None

    async def health(self, request: Request) -> Response:
        down = self._unavailable()
        if down is not None:
            return down.response()
        return JSONResponse({"status": "ok", "running": self.bridge.num_running, "waiting": self.bridge.num_waiting})

    async def metrics_text(self, request: Request) -> Response:
        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE)

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

    async def _read_body(self, request: Request) -> bytes:
        """The body, at most max_body_bytes (413 past it) within body_timeout_s (408); ClientDisconnect if the
        client goes away first."""
        limit = self.limits.max_body_bytes
        too_large = APIError(f"the request body is larger than this server's limit of {limit} bytes",
                             status=413)
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks, size = [], 0

        async def read():
            nonlocal size
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large
                chunks.append(chunk)
        reading = asyncio.ensure_future(asyncio.wait_for(read(), self.limits.body_timeout_s))
        aborted = asyncio.ensure_future(self.aborted.wait())
        try:
            await asyncio.wait({reading, aborted}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            aborted.cancel()
            if not reading.done():
                reading.cancel()
        if not reading.done():  # the grace period ended first
            raise _shutting_down()
        try:
            reading.result()
        except asyncio.TimeoutError:
            raise APIError(f"the request body did not arrive within {self.limits.body_timeout_s:g} s",
                           status=408) from None
        return b"".join(chunks)

    def _parse(self, raw: bytes, chat: bool) -> Job:
        """Decode, check and tokenize one request body (on a parse thread)."""
        return (parse_chat if chat else parse_completion)(decode_body(raw), self.model, self.max_chars)

    async def _serve(self, request: Request, *, chat: bool) -> Response:
        try:
            down = self._unavailable()
            if down is not None:
                raise down
            raw = await self._read_body(request)
            job = await asyncio.get_running_loop().run_in_executor(self.pool, self._parse, raw, chat)
            try:
                stream = await self.bridge.submit(job.prompt, job.params)
            except EngineDeadError as e:
                raise APIError(str(e), status=503, type="service_unavailable") from None
            except (TypeError, ValueError) as e:  # the engine's own checks (after ours: rarely reached)
                raise APIError(str(e)) from None
        except APIError as e:
            response = e.response()
            if e.status in (408, 413):  # the rest of the body is not read: this connection cannot carry another
                response.headers["connection"] = "close"
            return response
        except ClientDisconnect:
            _log.info("%s disconnected while sending its request", _client(request))
            return Response(status_code=499)  # nobody reads it: the connection is gone
        except asyncio.CancelledError:  # the server's shutdown stopped waiting for this request
            return _shutting_down().response()
        follower = OutputFollower(job, self.model.tokenizer, stream)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if job.stream:
            return _EventStream(self._events(follower, rid, chat), follower.stream, _client(request))
        return await _until_disconnect(request, self._whole(follower, rid, chat), stream)

    async def _whole(self, f: OutputFollower, rid: str, chat: bool) -> Response:
        text = []
        try:
            async for event in f.stream:
                text.append(f.feed(event))
        except EngineDeadError as e:
            return APIError(str(e), status=503, type="service_unavailable").response()
        if self.draining and f.finish_reason == "abort" and not f.out.token_ids:
            return APIError("the server is shutting down; the request was not started", status=503,
                            type="service_unavailable").response()
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
    even before the first event; the server's shutdown cancelled it), the request is cancelled: its slot frees. A
    client that goes away is one log line."""

    def __init__(self, events, stream, client: str):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.stream, self.client = stream, client

    async def __call__(self, scope, receive, send):
        started = False

        async def sending(message):
            nonlocal started
            started = True
            await send(message)
        try:
            await super().__call__(scope, receive, sending)
        except (ClientDisconnect, OSError):
            pass
        except asyncio.CancelledError:  # the server's shutdown stopped waiting for this request: end it cleanly
            if not started:
                raise
            error = APIError("the server shut down before the request finished", status=503,
                             type="service_unavailable")
            await send({"type": "http.response.body", "body": (_sse(error.body()) + "data: [DONE]\n\n").encode(),
                        "more_body": False})
        finally:
            if not self.stream.finished:
                _log.info("%s disconnected mid-stream: its request is cancelled", self.client)
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
        return APIError("the server shut down before the request finished", status=503,
                        type="service_unavailable").response()
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        stream.cancel()
        _log.info("%s disconnected before its response: its request is cancelled", _client(request))
        return Response(status_code=499)  # nobody reads it: the connection is gone
    return task.result()


async def _internal_error(request: Request, exc: Exception) -> Response:
    return APIError(f"the request could not be handled: {type(exc).__name__}: {exc}", status=500,
                    type="internal_server_error").response()


def create_app(bridge: AsyncEngine, model: ServedModel, *, lifespan=None,
               limits: ServerLimits = ServerLimits()) -> Starlette:
    """The ASGI app serving `model` through `bridge`; lifespan: Starlette's lifespan context (startup /
    shutdown). `app.state.begin_shutdown(grace_s)`: the server's shutdown (see `_API.begin_shutdown`); the metrics
    registry is `app.state.metrics.registry`."""
    api = _API(bridge, model, limits)
    routes = [Route("/health", api.health, methods=["GET"]),
              Route("/metrics", api.metrics_text, methods=["GET"]),
              Route("/v1/models", api.models, methods=["GET"]),
              Route("/v1/models/{model:path}", api.model_card, methods=["GET"]),
              Route("/v1/completions", api.completions, methods=["POST"]),
              Route("/v1/chat/completions", api.chat, methods=["POST"])]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={500: _internal_error})
    app.state.begin_shutdown, app.state.metrics = api.begin_shutdown, api.metrics
    return app

"""Text in, text out: prompts or chats through the speculative engine (`pjax.decode.Generation`), text back.

`TextGenerator(target, drafter, tokenizer)` (or `pjax.text.load(target_dir, head_dir)`) renders each prompt with the
tokenizer (a string, or a chat through the model's template), runs the batch through the engine, and turns every
device chunk's tokens into text (`pjax.text.detokenize`): stop strings end a row from the host so it stops
computing, `stream()` hands out text deltas as chunks complete, `generate()` the finished outputs.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Iterator, Optional, Sequence, Union

from pjax.checkpoint import load_drafter, load_target
from pjax.decode import EngineConfig, Generation, GenerationInterrupted
from pjax.decode.budget import is_auto
from pjax.decode.settings import configure
from pjax.decode.inputs import check_prefill, is_int
from pjax.decode.drafting import resolve
from pjax.dtypes import parse_dtype
from pjax.models.drafter import Drafter
from pjax.models.target import Target
from pjax.text.detokenize import OutputText, check_stop_strings
from pjax.text.tokenizer import Tokenizer, load_tokenizer

__all__ = ["TextDelta", "TextGenerationInterrupted", "TextGenerator", "TextOutput", "TextStream", "load"]

# engine stop reasons -> finish reasons ("eos" is a stop token: vLLM's "stop")
FINISH = {"eos": "stop", "length": "length", "capacity": "capacity", "nonfinite": "nonfinite",
          "interrupted": "interrupted"}

Prompt = Union[str, Sequence[dict], Sequence[int]]


@dataclasses.dataclass
class TextOutput:
    """One request's result.

    text: the generated text (cut at a stop string); token_ids: the generated ids (a stop token or the token that
    completed a stop string included); finish_reason: "stop" (EOS, a stop token or a stop string), "length"
    (max_new_tokens), "capacity" (the KV cache filled), "nonfinite" (the target's logits turned NaN / inf) or
    "interrupted"; stop_reason: the stop string matched, the id from stop_token_ids that ended it, or None;
    prompt_token_ids: the rendered prompt; stats: the engine's per-request statistics (output_tokens,
    mean_acceptance_length, acceptance_rates per draft position, ttft_s, e2e_s, tpot_s, output_tokens_per_s, ...).
    """
    text: str
    token_ids: list[int]
    finish_reason: str
    stop_reason: Union[str, int, None]
    prompt_token_ids: list[int]
    stats: dict[str, Any]


@dataclasses.dataclass
class TextDelta:
    """New output of request `index` since its previous delta: text (concatenated over a request's deltas it is its
    final text), token_ids (its new ids), finished / finish_reason (set on its last delta)."""
    index: int
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: Optional[str]


class TextGenerationInterrupted(KeyboardInterrupt):
    """Ctrl-C during a generation: `.outputs` holds every request's output so far (unfinished ones "interrupted")."""

    def __init__(self, outputs: list[TextOutput]):
        super().__init__("generation interrupted; partial outputs in .outputs")
        self.outputs = outputs


@dataclasses.dataclass
class _Request:
    prompt: list[int]
    out: OutputText
    finish_reason: Optional[str] = None
    stop_reason: Union[str, int, None] = None


class TextStream:
    """A running batch: iterate for `TextDelta`s as device chunks complete; `result()` runs to the end and returns
    the outputs (one `TextOutput`, or a list for a batch, as `TextGenerator.generate`)."""

    def __init__(self, generation: Generation, requests: list[_Request], *, single: bool, eos: frozenset,
                 stop_token_ids: frozenset):
        self._gen = generation
        self._requests = requests
        self._single = single
        self._eos = eos
        self._stop_ids = stop_token_ids
        self._outputs: Optional[list[TextOutput]] = None

    def __iter__(self) -> Iterator[TextDelta]:
        if self._outputs is not None:
            return
        try:
            for chunk in self._gen:
                deltas = []  # every request takes the whole chunk before any delta is handed out
                for i, req in enumerate(self._requests):
                    if req.finish_reason is not None:
                        continue
                    ids = self._feed(i, req, chunk.new_tokens[i], chunk.stop_reasons[i] if chunk.done[i] else None)
                    finished = req.finish_reason is not None
                    text = req.out.take(final=finished)
                    if text or ids or finished:
                        deltas.append(TextDelta(i, text, ids, finished, req.finish_reason))
                yield from deltas
        except KeyboardInterrupt as e:
            self._interrupted(e)
        self._outputs = self._build(self._gen.result())

    def _feed(self, i: int, req: _Request, new: list[int], reason: Optional[str]) -> list[int]:
        """Add a chunk's tokens to request i; end it at a stop string (ending its row on the device too) or at the
        engine's stop. Returns the ids kept."""
        for j, t in enumerate(new):
            last_stop = reason == "eos" and j == len(new) - 1
            if req.out.add(t, is_stop_token=last_stop):
                req.finish_reason, req.stop_reason = "stop", req.out.stop_string
                self._gen.finish(i, keep=len(req.out.token_ids))
                return new[:j + 1]
        if reason is not None:
            req.finish_reason = FINISH.get(reason, reason)
            if reason == "eos" and new:
                t = new[-1]
                req.stop_reason = t if t in self._stop_ids and t not in self._eos else None
        return new

    def _interrupted(self, e: KeyboardInterrupt):
        if isinstance(e, GenerationInterrupted):
            res = e.result
        else:  # Ctrl-C outside the device call: keep what the last chunk delivered
            self._gen.close()
            res = self._gen.result()
        for i, req in enumerate(self._requests):
            if req.finish_reason is None:  # tokens of the last snapshot not handed out yet, then "interrupted"
                for t in res.tokens[i][len(req.out.token_ids):]:
                    if req.out.add(t):
                        req.finish_reason, req.stop_reason = "stop", req.out.stop_string
                        break
                else:
                    req.finish_reason = "interrupted"
        outputs = self._build(res)
        self._outputs = outputs
        raise TextGenerationInterrupted(outputs) from None

    def _build(self, res) -> list[TextOutput]:
        out = []
        for i, req in enumerate(self._requests):
            req.out.take(final=True)
            out.append(TextOutput(req.out.text, list(req.out.token_ids), req.finish_reason, req.stop_reason,
                                  req.prompt, res.stats["requests"][i]))
        return out

    def result(self) -> Union[TextOutput, list[TextOutput]]:
        for _ in self:
            pass
        return self._outputs[0] if self._single else list(self._outputs)


class TextGenerator:
    """Speculative text generation with a target, a drafter (None: plain decoding) and the target's tokenizer.

    config / settings: the decoding settings, a `pjax.decode.EngineConfig` and / or its fields by name (e.g.
    implementation, prefill, cache_dtype, rounds_per_step: rounds per device chunk, how often text streams and stop
    strings are checked), as `pjax.generate`; drafting and K are chosen per call.
    """

    def __init__(self, target, drafter, tokenizer: Tokenizer, *, config: Optional[EngineConfig] = None, **settings):
        if not isinstance(target, Target):
            raise TypeError(f"target must be a pjax Target (pjax.load_target(dir)), got {type(target).__name__}")
        if not isinstance(tokenizer, Tokenizer):
            raise TypeError(f"tokenizer must be a pjax.text.Tokenizer (pjax.text.load_tokenizer(dir)), got "
                            f"{type(tokenizer).__name__}")
        if drafter is not None and not isinstance(drafter, Drafter):
            raise TypeError(f"drafter must be a pjax Drafter or None, got {type(drafter).__name__}")
        vocab = target.config.vocab_size
        if tokenizer.vocab_size > vocab:
            warnings.warn(f"the tokenizer has {tokenizer.vocab_size} tokens but the target's vocabulary is {vocab}: "
                          "prompts holding the extra tokens will be refused", stacklevel=2)
        self.target, self.drafter, self.tokenizer = target, drafter, tokenizer
        self.config = configure(config, **settings)
        check_prefill(self.config.prefill)

    def __repr__(self):
        head = "none" if self.drafter is None else self.drafter.config.model_kind
        return f"TextGenerator(target={self.target.config.model_type}, drafter={head}, tokenizer={self.tokenizer})"

    # -- inputs --------------------------------------------------------------------------------------------------
    def _prompts(self, prompts, chat, template_kwargs) -> tuple[list[list[int]], bool]:
        """-> (prompt ids per request, whether one request was given)."""
        def one(p, where):
            if isinstance(p, (list, tuple)) and p and all(is_int(t) for t in p):
                if chat:
                    raise ValueError(f"{where}: chat=True needs text or messages, not token ids")
                return [int(t) for t in p]
            try:
                ids = self.tokenizer.render(p, chat=chat, chat_template_kwargs=template_kwargs)
            except (TypeError, ValueError) as e:
                raise type(e)(f"{where}: {e}") from None
            if not ids:
                raise ValueError(f"{where} renders to no tokens (an empty prompt and no BOS to start from)")
            return ids

        if isinstance(prompts, str) or _is_chat(prompts) or _is_ids(prompts):
            return [one(prompts, "prompt")], True
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise TypeError("prompts: a string, a chat (list of {'role', 'content'} messages), token ids, or a "
                            f"non-empty list of those; got {type(prompts).__name__}"
                            + (" (empty)" if isinstance(prompts, (list, tuple)) else ""))
        return [one(p, f"prompts[{i}]") for i, p in enumerate(prompts)], False

    def _drafting(self, drafting: Optional[str], k: Union[int, str, None]) -> tuple[str, Union[int, str]]:
        """(drafting, K or "auto"): k None = the config's num_speculative_tokens, then "auto" with tree_budget
        "auto", else the drafting's default."""
        k = self.config.num_speculative_tokens if k is None else k
        if k is None and is_auto(self.config.tree_budget):
            k = "auto"
        mode, resolved = resolve(self.drafter, drafting, k, k_name="k")
        return mode, k if is_auto(k) and mode.speculative else max(resolved, 1)

    # -- generation ----------------------------------------------------------------------------------------------
    def stream(self, prompts, *, max_new_tokens: Union[int, Sequence[int]], drafting: Optional[str] = None,
               k: Union[int, str, None] = None, temperature=None, top_p=None, top_k=None, seed=0,
               stop: Union[str, Sequence[str], None] = None, stop_token_ids: Optional[Sequence[int]] = None,
               include_stop_str_in_output: bool = False, ignore_eos: bool = False, skip_special_tokens: bool = True,
               chat: Optional[bool] = None, chat_template_kwargs: Optional[dict] = None,
               progress: bool = False) -> TextStream:
        """Start a generation (prompts are rendered, checked and prefilled now); iterate the returned `TextStream`
        for text deltas. Arguments as `generate`."""
        ids, single = self._prompts(prompts, chat, chat_template_kwargs)
        drafting, k = self._drafting(drafting, k)
        stops = check_stop_strings(stop)
        user_ids = _check_ids(stop_token_ids, self.target.config.vocab_size)
        if not isinstance(include_stop_str_in_output, bool) or not isinstance(ignore_eos, bool):
            raise TypeError("include_stop_str_in_output and ignore_eos must be True or False")
        eos = () if ignore_eos else self.tokenizer.eos_token_ids
        stop_ids = list(dict.fromkeys([*eos, *user_ids]))
        generation = Generation(self.target, self.drafter if drafting.speculative else None, ids,
                                max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                seed=seed, eos_token_id=stop_ids, progress=progress, config=self.config,
                                num_speculative_tokens=k, drafting=drafting)
        requests = [_Request(p, OutputText(self.tokenizer, p, stop=stops, skip_special_tokens=skip_special_tokens,
                                           include_stop_str_in_output=include_stop_str_in_output)) for p in ids]
        return TextStream(generation, requests, single=single, eos=frozenset(eos), stop_token_ids=frozenset(user_ids))

    def generate(self, prompts, *, max_new_tokens: Union[int, Sequence[int]], drafting: Optional[str] = None,
                 k: Union[int, str, None] = None, temperature=None, top_p=None, top_k=None, seed=0,
                 stop: Union[str, Sequence[str], None] = None, stop_token_ids: Optional[Sequence[int]] = None,
                 include_stop_str_in_output: bool = False, ignore_eos: bool = False, skip_special_tokens: bool = True,
                 chat: Optional[bool] = None, chat_template_kwargs: Optional[dict] = None,
                 progress: bool = False) -> Union[TextOutput, list[TextOutput]]:
        """Generate text for one prompt (-> TextOutput) or a batch (-> list of TextOutput).

        prompts: a string (encoded with the tokenizer's special-token rules, e.g. a leading BOS), a chat (a list of
          {"role", "content"} messages, rendered with the model's template and its generation prompt), token ids,
          or a list of those. chat=True wraps strings as one user message; chat_template_kwargs: extra template
          variables (e.g. {"enable_thinking": False}).
        drafting: "parallel" (P-EAGLE) | "sequential" (EAGLE-3) | "none"; default: "none" without a drafter, else
          the head's kind. k: draft tokens per round (default: the config's, else 7 parallel, capped by the head's
          trained depth, and 3 sequential), or "auto" (a budget that follows the load, `pjax.generate`).
        max_new_tokens, temperature, top_p, top_k, seed: as `pjax.generate` (one value, or one per prompt).
        stop: strings that end an output (cut before the first one, or after it with include_stop_str_in_output);
          stop_token_ids: ids that end an output besides EOS (the tokenizer's and generation_config.json's; none
          with ignore_eos). skip_special_tokens: leave special tokens out of the text.
        Ctrl-C raises `TextGenerationInterrupted` carrying the outputs so far.
        """
        return self.stream(prompts, max_new_tokens=max_new_tokens, drafting=drafting, k=k, temperature=temperature,
                           top_p=top_p, top_k=top_k, seed=seed, stop=stop, stop_token_ids=stop_token_ids,
                           include_stop_str_in_output=include_stop_str_in_output, ignore_eos=ignore_eos,
                           skip_special_tokens=skip_special_tokens, chat=chat,
                           chat_template_kwargs=chat_template_kwargs, progress=progress).result()


def _is_chat(p) -> bool:
    return isinstance(p, (list, tuple)) and bool(p) and all(isinstance(m, dict) for m in p)


def _is_ids(p) -> bool:
    return isinstance(p, (list, tuple)) and bool(p) and all(is_int(t) for t in p)


def _check_ids(ids, vocab: int) -> list[int]:
    if ids is None:
        return []
    items = [ids] if is_int(ids) else ids
    if not isinstance(items, (list, tuple)):
        raise TypeError(f"stop_token_ids must be a list of token ids, got {type(ids).__name__}")
    for t in items:
        if not is_int(t):
            raise TypeError(f"stop_token_ids: {t!r} is not an integer token id")
        if not 0 <= t < vocab:
            raise ValueError(f"stop_token_ids: {t} outside the target's vocabulary [0, {vocab})")
    return [int(t) for t in items]


def load(target_dir, head_dir=None, dtype="bfloat16", *, tokenizer_dir=None, **options) -> TextGenerator:
    """Load a Hugging Face target directory, an optional P-EAGLE / EAGLE-3 head and the tokenizer (from
    tokenizer_dir, default the target directory) into a `TextGenerator`; options go to `TextGenerator`."""
    dt = parse_dtype(dtype, what="dtype")
    tokenizer = load_tokenizer(target_dir if tokenizer_dir is None else tokenizer_dir)
    target = load_target(target_dir, dtype=dt)
    drafter = None if head_dir is None else load_drafter(head_dir, dtype=dt, target=target)
    return TextGenerator(target, drafter, tokenizer, **options)

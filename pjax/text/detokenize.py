"""One request's output text, built token by token: incremental detokenization and stop strings.

Rules (vLLM's, so outputs compare with a vLLM server's):
- Text grows by whole characters only: the `tokenizers` DecodeStream holds back a token that ends inside a UTF-8
  character until a later token completes it (an incomplete character left at the very end is dropped). The stream
  is primed with the end of the prompt, so a first token's leading space or byte context comes out as it would in
  the prompt's continuation.
- A stop token (EOS or `stop_token_ids`) ends the output; its text is left out unless include_stop_str_in_output.
- Stop strings are searched after every token in the text that token completed; the first match (the earliest
  start among the stop strings the token completes) cuts the text there, the stop string excluded unless
  include_stop_str_in_output, and the output token ids end with that token.
- Streaming deltas hold back the end of the text that could still become a stop string (the longest suffix that
  is a proper prefix of one), so streamed text is never taken back and the deltas concatenate to the final text.

Checking per token makes the text independent of how the tokens arrive (one device chunk or many).
"""
from __future__ import annotations

from typing import Optional, Sequence

from tokenizers.decoders import DecodeStream

from pjax.text.tokenizer import Tokenizer

__all__ = ["OutputText", "check_stop_strings"]

PRIME_MIN, PRIME_MAX = 4, 24  # prompt tokens the decode stream starts from (a clean suffix is searched in this range)
_INVALID_PREFIX = "Invalid prefix encountered"  # DecodeStream's error when a decoder rewrites earlier text


def check_stop_strings(stop: Sequence[str], where: str = "stop") -> tuple[str, ...]:
    """None, a string or a list of non-empty strings -> tuple."""
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)):
        raise TypeError(f"{where} must be a string or a list of strings, got {type(stop).__name__}")
    for i, s in enumerate(items):
        if not isinstance(s, str):
            raise TypeError(f"{where}[{i}] must be a string, got {type(s).__name__}")
        if not s:
            raise ValueError(f"{where}[{i}] is empty (an empty stop string would end every output at once)")
    return tuple(dict.fromkeys(items))


class OutputText:
    """Text and token ids of one output as tokens arrive.

    add(token, is_stop_token=False) -> True when a stop string ended the output at this token; take(final) -> the
    text not yet handed out (holding back a possible stop-string start unless final). text / token_ids /
    stop_string: the output so far.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], *, stop: tuple[str, ...] = (),
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._stop = stop
        self._include = include_stop_str_in_output
        self._longest = max((len(s) for s in stop), default=0)
        self.text = ""
        self.token_ids: list[int] = []
        self.stop_string: Optional[str] = None
        self._given = 0  # characters handed out by take()
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        for t in self._prime(list(prompt_ids)):
            self._step(t)

    def _prime(self, prompt: list[int]) -> list[int]:
        """The shortest prompt suffix of PRIME_MIN..PRIME_MAX tokens that decodes to whole characters."""
        if len(prompt) <= PRIME_MIN:
            return prompt
        for n in range(PRIME_MIN, min(len(prompt), PRIME_MAX) + 1):
            if "\ufffd" not in self._tokenizer.decode(prompt[-n:], skip_special_tokens=self._skip):
                return prompt[-n:]
        return prompt[-PRIME_MAX:]

    def _step(self, token: int) -> str:
        backend = self._tokenizer.backend
        try:
            piece = self._stream.step(backend, token)
        except Exception as e:  # tokenizers raises a plain Exception here
            if not str(e).startswith(_INVALID_PREFIX):
                raise
            # a decoder that rewrites earlier text (e.g. strips a leading space) broke the stream's prefix:
            # restart it from this token
            self._stream = DecodeStream(skip_special_tokens=self._skip)
            piece = self._stream.step(backend, token)
        return piece or ""

    def add(self, token: int, is_stop_token: bool = False) -> bool:
        """Append one generated token. is_stop_token: the EOS / stop id that ends the output (its text is left out
        unless include_stop_str_in_output). Returns True when a stop string ends the output here (the text is
        already cut; no further token may be added)."""
        if self.stop_string is not None:
            raise RuntimeError("the output already ended at a stop string")
        self.token_ids.append(int(token))
        if is_stop_token and not self._include:
            return False
        before = len(self.text)
        self.text += self._step(int(token))
        if not self._stop or len(self.text) == before:
            return False
        best = None
        for s in self._stop:
            at = self.text.find(s, max(0, before - len(s) + 1))
            if at >= 0 and (best is None or at < best[0]):
                best = (at, s)
        if best is None:
            return False
        at, s = best
        self.text = self.text[:at + len(s) if self._include else at]
        self.stop_string = s
        return True

    def _held(self) -> int:
        """Characters at the end that could start a stop string (held back from streaming)."""
        if self._include or not self._stop:
            return 0
        room = len(self.text) - self._given
        for n in range(min(self._longest - 1, room), 0, -1):
            tail = self.text[-n:]
            if any(len(s) > n and s.startswith(tail) for s in self._stop):
                return n
        return 0

    def take(self, final: bool = False) -> str:
        """The text since the previous take (all of it when final)."""
        end = len(self.text) if final or self.stop_string is not None else len(self.text) - self._held()
        out = self.text[self._given:end]
        self._given = max(self._given, end)
        return out

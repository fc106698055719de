"""The target's tokenizer, read from a Hugging Face model directory.

Files (the Hugging Face layout): `tokenizer.json` (required: the fast tokenizer, run by the `tokenizers` library),
`tokenizer_config.json` (special tokens, the chat template), `chat_template.jinja` and
`additional_chat_templates/*.jinja` (templates saved as files take priority over the config's, as in transformers),
`chat_template.json` (a processor's template, the last fallback), `special_tokens_map.json` (legacy special tokens,
read as transformers does: only when the config has no `added_tokens_decoder`), `generation_config.json` (EOS ids;
`config.json`'s when there is no generation config).

Encoding and decoding are the `tokenizers` pipeline of `tokenizer.json` as it stands (its post-processor adds BOS
where the model wants one): the same ids and text as transformers' fast tokenizer loaded from the same directory.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence, Union

try:
    import tokenizers
except ImportError as e:  # pragma: no cover - the `text` extra is missing
    raise ImportError("pjax.text needs the `tokenizers` package: pip install 'pjax[text]'") from e

from pjax.text.template import render_template

__all__ = ["Tokenizer", "TokenizerError", "check_messages", "load_tokenizer"]

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"
TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"
PROCESSOR_TEMPLATE_FILE = "chat_template.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

Messages = Sequence[dict]


class TokenizerError(ValueError):
    """Tokenizer files are missing or malformed; the message names the directory or file."""


def _read_json(path: Path) -> Optional[dict]:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def _token_text(value, where: str) -> Optional[str]:
    """A special-token entry: a string, an AddedToken object {"content": ...}, or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(f"{where}: expected a token string or {{\"content\": ...}}, found {value!r}")


def _eos_ids(value, where: str) -> list[int]:
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
        raise TokenizerError(f"{where}: eos_token_id must be a token id or a list of token ids, found {value!r}")
    return list(items)


def check_messages(messages, where: str = "messages") -> list[dict]:
    """A chat: a non-empty list of {"role": str, "content": ...} dicts (content may be absent only beside
    tool_calls). Returns it as a list; raises ValueError / TypeError naming the message."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"{where} must be a non-empty list of {{'role': ..., 'content': ...}} messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise TypeError(f"{where}[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise ValueError(f"{where}[{i}] has no 'role' (a string such as 'user', 'assistant', 'system')")
        if "content" not in m and "tool_calls" not in m:
            raise ValueError(f"{where}[{i}] (role {m['role']!r}) has no 'content'")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise TypeError(f"{where}[{i}]['content'] must be a string or a list of content parts, got "
                            f"{type(content).__name__}")
    return list(messages)


class Tokenizer:
    """A Hugging Face tokenizer directory: encode / decode with `tokenizers`, chat templates with Jinja.

    backend: the `tokenizers.Tokenizer`; special_tokens: the named special tokens, {"bos_token": "<s>", ...} (chat
    templates see them as variables);
    chat_templates: {name: Jinja source} ("default" is the one used); eos_token_ids: the ids that end a generation.
    """

    def __init__(self, backend: "tokenizers.Tokenizer", *, special_tokens: Optional[dict] = None,
                 chat_templates: Optional[dict] = None, generation_eos: Sequence[int] = (), path=None):
        self.backend = backend
        self.path = None if path is None else Path(path)
        self.special_tokens = dict(special_tokens or {})
        self.chat_templates = dict(chat_templates or {})
        eos = list(generation_eos)
        own = self.token_id(self.special_tokens.get("eos_token"))
        if own is not None:
            eos.append(own)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))

    def __repr__(self):
        return (f"Tokenizer({str(self.path) if self.path else '<in memory>'}, vocab={self.vocab_size}, "
                f"eos_token_ids={list(self.eos_token_ids)}, chat_template={self.has_chat_template})")

    # -- vocabulary ------------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Ids in use, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: Optional[str]) -> Optional[int]:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_token(self) -> Optional[str]:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> Optional[str]:
        return self.special_tokens.get("eos_token")

    # -- text <-> ids ----------------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; add_special_tokens: apply tokenizer.json's post-processor (e.g. a leading BOS)."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes a string, got {type(text).__name__}")
        # encode_batch releases the GIL (encode does not): a long text tokenized on a thread leaves the others running
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids` (an incomplete UTF-8 character decodes to U+FFFD)."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # -- chat ------------------------------------------------------------------------------------------------
    @property
    def has_chat_template(self) -> bool:
        return "default" in self.chat_templates

    def chat_template(self, tools=None) -> str:
        """The template used: "tool_use" when tools are given and the tokenizer has one, else "default"."""
        if tools is not None and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if "default" in self.chat_templates:
            return self.chat_templates["default"]
        where = self.path or "this tokenizer"
        if self.chat_templates:
            raise TokenizerError(f"{where}: several chat templates ({sorted(self.chat_templates)}) and none named "
                                 "'default'")
        raise TokenizerError(f"{where}: no chat template (looked for {TEMPLATE_FILE}, 'chat_template' in "
                             f"{CONFIG_FILE}, {PROCESSOR_TEMPLATE_FILE}); pass the prompt as plain text instead")

    def apply_chat_template(self, messages: Messages, add_generation_prompt: bool = True, *, tokenize: bool = True,
                            tools: Optional[list] = None, documents: Optional[list] = None,
                            **template_kwargs) -> Union[list[int], str]:
        """Render a chat with the model's template: token ids, or the string with tokenize=False.

        messages: [{"role": ..., "content": ...}, ...]; tools / documents: JSON-schema dicts passed to the
        template; template_kwargs: extra template variables (e.g. enable_thinking=False). The rendered string is
        encoded without the post-processor's special tokens (the template writes them), as transformers does."""
        messages = check_messages(messages)
        for name, items in (("tools", tools), ("documents", documents)):
            if items is not None and not (isinstance(items, (list, tuple)) and all(isinstance(x, dict) for x in items)):
                raise TypeError(f"{name} must be a list of dicts (JSON schemas / documents)")
        where = f"chat template of {self.path}" if self.path else "chat template"
        text = render_template(self.chat_template(tools), messages, add_generation_prompt=add_generation_prompt,
                               special_tokens=self.special_tokens, tools=tools, documents=documents, where=where,
                               **template_kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def render(self, prompt: Union[str, Messages], chat: Optional[bool] = None,
               chat_template_kwargs: Optional[dict] = None) -> list[int]:
        """Prompt ids for generation. prompt: a string (encoded with the tokenizer's special-token rules) or a list
        of {"role", "content"} messages (the chat template, with the generation prompt). chat: None = as given;
        True = a string becomes one user message; False = messages are refused."""
        if chat not in (None, True, False):
            raise TypeError(f"chat must be None, True or False, got {chat!r}")
        kwargs = dict(chat_template_kwargs or {})
        if isinstance(prompt, str):
            if chat:
                return self.apply_chat_template([{"role": "user", "content": prompt}], **kwargs)
            return self.encode(prompt)
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            if chat is False:
                raise ValueError("chat=False but the prompt is a list of messages (pass a string)")
            return self.apply_chat_template(prompt, **kwargs)
        if isinstance(prompt, (list, tuple)) and prompt and any(isinstance(m, dict) for m in prompt):
            check_messages(prompt)  # names the element that is not a message
        raise TypeError(f"a prompt is a string or a list of {{'role', 'content'}} messages, got "
                        f"{type(prompt).__name__}" + (" (empty)" if isinstance(prompt, (list, tuple)) else ""))


def _special_tokens(config: dict, where: Path) -> dict[str, str]:
    """Named special tokens of a config: the standard names, any other "*_token" key holding a token (a model's own,
    e.g. "image_token") and a dict under "extra_special_tokens" (transformers' rules). Null entries are left out."""
    out = {}
    for k, v in config.items():
        if k in SPECIAL_TOKEN_KEYS:
            v = _token_text(v, f"{where}: {k}")
        elif not (k.endswith("_token") and (isinstance(v, str) or (isinstance(v, dict) and "content" in v))):
            continue
        if v is not None:
            out[k] = _token_text(v, f"{where}: {k}")
    extra = config.get("extra_special_tokens")
    if isinstance(extra, dict):
        out.update({k: _token_text(v, f"{where}: extra_special_tokens.{k}") for k, v in extra.items()
                    if v is not None})
    return out


def _chat_templates(path: Path, config: dict) -> dict[str, str]:
    """Templates by name; files beat the config entry (transformers' priority)."""
    templates = {}
    if (path / TEMPLATE_FILE).is_file():
        templates["default"] = (path / TEMPLATE_FILE).read_text(encoding="utf-8")
    if (path / TEMPLATE_DIR).is_dir():
        for f in sorted((path / TEMPLATE_DIR).glob("*.jinja")):
            templates[f.name.removesuffix(".jinja")] = f.read_text(encoding="utf-8")
    if templates:
        return templates
    entry = config.get("chat_template")
    where = path / CONFIG_FILE
    if isinstance(entry, str):
        return {"default": entry}
    if isinstance(entry, list):
        for i, t in enumerate(entry):
            if not (isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)):
                raise TokenizerError(f"{where}: chat_template[{i}] must be {{\"name\": str, \"template\": str}}")
            templates[t["name"]] = t["template"]
        return templates
    if entry is not None:
        raise TokenizerError(f"{where}: chat_template must be a string or a list of named templates")
    processor = _read_json(path / PROCESSOR_TEMPLATE_FILE)
    if processor is not None:
        if not isinstance(processor.get("chat_template"), str):
            raise TokenizerError(f"{path / PROCESSOR_TEMPLATE_FILE}: expected {{\"chat_template\": str}}")
        return {"default": processor["chat_template"]}
    return {}


def _generation_eos(path: Path) -> list[int]:
    gen = _read_json(path / GENERATION_CONFIG_FILE)
    if gen is not None:
        return _eos_ids(gen.get("eos_token_id"), str(path / GENERATION_CONFIG_FILE))
    cfg = _read_json(path / "config.json") or {}
    value = cfg.get("eos_token_id", (cfg.get("text_config") or {}).get("eos_token_id"))
    return _eos_ids(value, str(path / "config.json"))


def load_tokenizer(path) -> Tokenizer:
    """Read the tokenizer of a Hugging Face model directory (see the module docstring for the files)."""
    path = Path(path)
    if not path.is_dir():
        raise TokenizerError(f"{path}: {'is a file' if path.exists() else 'no such directory'} (expected a Hugging "
                             f"Face model directory with {TOKENIZER_FILE} and {CONFIG_FILE})")
    if not (path / TOKENIZER_FILE).is_file():
        hint = (" (it has only a slow sentencepiece tokenizer: write tokenizer.json with transformers' "
                "AutoTokenizer.from_pretrained(path).save_pretrained(path))" if (path / "tokenizer.model").is_file()
                else "")
        raise TokenizerError(f"{path}: no {TOKENIZER_FILE} (looked for {TOKENIZER_FILE}, {CONFIG_FILE}, "
                             f"{SPECIAL_TOKENS_FILE}, {GENERATION_CONFIG_FILE}){hint}")
    try:
        backend = tokenizers.Tokenizer.from_file(str(path / TOKENIZER_FILE))
    except Exception as e:  # the Rust loader raises plain Exceptions
        raise TokenizerError(f"{path / TOKENIZER_FILE}: cannot be read by the tokenizers library ({e})") from None
    config = _read_json(path / CONFIG_FILE) or {}
    special = _special_tokens(config, path / CONFIG_FILE)
    legacy = _read_json(path / SPECIAL_TOKENS_FILE)
    if legacy is not None and "added_tokens_decoder" not in config:
        special.update(_special_tokens(legacy, path / SPECIAL_TOKENS_FILE))
    return Tokenizer(backend, special_tokens=special, chat_templates=_chat_templates(path, config),
                     generation_eos=_generation_eos(path), path=path)


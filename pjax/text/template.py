"""Chat templates: the Jinja environment Hugging Face chat templates are written for.

A template is rendered the way transformers renders it: a sandboxed, immutable Jinja environment with trim_blocks and
lstrip_blocks, the loop-control extension, `{% generation %}` blocks (they mark assistant text for training masks and
render their body unchanged), a `tojson` filter that keeps non-ASCII characters, and the globals `raise_exception`
and `strftime_now`. Variables: `messages`, `add_generation_prompt`, `tools`, `documents`, the special tokens
(`bos_token`, `eos_token`, ...) and any extra keyword (e.g. `enable_thinking`), extra keywords overriding the rest.
"""
from __future__ import annotations

import datetime
import functools
import json

try:
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment
except ImportError as e:  # pragma: no cover - the `text` extra is missing
    raise ImportError("pjax.text needs jinja2 for chat templates: pip install 'pjax[text]'") from e

__all__ = ["TemplateError", "compile_template", "render_template"]


class TemplateError(ValueError):
    """A chat template failed to compile or render (its own `raise_exception` included)."""


class _GenerationBlock(Extension):
    """`{% generation %} ... {% endgeneration %}`: renders its body (the marker matters for training masks only)."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=32)
def compile_template(source: str, where: str = "chat template") -> jinja2.Template:
    """Compile a chat template (cached per source); `where` names it in errors."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise TemplateError(f"{where}: Jinja syntax error at line {e.lineno}: {e.message}") from None


def render_template(source: str, messages: list, *, add_generation_prompt: bool, special_tokens: dict,
                    tools=None, documents=None, where: str = "chat template", **kwargs) -> str:
    """Render `messages` with the template `source`. special_tokens: {"bos_token": "<s>", ...}; kwargs override."""
    template = compile_template(source, where)
    variables = {**special_tokens, **kwargs}
    try:
        return template.render(messages=messages, tools=tools, documents=documents,
                               add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.exceptions.TemplateError as e:
        raise TemplateError(f"{where}: {e.message or type(e).__name__}") from None

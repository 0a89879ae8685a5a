"""Chat templates rendered as Hugging Face transformers renders them, so a checkpoint's published template gives the
prompt its authors trained on.

The environment is the one ``apply_chat_template`` compiles templates in (transformers'
``utils/chat_template_utils.py``, ``_compile_jinja_template``), re-created here with jinja2 alone (transformers is
never a runtime dependency):

- ``ImmutableSandboxedEnvironment`` (a template is untrusted code from a checkpoint folder), with
  ``trim_blocks``, ``lstrip_blocks``, the ``loopcontrols`` extension (``{% break %}``, ``{% continue %}``) and a
  ``{% generation %}...{% endgeneration %}`` tag that renders its body (transformers uses it to mark the
  assistant's tokens);
- jinja2's default ``Undefined``: a variable or attribute the context lacks (``message.tool_calls`` on a message
  without calls, ``enable_thinking`` when not given) renders as nothing and is false, as published templates
  expect; a template's trailing newline is dropped (jinja2's default, as in transformers);
- ``tojson`` without HTML escaping (``json.dumps`` with ``ensure_ascii=False``; ``indent``, ``separators`` and
  ``sort_keys`` as keywords);
- globals ``raise_exception(message)`` (a ``TemplateError``), ``strftime_now(format)`` (the local time now, read
  from ``clock``), a ``namespace`` that refuses attribute names starting with ``_``, and ``dict``.

The template is given ``messages``, ``tools``, ``documents``, ``add_generation_prompt``, the tokenizer's special
tokens (``bos_token``, ``eos_token``, ...) and the caller's extra variables (``chat_template_kwargs``); messages
lose their keys whose value is None and gain ``reasoning_content`` / ``thinking`` from whichever of the reasoning
fields they carry, as transformers passes them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# What strftime_now reads the time from (tests freeze it).
clock: Callable[[], datetime] = datetime.now

# Variables the renderer sets itself; extra variables may not replace them (``check_template_kwargs``).
RENDERER_ARGUMENTS = ("messages", "tools", "documents", "add_generation_prompt")
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
                       "additional_special_tokens")
TEMPLATE_GLOBALS = ("raise_exception", "strftime_now", "namespace", "dict")
RESERVED_NAMES = frozenset(RENDERER_ARGUMENTS + SPECIAL_TOKEN_NAMES + TEMPLATE_GLOBALS)
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def raise_exception(message: str) -> None:
    """The template's ``raise_exception(message)``: published templates call it to refuse a conversation."""
    raise jinja2.TemplateError(message)


def tojson(value: object, ensure_ascii: bool = False, indent: int | None = None,
           separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """``value | tojson``: JSON as ``json.dumps`` writes it, without jinja2's HTML escaping of ``<>&'``."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(fmt: str) -> str:
    """``strftime_now(format)``: the local time from ``clock``, formatted (Llama 3.x templates print the date)."""
    return clock().strftime(fmt)


class TemplateNamespace(jinja2.utils.Namespace):
    """``namespace(...)``, refusing attribute names that start with ``_`` (a way out of the sandbox)."""

    def __init__(*args: object, **kwargs: object) -> None:  # noqa: N805 - jinja2's Namespace takes self this way
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: object) -> None:
        TemplateNamespace._check(name)
        super().__setitem__(name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set the namespace attribute {name!r}")


class TemplateDict:
    """``dict(...)`` and ``dict.fromkeys(...)``, without the type object itself (no attribute walks from it)."""

    def __call__(self, *args: object, **kwargs: object) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: object) -> dict:
        return dict.fromkeys(*args)


class GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body (transformers marks the assistant's part with
    it to return a mask; the prompt's text is the body's)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


@lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """The compiled template (cached by its text).

    Raises:
        jinja2.TemplateSyntaxError: the text is not a valid template.
    """
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, namespace=TemplateNamespace,
                       dict=TemplateDict())
    return env.from_string(source)


def check_template_kwargs(names: object) -> None:
    """Refuse extra template variables that would replace the renderer's own (``RESERVED_NAMES``).

    Raises:
        ValueError: one sentence naming the colliding variables.
    """
    taken = sorted(set(names) & RESERVED_NAMES)
    if taken:
        raise ValueError(f"{', '.join(map(repr, taken))} cannot be set through chat_template_kwargs: the chat "
                         f"template's own variable{'s' if len(taken) > 1 else ''} (the conversation, the tools, "
                         "the generation prompt, the tokenizer's special tokens or a template function)")


def template_message(message: dict) -> dict:
    """A message as transformers gives it to the template: keys whose value is None dropped, and the reasoning
    (``reasoning_content``, ``thinking`` or ``reasoning``) under both ``reasoning_content`` and ``thinking``."""
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in REASONING_FIELDS if k in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def render_chat_template(source: str, messages: list[dict], add_generation_prompt: bool = True,
                         tools: list[dict] | None = None, special_tokens: dict[str, str] | None = None,
                         variables: dict[str, object] | None = None) -> str:
    """Render a conversation with the template text ``source`` (module docstring); ``documents`` is None.

    Args:
        messages: [{"role", "content", ...}, ...]; tools: OpenAI tool definitions or None; special_tokens:
            ``{"bos_token": "<s>", ...}``; variables: extra template variables (e.g. Qwen3's ``enable_thinking``).

    Raises:
        ValueError: a ``variables`` name that is one of the renderer's own (``check_template_kwargs``).
        jinja2.TemplateError: the template is invalid or refuses the conversation (``raise_exception``).
    """
    variables = variables or {}
    check_template_kwargs(variables)
    return compile_chat_template(source).render(
        {**(special_tokens or {}), **variables, "messages": [template_message(m) for m in messages], "tools": tools,
         "documents": None, "add_generation_prompt": add_generation_prompt})

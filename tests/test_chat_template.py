"""Chat templates render as transformers' ``apply_chat_template`` renders them (issue 28 item 3), token for token:
every tiny format folder's template and the published templates of tests/fixtures/chat_templates.py, on one-turn,
multi-turn and tool-message conversations; the environment's own rules (undefined values, ``tojson``, the
sandboxed namespace, ``raise_exception``, ``strftime_now``) and the reserved variable names."""

from __future__ import annotations

from datetime import datetime

import jinja2
import pytest

from celeris import chat_template
from celeris.tokenizer import Tokenizer
from tests.conftest import REPO_ROOT
from tests.fixtures.chat_templates import PUBLISHED, write_published
from tests.models.conftest_block_formats import write_fast_dllm, write_llada2, write_sdar
from tests.models.conftest_formats import write_dream, write_llada

FROZEN = datetime(2026, 12, 1, 9, 30)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "a city"}},
                   "required": ["city"]}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
CONVERSATIONS = {
    "one turn": ([{"role": "user", "content": "Hello, how are you?"}], None),
    "multi-turn": ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def add(a, b):"},
                    {"role": "assistant", "content": "return a + b", "reasoning_content": "sum"},
                    {"role": "user", "content": "and for x, y?"}], None),
    "tool messages": ([{"role": "user", "content": "Weather in Paris?"},
                       {"role": "assistant", "content": "", "tool_calls": [CALL]},
                       {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
                       {"role": "assistant", "content": "It is sunny."}, {"role": "user", "content": "Thanks!"}],
                      [WEATHER]),
}
TINY_WRITERS = {"llada": lambda f: write_llada(f, num_shards=1), "dream": write_dream, "sdar": write_sdar,
                "fast_dllm_v2": write_fast_dllm, "llada2": write_llada2}


@pytest.fixture
def frozen_clock(monkeypatch):
    """Both renderers read the same fixed time: transformers' ``datetime.now()`` and Celeris's ``clock``."""
    from transformers.utils import chat_template_utils

    class Frozen(datetime):
        @classmethod
        def now(cls, tz=None):  # noqa: ANN001, ANN206 - datetime's signature
            return FROZEN

    monkeypatch.setattr(chat_template_utils, "datetime", Frozen)
    monkeypatch.setattr(chat_template, "clock", lambda: FROZEN)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    """name -> tokenizer folder: the tiny format folders, the embedded model and one per published template."""
    base = tmp_path_factory.mktemp("templates")
    out = {"celeris": REPO_ROOT / "celeris" / "checkpoints" / "celeris-code-6m"}
    for name, write in TINY_WRITERS.items():
        write(base / name)
        out[name] = base / name
    for name in PUBLISHED:
        out[name] = write_published(base / name, name)
    return out


def kwargs_for(name: str) -> list[dict]:
    """Extra template variables to try: Qwen3's thinking switch, Llama 3's tools placement."""
    if name in ("qwen3", "sdar"):
        return [{}, {"enable_thinking": False}]
    if name.startswith("llama3."):
        return [{}, {"tools_in_user_message": False}]
    return [{}]


@pytest.mark.parametrize("name", ["celeris", *TINY_WRITERS, *PUBLISHED])
def test_render_equals_transformers_token_for_token(folders, name, frozen_clock):
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(folders[name])
    # the folder's tokenizer.json, template and special tokens (as tokenizer_config.json gives them) in transformers
    hf = PreTrainedTokenizerFast(tokenizer_file=str(folders[name] / "tokenizer.json"), chat_template=tok.chat_template,
                                 **tok.special_tokens)
    cases = [(label, prompt, kwargs) for label in CONVERSATIONS for kwargs in kwargs_for(name)
             for prompt in ((True, False) if label == "multi-turn" else (True,))]
    for label, prompt, kwargs in cases:
        messages, tools = CONVERSATIONS[label]
        want = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=prompt, tokenize=True,
                                      return_dict=False, **kwargs)
        got = tok.encode_chat(messages, prompt, tools, **kwargs)
        if got != want:  # show the texts
            assert tok.apply_chat_template(messages, prompt, tools, **kwargs) == hf.decode(want), (label, kwargs)
        assert got == want, (label, prompt, kwargs)


def test_llama_3_2_prints_the_frozen_date(folders, frozen_clock):
    text = Tokenizer(folders["llama3.2"]).apply_chat_template(CONVERSATIONS["one turn"][0])
    assert "Today Date: 01 Dec 2026\n" in text


def test_environment_follows_transformers():
    render = chat_template.render_chat_template
    msgs = [{"role": "user", "content": "<b>&'x'</b>", "name": None}]
    # undefined attributes are empty and false; None-valued keys are dropped; tojson does not escape HTML
    source = "{{ messages[0].tool_calls }}|{{ messages[0].name is defined }}|{{ messages[0] | tojson }}|" \
             "{{ {'b': 1, 'a': [1, 2]} | tojson(indent=1, sort_keys=True) }}"
    assert render(source, msgs) == '|False|{"role": "user", "content": "<b>&\'x\'</b>"}|{\n "a": [\n  1,\n  2\n ' \
                                   '],\n "b": 1\n}'
    assert render("{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}{% endfor %}\n", msgs) == ""
    assert render("{% generation %}{{ messages[0].role }}{% endgeneration %}", msgs) == "user"
    assert render("{% set ns = namespace(n=1) %}{% set ns.n = ns.n + 1 %}{{ ns.n }}{{ dict(a=1) }}", msgs) == \
        "2{'a': 1}"
    with pytest.raises(jinja2.TemplateError, match="roles must alternate"):
        render("{{ raise_exception('roles must alternate') }}", msgs)
    with pytest.raises(jinja2.exceptions.SecurityError):
        render("{% set ns = namespace(_x=1) %}", msgs)
    with pytest.raises(jinja2.exceptions.SecurityError):
        render("{{ ''.__class__.__mro__ }}{{ messages.append(1) }}", msgs)


def test_template_kwargs_cannot_replace_the_renderers_variables():
    """(``messages``, ``tools`` and ``add_generation_prompt`` are encode_chat's own arguments: Python refuses them
    twice; over HTTP every reserved name is a 400, tests/serve/test_tools.py.)"""
    tok = Tokenizer(REPO_ROOT / "celeris" / "checkpoints" / "celeris-code-6m")
    for key in ("documents", "bos_token", "eos_token", "raise_exception", "strftime_now"):
        with pytest.raises(ValueError, match=f"'{key}' cannot be set through chat_template_kwargs"):
            tok.encode_chat([{"role": "user", "content": "hi"}], **{key: []})

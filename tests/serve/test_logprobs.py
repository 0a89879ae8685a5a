"""logprobs, top_logprobs and echo through the official openai client: OpenAI's shapes, streamed and not (the
streamed pieces equal the full answer's), the values equal ``LLM.generate``'s and the prompt's scoring, on the
shipped autoregressive twin; a diffusion model returns its committed tokens' values."""

from __future__ import annotations

import openai
import pytest

from celeris.llm import LLM
from celeris.sampling.logprobs import prompt_entries
from celeris.serve.app import BackgroundServer, create_app
from celeris.serve.serving import OpenAIServing
from tests.serve.conftest import MODEL_NAME

PROMPT = "def add(a, b):\n"
CHAT = [{"role": "user", "content": "a stack class"}]


@pytest.fixture(scope="module")
def ar():
    serving = OpenAIServing.from_model("celeris-code-6m-ar", device="cpu", max_num_seqs=4, max_waiting=8)
    with BackgroundServer(create_app(serving)) as srv:
        yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60), serving


def test_chat_logprobs_streamed_and_not(ar):
    client, serving = ar
    done = client.chat.completions.create(model=serving.model_name, messages=CHAT, max_tokens=8, logprobs=True,
                                          top_logprobs=3)
    content = done.choices[0].logprobs.content
    assert len(content) == done.usage.completion_tokens == 8
    assert "".join(t.token for t in content) == done.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
        values = [a.logprob for a in t.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert bytes(t.bytes).decode() == t.token
    stream = client.chat.completions.create(model=serving.model_name, messages=CHAT, max_tokens=8, logprobs=True,
                                            top_logprobs=3, stream=True)
    streamed = [t for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    plain = client.chat.completions.create(model=serving.model_name, messages=CHAT, max_tokens=8)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == done.choices[0].message.content
    none = client.chat.completions.create(model=serving.model_name, messages=CHAT, max_tokens=2, logprobs=True)
    assert all(t.top_logprobs == [] for t in none.choices[0].logprobs.content)


def test_completion_logprobs_equal_llm_generate(ar):
    client, serving = ar
    done = client.completions.create(model=serving.model_name, prompt=PROMPT, max_tokens=6, logprobs=2)
    lp = done.choices[0].logprobs
    llm = LLM("celeris-code-6m-ar", device="cpu")  # the server's engine has one caller: its loop
    out = llm.generate([PROMPT], llm.default_params(max_tokens=6, logprobs=2))[0]
    assert lp.token_logprobs == pytest.approx([e.logprob for e in out.logprobs], abs=1e-6)
    assert "".join(lp.tokens) == done.choices[0].text == out.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(len(top) <= 3 and lp.tokens[i] in top for i, top in enumerate(lp.top_logprobs))
    stream = client.completions.create(model=serving.model_name, prompt=PROMPT, max_tokens=6, logprobs=2, stream=True)
    chunks = [c.choices[0].logprobs for c in stream if c.choices and c.choices[0].logprobs]
    assert [v for c in chunks for v in c.token_logprobs] == lp.token_logprobs
    assert [o for c in chunks for o in c.text_offset] == lp.text_offset


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_echo_scores_the_prompt(ar, max_tokens):
    """lm-evaluation-harness's loglikelihood request: token ids, echo, logprobs 1, max_tokens 1 (or 0)."""
    client, serving = ar
    ids = serving.tokenizer.encode(PROMPT)
    r = client.completions.create(model=serving.model_name, prompt=ids, max_tokens=max_tokens, logprobs=1, echo=True,
                                  temperature=0, seed=1234)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + max_tokens and r.choices[0].text.startswith(PROMPT)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [e.logprob for e in prompt_entries(serving.llm.model, ids, 1)[1:]]
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx(want, abs=1e-5)
    assert r.usage.completion_tokens == max_tokens and r.usage.prompt_tokens == len(ids)
    stream = client.completions.create(model=serving.model_name, prompt=ids, max_tokens=max_tokens, logprobs=1,
                                       echo=True, stream=True)
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.text for c in chunks) == r.choices[0].text
    assert [v for c in chunks if c.logprobs for v in c.logprobs.token_logprobs] == lp.token_logprobs
    echoed = client.completions.create(model=serving.model_name, prompt=PROMPT, max_tokens=0, echo=True)
    assert echoed.choices[0].text == PROMPT and echoed.choices[0].logprobs is None


def test_diffusion_model_returns_committed_tokens_values(client):
    done = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=8, logprobs=True,
                                          top_logprobs=2, seed=0)
    content = done.choices[0].logprobs.content
    assert len(content) == done.usage.completion_tokens and all(t.logprob <= 0 for t in content)
    assert all(len(t.top_logprobs) == 2 for t in content)
    comp = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, logprobs=0, seed=0)
    assert len(comp.choices[0].logprobs.token_logprobs) == comp.usage.completion_tokens


def test_an_end_token_keeps_its_logprob_in_completions(ar):
    """The answer's end id is no text, but completions' logprobs keep its entry, as vLLM's do: lm-evaluation-harness
    reads ``token_logprobs[ctxlen:-1]``, so a max_tokens-1 answer ended at once must still add one entry."""
    client, serving = ar
    ids = serving.tokenizer.encode(PROMPT)
    first = client.completions.create(model=serving.model_name, prompt=ids, max_tokens=1, logprobs=0, echo=True)
    end_id = serving.tokenizer.encode(first.choices[0].text[len(PROMPT):], add_special_tokens=False)[0]
    ended = client.completions.create(model=serving.model_name, prompt=ids, max_tokens=1, logprobs=0, echo=True,
                                      extra_body={"stop_token_ids": [end_id]})
    lp = ended.choices[0].logprobs
    assert ended.choices[0].text == PROMPT and ended.choices[0].finish_reason == "stop"
    assert len(lp.token_logprobs) == len(ids) + 1 == len(first.choices[0].logprobs.token_logprobs)
    assert lp.token_logprobs == first.choices[0].logprobs.token_logprobs

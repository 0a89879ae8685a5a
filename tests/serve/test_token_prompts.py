"""Token-id prompts on /v1/completions (OpenAI's and vLLM's ``list[int]`` / ``list[list[int]]``): the same answer as
the text they encode, checked against the vocabulary and the context window (400 naming the id or the length)."""

from __future__ import annotations

import openai
import pytest

from tests.serve.conftest import CONTEXT, MODEL_NAME


def test_token_id_prompt_gives_the_text_prompts_answer(client, server):
    text = "def fibonacci(n):"
    ids = server.serving.tokenizer.encode(text)
    by_text = client.completions.create(model=MODEL_NAME, prompt=text, max_tokens=8, seed=1)
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=8, seed=1)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == by_text.usage.prompt_tokens == len(ids)
    other = server.serving.tokenizer.encode("class Stack:")
    both = client.completions.create(model=MODEL_NAME, prompt=[ids, other], max_tokens=8, seed=1)
    assert [c.index for c in both.choices] == [0, 1]
    assert both.choices[0].text == by_text.choices[0].text


def test_bad_token_id_prompts_are_400s(client, server):
    vocab = server.serving.tokenizer.vocab_size
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL_NAME, prompt=[3, vocab + 7], max_tokens=4)
    assert bad.value.body["param"] == "prompt" and str(vocab + 7) in bad.value.body["message"]
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL_NAME, prompt=[[3], [-1]], max_tokens=4)
    assert bad.value.body["param"] == "prompt[1]"
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model=MODEL_NAME, prompt=[3] * CONTEXT, max_tokens=4)
    assert long.value.body["code"] == "context_length_exceeded" and str(CONTEXT) in long.value.body["message"]
    for prompt in ([], [[]], [1, "a"], [[1], "a"]):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4)

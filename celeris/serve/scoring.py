"""Log-probabilities through the OpenAI API: the request checks, the ``SamplingParams`` they become, and the OpenAI
shapes of the engine's entries (``celeris.sampling.logprobs.TokenLogprob``).

- chat: ``logprobs: true`` with ``top_logprobs`` 0..20 -> ``choice.logprobs.content[i]`` = ``{token, logprob, bytes,
  top_logprobs: [{token, logprob, bytes}, ...]}``;
- completions: ``logprobs`` 0..20 -> ``choice.logprobs`` = ``{tokens, token_logprobs, top_logprobs, text_offset}``
  (each ``top_logprobs`` dict also holds the returned token, as vLLM's; so it may have one entry more than asked);
  with ``echo`` the prompt comes first in the text and, scored, in the logprobs (its first token's value is null).
  ``echo`` with ``max_tokens`` 0 returns the scored prompt only (what lm-evaluation-harness's loglikelihood asks
  with ``max_tokens`` 1). A prompt is scored only by a causal (autoregressive or hybrid) model: a diffusion model
  has no left-to-right likelihood, so ``echo`` with ``logprobs`` on one is a 400 naming ``echo``.

What the values mean per decoding mode (raw or processed, next-token, verified, diffusion, block):
``celeris.sampling.logprobs``.
"""

from __future__ import annotations

from collections.abc import Callable

from celeris.sampling.logprobs import TokenLogprob
from celeris.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    ChoiceLogprobs,
    CompletionLogprobs,
    CompletionRequest,
    SamplingRequest,
    TokenLogprobOut,
    TopLogprob,
)

Piece = Callable[[int], str]  # one token's text alone


def check_scoring(request: SamplingRequest, is_causal: bool) -> None:
    """Refuse what the log-probability fields cannot mean for ``request`` (400 naming the field)."""
    if isinstance(request, ChatCompletionRequest):
        if request.top_logprobs and not request.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        asked = bool(request.logprobs)
    else:
        asked = request.logprobs is not None
        if request.max_tokens == 0 and not request.echo:
            raise APIError(400, "max_tokens must be >= 1 (0 only with echo: true, which returns the prompt alone)",
                           param="max_tokens")
        if request.echo and request.suffix:
            raise APIError(400, "echo cannot be used with a suffix to infill", param="echo")
        if request.echo and asked and not is_causal:
            raise APIError(400, "echo with logprobs scores the prompt left to right, which needs a causal "
                                "(autoregressive or hybrid) model; this one is a diffusion model, which has no "
                                "left-to-right likelihood of its prompt", param="echo")
    if asked and request.stream_mode == "denoise":
        raise APIError(400, "logprobs are not sent with stream_mode 'denoise'", param="logprobs")


def scoring_settings(request: SamplingRequest) -> dict[str, int | None]:
    """The ``SamplingParams`` keywords ``logprobs`` and ``prompt_logprobs`` of a checked request."""
    if isinstance(request, ChatCompletionRequest):
        return {"logprobs": (request.top_logprobs or 0) if request.logprobs else None, "prompt_logprobs": None}
    k = request.logprobs
    return {"logprobs": k, "prompt_logprobs": k if request.echo and k is not None else None}


def _top(entry: TokenLogprob, piece: Piece) -> list[TopLogprob]:
    return [TopLogprob(token=(t := piece(i)), logprob=lp, bytes=list(t.encode())) for i, lp in entry.top]


def chat_logprobs(entries: list[TokenLogprob | None], piece: Piece) -> ChoiceLogprobs:
    """``choice.logprobs`` of a chat answer (or of a stream chunk's tokens)."""
    content = []
    for e in entries:
        if e is None:
            continue
        text = piece(e.token_id)
        content.append(TokenLogprobOut(token=text, logprob=e.logprob, bytes=list(text.encode()),
                                       top_logprobs=_top(e, piece)))
    return ChoiceLogprobs(content=content)


def completion_logprobs(token_ids: list[int], entries: list[TokenLogprob | None], piece: Piece,
                        offset: int = 0) -> CompletionLogprobs:
    """OpenAI's legacy ``logprobs`` object for ``token_ids`` (with their entries, None where a token has no value:
    an echoed prompt's first); ``offset``: the character offset of the first token in the choice's text."""
    out = CompletionLogprobs()
    for t, e in zip(token_ids, entries, strict=True):
        text = piece(t)
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        if e is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(e.logprob)
        out.top_logprobs.append({piece(i): lp for i, lp in e.top} | {text: e.logprob})
    return out


def choice_logprobs(request: CompletionRequest, prompt_ids: list[int] | None,
                    prompt_entries: list[TokenLogprob | None] | None, answer: list[TokenLogprob | None], piece: Piece,
                    echo: str = "", offset: int = 0) -> CompletionLogprobs | None:
    """A completion choice's ``logprobs`` (None when the request did not ask): the echoed prompt's tokens
    (``prompt_ids``, None when not echoed here; scored by ``prompt_entries``, else without values) then the answer's;
    ``offset``: the characters of the choice's text before them; ``echo``: the prompt's text (its tokens' offsets
    stay inside it: a piece decoded alone, a special token's say, may be longer than what it adds to the text)."""
    if request.logprobs is None:
        return None
    ids, entries = [], []
    if prompt_ids is not None:
        ids += prompt_ids
        entries += prompt_entries or [None] * len(prompt_ids)
    ids += [e.token_id if e is not None else 0 for e in answer]
    entries += answer
    out = completion_logprobs(ids, entries, piece, offset)
    if prompt_ids is not None:
        out.text_offset[: len(prompt_ids)] = [min(o, offset + len(echo)) for o in out.text_offset[: len(prompt_ids)]]
    return out


def echo_text(prompt: str | list[int], decode: Callable[[list[int]], str]) -> str:
    """The text an ``echo`` puts before the answer: the prompt as sent (token ids decoded)."""
    return prompt if isinstance(prompt, str) else decode(prompt)


def wants_logprobs(request: SamplingRequest) -> bool:
    """Whether the answer's tokens carry log-probabilities."""
    return bool(request.logprobs) if isinstance(request, ChatCompletionRequest) else (
        isinstance(request, CompletionRequest) and request.logprobs is not None)

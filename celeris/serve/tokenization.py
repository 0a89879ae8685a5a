"""vLLM's tokenizer routes: ``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info``.

The request and response shapes are vLLM's (``vllm/entrypoints/openai/serving_tokenization.py``, read, not
copied), so a client written for vLLM (lm-evaluation-harness's ``local-completions`` with no local tokenizer)
uses the server's tokenizer through them:

- ``POST /tokenize`` ``{"prompt": str, "add_special_tokens": true}`` or ``{"messages": [...],
  "add_generation_prompt": true, "add_special_tokens": false, "chat_template_kwargs": {...}, "tools": [...]}`` ->
  ``{"count", "max_model_len", "tokens"}`` (and ``token_strs`` with ``return_token_strs``). The prompt is encoded
  exactly as ``/v1/completions`` encodes it, the messages as ``/v1/chat/completions`` renders them.
- ``POST /detokenize`` ``{"tokens": [int]}`` -> ``{"prompt": str}`` (special tokens kept, as vLLM); an id outside
  the vocabulary is a 400 naming it.
- ``GET /tokenizer_info`` -> ``{"tokenizer_class", "eos_token", "bos_token", "pad_token", "chat_template",
  "model_max_length", "vocab_size", ...}``.

Every route takes an optional ``model`` (the served name; 404 otherwise, as the completions routes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

from pydantic import AfterValidator, BaseModel, Field

from celeris.serve.errors import check_token_ids
from celeris.serve.protocol import APIError, ChatMessage, StrictModel, ToolDefinition, _template_kwargs

if TYPE_CHECKING:
    from celeris.serve.serving import OpenAIServing

MAX_TOKENS_IN = 1 << 20  # most ids one /detokenize body may carry (the body limit bounds it first)


class TokenizeCompletionRequest(StrictModel):
    """``POST /tokenize`` with a text prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(StrictModel):
    """``POST /tokenize`` with a conversation, rendered by the chat template as chat completions render it."""

    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    tools: Annotated[list[ToolDefinition], Field(max_length=128)] | None = None
    chat_template_kwargs: Annotated[dict[str, Any] | None, AfterValidator(_template_kwargs)] = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: Annotated[list[int], Field(max_length=MAX_TOKENS_IN)]


class DetokenizeResponse(BaseModel):
    prompt: str


def tokenize_request_model(body: object) -> type[StrictModel]:
    """The request model a ``/tokenize`` body is parsed as: the chat form when it has ``messages``."""
    return TokenizeChatRequest if isinstance(body, dict) and "messages" in body else TokenizeCompletionRequest


def tokenize(serving: OpenAIServing, request: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
    """The ids of a prompt or conversation under ``serving``'s tokenizer (module docstring).

    Raises:
        APIError: 404 for another model's name; 400 when the chat template refuses the messages.
    """
    from celeris.serve.tools import template_messages

    serving.check_model_name(request.model)
    tok = serving.tokenizer
    if isinstance(request, TokenizeCompletionRequest):
        ids = tok.encode(request.prompt, add_special_tokens=request.add_special_tokens)
    else:
        messages, tools = template_messages(request, tok.chat_template)
        try:
            ids = tok.encode_chat(messages, add_generation_prompt=request.add_generation_prompt, tools=tools,
                                  **(request.chat_template_kwargs or {}))
        except Exception as exc:  # jinja2 raises TemplateError (or anything a template raises)
            raise APIError(400, f"the chat template could not render these messages: {exc}", param="messages") from None
        if request.add_special_tokens and tok.bos_token_id is not None and ids[:1] != [tok.bos_token_id]:
            ids = [tok.bos_token_id, *ids]
    strs = [tok.decode([i], skip_special_tokens=False) for i in ids] if request.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=serving.context_length, tokens=ids, token_strs=strs)


def detokenize(serving: OpenAIServing, request: DetokenizeRequest) -> DetokenizeResponse:
    """The text of ``request.tokens`` (special tokens kept).

    Raises:
        APIError: 404 for another model's name; 400 for an id outside the vocabulary.
    """
    serving.check_model_name(request.model)
    check_token_ids(request.tokens, serving.tokenizer.vocab_size, "tokens")
    return DetokenizeResponse(prompt=serving.tokenizer.decode(request.tokens, skip_special_tokens=False))


def tokenizer_info(serving: OpenAIServing) -> dict:
    """``GET /tokenizer_info``: the tokenizer's class, special tokens, chat template and limits."""
    tok = serving.tokenizer
    special = dict(tok.special_tokens)

    def token(name: str, token_id: int | None) -> str | None:
        if special.get(name) is not None:
            return special[name]
        return tok.decode([token_id], skip_special_tokens=False) if token_id is not None else None

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "eos_token": token("eos_token", tok.eos_token_id),
        "bos_token": token("bos_token", tok.bos_token_id),
        "pad_token": token("pad_token", tok.pad_token_id),
        "eos_token_id": tok.eos_token_id,
        "bos_token_id": tok.bos_token_id,
        "pad_token_id": tok.pad_token_id,
        "chat_template": tok.chat_template,
        "model_max_length": serving.context_length,
        "vocab_size": tok.vocab_size,
        "add_bos_token": tok.add_bos_token,
        "add_eos_token": tok.add_eos_token,
    }

"""OpenAI's Responses API on ``celeris serve``: ``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``.

A Responses request is translated into the chat completion request the chat route takes and run by the same
serving layer, so limits, errors, metrics, structured output and tool calls are the chat route's; the answer
(or its stream, as OpenAI's typed events) is translated back. Layout: ``protocol`` (the request, the response,
the events, and the refusals), ``convert`` (request -> chat request, chat answer -> output items), ``stream``
(chat chunks -> events), ``store`` (the bounded in-memory store), ``serving`` (``ResponsesServing``), ``routes``.
See docs/responses-api.md.
"""

from celeris.serve.responses.serving import ResponsesServing
from celeris.serve.responses.store import ResponseStore

__all__ = ["ResponseStore", "ResponsesServing"]

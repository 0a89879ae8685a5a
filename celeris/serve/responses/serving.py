"""The Responses serving layer: a Responses request is translated into the chat completion request the chat
route takes and run by the same serving layer (``OpenAIServing`` or ``ModelRouter``: one request path), and the
answer (or its stream) is translated back; finished responses are kept in a ``ResponseStore``.

    responses = ResponsesServing(serving)                      # serving: OpenAIServing | ModelRouter
    response = await responses.create(request)                 # a ResponseObject, or an async iterator of events
    responses.retrieve(response.id)
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from celeris.serve.protocol import APIError, ChatCompletionRequest, parse_request
from celeris.serve.responses.convert import (
    Item,
    as_input_items,
    base_response,
    chat_body,
    input_items,
    response_from_chat,
    responses_error,
)
from celeris.serve.responses.protocol import ResponseObject, ResponsesRequest, StreamEvent
from celeris.serve.responses.store import ResponseStore
from celeris.serve.responses.stream import response_events
from celeris.serve.serving import IsDisconnected


class ResponsesServing:
    """``POST /v1/responses`` and ``GET /v1/responses/{id}`` over a chat-capable serving layer.

    Args:
        serving: an ``OpenAIServing`` or a ``ModelRouter`` (anything with ``create_chat_completion`` and
            ``model_name``).
        store: where finished responses with ``store: true`` are kept (a fresh ``ResponseStore`` when None).
    """

    def __init__(self, serving, store: ResponseStore | None = None) -> None:
        self.serving = serving
        self.store = store if store is not None else ResponseStore()  # an empty store is falsy (len 0)

    def conversation(self, request: ResponsesRequest) -> list[Item]:
        """The conversation the answer continues: the stored one of ``previous_response_id``, then ``input``.

        Raises:
            APIError: 404 ``response_not_found`` for an unknown or expired ``previous_response_id``.
        """
        before = [] if request.previous_response_id is None else \
            self.store.get(request.previous_response_id, "previous_response_id").conversation
        return [*before, *input_items(request)]

    async def create(self, request: ResponsesRequest, is_disconnected: IsDisconnected | None = None
                     ) -> ResponseObject | AsyncIterator[StreamEvent]:
        """Run ``request``: the finished response, or (``stream: true``) its events.

        Admission and validation happen before this returns (400, 404, 429 with a status code); failures of a
        stream after that are its ``error`` event.

        Raises:
            APIError: the chat path's refusals, naming the Responses fields (``convert.responses_error``).
        """
        items = self.conversation(request)
        chat = parse_request(ChatCompletionRequest, json.dumps(chat_body(request, items)))
        response = base_response(request, request.model or self.serving.model_name)
        try:
            result = await self.serving.create_chat_completion(chat, is_disconnected)
        except APIError as exc:
            raise responses_error(exc) from None
        if request.stream:
            return response_events(result, response, lambda final: self._keep(request, items, final))
        final = response_from_chat(response, result)
        self._keep(request, items, final)
        return final

    def retrieve(self, response_id: str) -> ResponseObject:
        """``GET /v1/responses/{id}``.

        Raises:
            APIError: 404 ``response_not_found`` (never stored, dropped or expired).
        """
        return self.store.get(response_id).response

    def delete(self, response_id: str) -> dict:
        """``DELETE /v1/responses/{id}``: OpenAI's deletion object.

        Raises:
            APIError: 404 ``response_not_found``.
        """
        self.store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    def _keep(self, request: ResponsesRequest, items: list[Item], final: ResponseObject) -> None:
        if request.store is not False:
            self.store.put(final, [*items, *as_input_items(final.output)])

"""Thin routes of the Responses API (mounted under ``/v1``, behind the same API key check as every ``/v1``
route): parse the body, call ``ResponsesServing``, answer JSON or server-sent events (``event: <type>`` and
``data: <event>`` per event, as OpenAI sends them; no ``[DONE]``)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from celeris.serve.protocol import APIError, parse_json_body, parse_request
from celeris.serve.responses.protocol import ErrorEvent, ResponsesRequest, StreamEvent, refusal
from celeris.serve.responses.serving import ResponsesServing
from celeris.serve.serving import ClientDisconnected

logger = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
ReadBody = Callable[[Request], Awaitable[bytes]]


def parse_responses_request(raw: bytes | str) -> ResponsesRequest:
    """A raw body as a ``ResponsesRequest``: first the refusals with a reason of their own (``refusal``), then
    the strict model.

    Raises:
        APIError: 400 naming the field (``unsupported_parameter`` for a refused one).
    """
    body = parse_json_body(raw)
    found = refusal(body)
    if found is not None:
        param, reason = found
        raise APIError(400, reason, param=param, code="unsupported_parameter")
    return parse_request(ResponsesRequest, raw)


async def sse(events: AsyncIterator[StreamEvent]) -> AsyncIterator[str]:
    """Server-sent events of a Responses stream; an unexpected failure still ends it with an ``error`` event."""
    try:
        async with aclosing(events):
            async for event in events:
                yield f"event: {event.type}\ndata: {event.model_dump_json()}\n\n"
    except ClientDisconnected:
        return
    except Exception as exc:
        logger.exception("responses stream failed")
        event = ErrorEvent(code="server_error", message=f"internal error: {type(exc).__name__}")
        yield f"event: error\ndata: {event.model_dump_json()}\n\n"


def responses_router(responses: ResponsesServing, read_body: ReadBody) -> APIRouter:
    """``POST /responses``, ``GET /responses/{response_id}`` and ``DELETE /responses/{response_id}`` (to include
    under the ``/v1`` router); ``read_body`` reads a JSON body (415 for another content type)."""
    router = APIRouter()

    @router.post("/responses")
    async def create_response(request: Request) -> Response:
        body = parse_responses_request(await read_body(request))
        result = await responses.create(body, request.is_disconnected)
        if isinstance(result, BaseModel):
            return Response(result.model_dump_json(), media_type="application/json")
        return StreamingResponse(sse(result), media_type="text/event-stream", headers=SSE_HEADERS)

    @router.get("/responses/{response_id}")
    async def retrieve_response(response_id: str) -> Response:
        return Response(responses.retrieve(response_id).model_dump_json(), media_type="application/json")

    @router.delete("/responses/{response_id}")
    async def delete_response(response_id: str) -> Response:
        return Response(json.dumps(responses.delete(response_id)), media_type="application/json")

    return router

"""Errors of the OpenAI-compatible API, and the parsing of a raw JSON body into a request model.

Every failure is an ``APIError`` (an HTTP status, one sentence naming the parameter, OpenAI's error type and a
machine-readable code), rendered in the one shape ``ErrorResponse``: ``{"error": {message, type, param, code}}``.
A body that is not JSON, or a request model's validation error, becomes a 400 naming the parameter.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import TypeVar

from pydantic import BaseModel, ValidationError


class APIError(Exception):
    """A failure with an HTTP status, raised by the serving layer and rendered as an ErrorResponse.

    Attributes:
        status_code: HTTP status (400 client mistake, 401, 404, 415, 429, 500, 503, 504).
        message: one sentence a user understands, naming the parameter and the numbers involved.
        type: OpenAI error type (``invalid_request_error``, ``rate_limit_error``, ...).
        param: the request parameter at fault, if any.
        code: machine-readable code (``context_length_exceeded``, ``model_not_found``, ...).
        headers: extra response headers (``Retry-After`` on 429).
    """

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str | None = None,  # noqa: A002 - the OpenAI field name
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type or error_type(status_code)
        self.param = param
        self.code = code
        self.headers = headers or {}

    def response(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))


def error_type(status_code: int) -> str:
    """The OpenAI ``error.type`` for an HTTP status."""
    return {
        401: "authentication_error",
        404: "not_found_error",
        429: "rate_limit_error",
        504: "timeout_error",
    }.get(status_code, "invalid_request_error" if status_code < 500 else "server_error")


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The one error shape every failure is returned in: ``{"error": {message, type, param, code}}``."""

    error: ErrorInfo


# ---------------------------------------------------------------------------------------------
# Parsing: raw JSON body -> request model, or a 400 naming the parameter


def validation_error(exc: ValidationError) -> APIError:
    """A pydantic ValidationError as a 400 naming the parameter."""
    return errors_to_api_error(exc.errors())


# Parts of a pydantic error location that are not parameter names: FastAPI's "body" and union member tags.
_NOT_PARAMS = {"body", "str", "int", "float", "bool", "list", "dict", "none"}


def errors_to_api_error(errors: list | tuple) -> APIError:
    """The first of pydantic's ``errors()`` as a 400 naming the parameter (``messages[0].content``)."""
    err = errors[0] if errors else {}
    loc = [p for p in err.get("loc", ()) if isinstance(p, int) or (p.isidentifier() and p not in _NOT_PARAMS)]
    param = None
    if loc:
        param = str(loc[0])
        for p in loc[1:]:
            param += f"[{p}]" if isinstance(p, int) else f".{p}"
    kind, msg = err.get("type", ""), err.get("msg", "invalid value")
    if kind == "extra_forbidden":
        message = f"unrecognized request argument supplied: {param}"
    elif kind == "missing":
        message = f"missing required parameter: '{param}'"
    elif kind == "json_invalid":
        message = f"the request body is not valid JSON: {msg}"
    elif param:
        message = f"invalid value for '{param}': {msg}"
    else:
        message = msg
    code = {"missing": "missing_required_parameter", "json_invalid": "invalid_json"}.get(kind, "invalid_value")
    return APIError(400, message, param=param, code=code)


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON value; send a finite number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400 parses to inf
        raise ValueError(f"the number {text[:32]} is too large for a 64-bit float")
    return value


def parse_json_body(raw: bytes | str) -> dict:
    """The request body as a JSON object, or a 400 saying what is wrong with it.

    Refuses what Python's parser would otherwise accept but JSON (RFC 8259) does not: the literals
    ``NaN``, ``Infinity`` and ``-Infinity`` and numbers beyond a float's range; and what it cannot
    hold: integers of more than 4,300 digits, nesting deep enough to exhaust the recursion limit.

    Raises:
        APIError: 400 with code ``invalid_json``.
    """
    try:
        body = json.loads(raw, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise APIError(400, "the request body is not valid JSON: it is nested too deeply", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError, too many digits, NaN/Infinity
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    return body


M = TypeVar("M", bound=BaseModel)


def parse_request(model: type[M], raw: bytes | str) -> M:
    """Validate a raw JSON body against a request model (strict JSON mode); 400 on any mistake."""
    parse_json_body(raw)
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise validation_error(exc) from None


def parameter_error(exc: Exception, known: Iterable[str], aliases: dict[str, str] | None = None) -> APIError:
    """A refusal of a request's settings as a 400 naming the parameter: ``SamplingParams``, ``LLM.check`` and
    ``Engine.add_request`` start each message with the parameter at fault ("steps must be >= 1",
    "top_k=3 ..."). ``aliases`` renames one that is not a request field to the field it comes from
    (``grammar`` -> ``response_format``); a first word that is not in ``known`` (the request's fields) after
    that is no parameter ("the prompt ..."), and the 400 names none."""
    param = str(exc).split(" ", 1)[0].split("=", 1)[0]
    param = (aliases or {}).get(param, param)
    return APIError(400, str(exc), param=param if param in set(known) else None)


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    """Raise a 400 naming ``param`` and the first id outside ``[0, vocab_size)``."""
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise APIError(400, f"token id {t} at {param}[{i}] is outside the vocabulary [0, {vocab_size})",
                           param=param, code="invalid_token_id")

"""iop's errors in Anthropic's shape: `{"type": "error", "error": {"type", "message"}, "request_id"}`.

The HTTP status stays iop's own (a client retries by status: 429, and 5xx incl. 503 and 529);
the error `type` is Anthropic's name for that status, so an Anthropic SDK raises the class it
would raise against Anthropic.
"""

from __future__ import annotations

from typing import Any

import msgspec

from iop import errors
from iop.errors import ErrorResponse, RequestError

_encode = msgspec.json.Encoder().encode

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status (any other 4xx: invalid request; any other 5xx: api_error)."""
    if status in _TYPES:
        return _TYPES[status]
    return "invalid_request_error" if 400 <= status < 500 else "api_error"


def error_body(exc: RequestError, request_id: str | None = None) -> dict[str, Any]:
    """The JSON body of an error answer to a Messages client."""
    body: dict[str, Any] = {"type": "error", "error": {"type": error_type(exc.status), "message": exc.message}}
    if request_id is not None:
        body["request_id"] = request_id
    return body


def error_response(exc: RequestError, request_id: str | None = None) -> ErrorResponse:
    """The HTTP error answer to a Messages client: iop's status and headers, Anthropic's body."""
    return ErrorResponse(exc.status, exc.headers, _encode(error_body(exc, request_id)))


def error_event(exc: RequestError) -> bytes:
    """The `error` event ending a Messages stream that already started."""
    event = {"type": "error", "error": {"type": error_type(exc.status), "message": exc.message}}
    return b"event: error\ndata: " + _encode(event) + b"\n\n"


def is_messages_path(path: str) -> bool:
    """`/v1/messages` and the paths under it: where Anthropic's clients call, and read Anthropic's errors."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def refusal(path: str, exc: RequestError, request_id: str | None = None) -> ErrorResponse:
    """A refusal made before any endpoint runs (Host, Origin, request id), in the shape of the API at `path`."""
    return error_response(exc, request_id) if is_messages_path(path) else errors.error_response(exc)

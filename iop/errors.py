"""The one exception tree of iop; each error knows how it reaches an HTTP client.

    IopError
    ├── ConfigError            the deployment file is invalid (carries every problem)
    ├── BusError               NATS unreachable, embedded server failed to start
    └── RequestError           a client request that fails; status + OpenAI error type/code
        ├── BadRequest         400 invalid_request_error
        ├── Unauthorized       401
        ├── Forbidden          403 (a client key on an admin endpoint)
        ├── NotFound           404 (unknown model, unknown path)
        ├── PayloadTooLarge    413
        ├── UnsupportedMediaType 415
        ├── QueueFull          429 with Retry-After
        ├── Unavailable        503 (queue wait timed out, no provider connected)
        └── UpstreamError      502 (provider or node failed)

Foreign errors (httpx, nats, msgspec) are translated into these once, at the boundary
where they are caught (`raise Ours(...) from exc`).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec


class IopError(Exception):
    """Base of every error iop raises on purpose."""


class ConfigError(IopError):
    """The deployment file is invalid; `problems` holds one line per problem, each naming its path."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class BusError(IopError):
    """NATS could not be reached or set up."""


class RequestError(IopError):
    """A request failed in a way the HTTP client is told about."""

    status = 500
    type = "server_error"
    code = "internal_error"
    ended_stream = False
    """True when the client's stream already carries this error as its terminal event."""

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        status: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        self.param = param
        self.headers = headers or {}

    def body(self) -> bytes:
        """The OpenAI error JSON for this error."""
        return _encode_error(self.message, self.type, self.param, self.code)


class BadRequest(RequestError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class Unauthorized(RequestError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class Forbidden(RequestError):
    status = 403
    type = "permission_error"
    code = "forbidden"


class NotFound(RequestError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class PayloadTooLarge(RequestError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class UnsupportedMediaType(RequestError):
    status = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"


class QueueFull(RequestError):
    status = 429
    type = "rate_limit_error"
    code = "queue_full"


class Unavailable(RequestError):
    status = 503
    type = "server_error"
    code = "unavailable"


class UpstreamError(RequestError):
    status = 502
    type = "server_error"
    code = "upstream_error"


_encoder = msgspec.json.Encoder()


def _encode_error(message: str, type_: str, param: str | None, code: str | None) -> bytes:
    return _encoder.encode({"error": {"message": message, "type": type_, "param": param, "code": code}})


def error_body(message: str, type_: str, code: str | None, param: str | None = None) -> bytes:
    """OpenAI error JSON for an error that did not come from a `RequestError`."""
    return _encode_error(message, type_, param, code)


def error_for_status(status: int, message: str, code: str) -> RequestError:
    """The `RequestError` matching an HTTP status (used for failures that cross NATS)."""
    cls: type[RequestError] = {
        400: BadRequest,
        401: Unauthorized,
        403: Forbidden,
        404: NotFound,
        413: PayloadTooLarge,
        429: QueueFull,
        503: Unavailable,
    }.get(status, UpstreamError)
    return cls(message, code=code, status=status)

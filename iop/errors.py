"""The one exception tree of iop; each error knows how it reaches an HTTP client.

    IopError
    ├── ConfigError              the deployment file is invalid (carries every problem)
    ├── BusError                 NATS unreachable, embedded server failed to start
    ├── ListenError              (iop/edge/http.py) the edge's HTTP address cannot be bound
    ├── NodeRefused              (iop/node/presence.py) the edge refused this node
    ├── PlanError                `iop smoke`: the options ask for what the edge does not have
    ├── UsageError               `iop smoke`: options that cannot work together or name what does not exist
    └── RequestError             a request that fails: status, OpenAI error type and code, retryable
        ├── BadRequest           400 invalid_request_error
        │   └── InvalidConfig    400 a deployment sent to /admin/refresh is invalid (lists its problems)
        ├── Unauthorized         401
        ├── Forbidden            403 (a client key on an admin endpoint)
        ├── NotFound             404 (unknown model, unknown path)
        ├── MethodNotAllowed     405
        ├── RequestTimeout       408 the request's head or body did not arrive in time
        ├── ClientStalled        408 (iop/node/flow.py) the client stopped reading a stream
        ├── PayloadTooLarge      413
        ├── UnsupportedMediaType 415
        ├── QueueFull            429 rate_limit_error, with Retry-After
        ├── RateLimited          429 rate_limit_exceeded: a tenant's rpm/tpm (iop/edge/limits.py)
        │   └── QuotaExceeded    429 insufficient_quota: a tenant's daily/monthly token budget
        ├── HeadersTooLarge      431
        ├── Unavailable          503 (queue wait timed out, no provider connected, NATS failed)
        │   ├── Cancelled        503 retryable: the node stopped the work (cancelled, node stopping)
        │   ├── BodyUnavailable  503 retryable: the node could not fetch a body that stayed at the edge
        │   └── ServerNotReady   503 retryable: the provider's model server did not start (iop/node/servers.py)
        └── UpstreamError        502 retryable: the provider or its node failed
            ├── NodeLost         502 retryable: the node stopped answering while it ran the request
            ├── RelayGap         502 part of the answer was lost between node and edge
            └── StreamFailed     502 (iop/node/adapters/openai.py) the stream already carries the error

Classes defined beside their cause (marked with their module) cross NATS as their nearest class
here. Outside the tree on purpose: `iop/node/http1.py`'s `HttpError` family and `iop/validate.py`'s
`YamlSyntaxError` stay inside their modules and are translated where they are caught.

`retryable` marks a failure of the provider, not of the request: another provider of the pool may
succeed, so the edge fails over while the client has seen nothing. A `RequestError` crosses NATS
as a `wire.Failure` naming its class (`failure_of` / `error_of`), so the edge raises the class
the node raised, not one guessed from the status.

Errors reach clients in exactly two shapes, built here and nowhere else: `error_response(exc)`
(the status, headers and OpenAI error JSON of an HTTP response) and `error_event(api, exc)` (the
terminal event of an SSE stream that already started). Foreign errors (nats, msgspec, OSError) are
translated into these classes once, at the boundary where they are caught (`raise Ours(...) from exc`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Literal, NamedTuple

import msgspec

from iop import wire


class IopError(Exception):
    """Base of every error iop raises on purpose."""


class ConfigError(IopError):
    """The deployment file is invalid; `problems` holds one line per problem, each naming its path."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class BusError(IopError):
    """NATS could not be reached or set up."""


class PlanError(IopError):
    """`iop smoke`: the options ask for something this edge does not have (an unknown alias, a burst too small)."""


class UsageError(IopError):
    """`iop smoke`: options that cannot work together or name what does not exist (exit 2)."""


_CLASSES: dict[str, type[RequestError]] = {}
"""The RequestError classes of this module by name: what a `wire.Failure` names."""


class RequestError(IopError):
    """A request failed in a way the HTTP client is told about."""

    status: int = 500
    type: ClassVar[str] = "server_error"
    code: str = "internal_error"
    retryable: ClassVar[bool] = False
    """A failure of the provider, not of the request: another provider of the pool may succeed."""
    ended_stream = False
    """True when the client's stream already carries this error as its terminal event."""

    def __init_subclass__(cls) -> None:
        super().__init_subclass__()
        if cls.__module__ == __name__:
            _CLASSES[cls.__name__] = cls

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
            self.status = status  # an upstream's own status, passed through
        self.param = param
        self.headers = headers or {}

    def details(self) -> dict[str, object]:
        """Fields the OpenAI error object carries beyond message, type, param and code."""
        return {}

    def error_object(self) -> dict[str, object]:
        return {"message": self.message, "type": self.type, "param": self.param, "code": self.code, **self.details()}


_CLASSES["RequestError"] = RequestError


class BadRequest(RequestError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class InvalidConfig(BadRequest):
    """A deployment sent to the edge (`iop refresh`) is invalid; the body lists every problem."""

    code = "invalid_config"

    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__("the deployment file is invalid")
        self.problems = list(problems)

    def details(self) -> dict[str, object]:
        return {"problems": self.problems}


del _CLASSES["InvalidConfig"]  # the edge's own answer, never a node's: it takes problems, not a message


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


class MethodNotAllowed(RequestError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class RequestTimeout(RequestError):
    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class PayloadTooLarge(RequestError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class UnsupportedMediaType(RequestError):
    status = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"


class HeadersTooLarge(RequestError):
    status = 431
    type = "invalid_request_error"
    code = "header_too_large"


class QueueFull(RequestError):
    status = 429
    type = "rate_limit_error"
    code = "queue_full"


class RateLimited(RequestError):
    """Over a tenant's rpm or tpm: OpenAI's shape (its `type` says which, `requests` or `tokens`)."""

    status = 429
    type = "requests"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, kind: str = "", **rest: Any) -> None:
        super().__init__(message, **rest)
        self.kind = kind or self.type

    def error_object(self) -> dict[str, object]:
        return {**super().error_object(), "type": self.kind}


class QuotaExceeded(RateLimited):
    status = 429
    type = "insufficient_quota"
    code = "insufficient_quota"


class Unavailable(RequestError):
    status = 503
    type = "server_error"
    code = "unavailable"


class Cancelled(Unavailable):
    """The node stopped the work before it finished: the edge cancelled it, or the node is stopping."""

    code = "cancelled"
    retryable = True


class BodyUnavailable(Unavailable):
    """The node could not fetch a request body that stayed at the edge (agent-sized, or over one message)."""

    code = "body_unavailable"
    retryable = True


class ServerNotReady(Unavailable):
    """The model server the node runs for the provider was not ready within its start timeout, or
    exited first (iop/node/servers.py): another provider of the pool may answer."""

    code = "server_not_ready"
    retryable = True


class UpstreamError(RequestError):
    status = 502
    type = "server_error"
    code = "upstream_error"
    retryable = True


class NodeLost(UpstreamError):
    """The node running the request stopped answering (heartbeats missed, or it left)."""

    code = "node_lost"


class RelayGap(UpstreamError):
    """A chunk of the answer was lost between node and edge; the answer cannot be trusted whole."""

    code = "relay_gap"
    retryable = False


# --- the two shapes an error reaches a client in ------------------------------------------------


class ErrorResponse(NamedTuple):
    """An error as an HTTP response: status, extra headers, and the OpenAI error JSON."""

    status: int
    headers: dict[str, str]
    body: bytes


_encode = msgspec.json.Encoder().encode


def error_response(exc: RequestError) -> ErrorResponse:
    """The HTTP response for `exc`: the one place an error's status, headers and body are decided."""
    return ErrorResponse(exc.status, exc.headers, _encode({"error": exc.error_object()}))


def error_event(api: Literal["chat", "responses"], exc: RequestError) -> bytes:
    """The terminal SSE event telling a client whose stream already started that it failed.

    Chat: a `data:` event holding an OpenAI error object (the SDK raises it as an APIError).
    Responses: an `error` event (the stream's own `response.failed` is the node's to write).
    """
    err = exc.error_object()
    if api == "chat":
        return b"data: " + _encode({"error": err}) + b"\n\n"
    event = {
        "type": "error",
        "code": exc.code,
        "message": exc.message,
        "param": exc.param,
        "error": err,
        "sequence_number": 0,
    }
    return b"event: error\ndata: " + _encode(event) + b"\n\n"


# --- across NATS ----------------------------------------------------------------------------------


def failure_of(exc: RequestError, id: str, chunks: int) -> wire.Failure:
    """The `wire.Failure` telling an edge that its request failed with `exc`."""
    kind = next(c.__name__ for c in type(exc).__mro__ if _CLASSES.get(c.__name__) is c)
    return wire.Failure(id, chunks, exc.status, exc.code, exc.message, exc.ended_stream, exc.param, kind)


def error_of(failure: wire.Failure) -> RequestError:
    """The error a node reported, as the class it raised (the nearest one of this module)."""
    cls = _CLASSES.get(failure.kind) or _by_status(failure.status)
    err = cls(failure.message, code=failure.code, param=failure.param, status=failure.status)
    err.ended_stream = failure.ended
    return err


def _by_status(status: int) -> type[RequestError]:
    # A Failure without `kind` comes from a node older than the field: only its status says more.
    return {
        400: BadRequest,
        401: Unauthorized,
        403: Forbidden,
        404: NotFound,
        413: PayloadTooLarge,
        429: QueueFull,
    }.get(status, Unavailable if status == 503 else UpstreamError)


def error_for_status(status: int, message: str, code: str) -> RequestError:
    """The `RequestError` for an upstream's HTTP error status (client mistakes keep their status)."""
    return _by_status(status)(message, code=code, status=status)

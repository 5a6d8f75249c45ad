"""`POST /v1/messages/count_tokens`: how many input tokens a Messages request would take.

When every provider of the alias's pool has an upstream tokenizer (the openai adapter's
`tokenize`), the request goes to the pool like any other (a slot, the queue, the ledger with api
`count_tokens`) and the node asks the upstream. Otherwise the edge answers itself with the
documented estimate (iop/anthropic/count.py): the request translated to chat as a node would, and
measured; no slot, no queue, no ledger record. Refusals are Anthropic's error bodies, as on
`/v1/messages`.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
from starlette.types import Message, Receive, Scope, Send

from iop import endpoints
from iop.anthropic.count import estimate_input_tokens
from iop.anthropic.errors import error_response
from iop.anthropic.request import messages_to_chat_request
from iop.edge import heads
from iop.edge.api import ApiEndpoint, Serving
from iop.edge.asgi import check_content_type, read_body, send_error
from iop.edge.observe import new_request_id
from iop.errors import BadRequest, MethodNotAllowed, NotFound, RequestError

_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode
_JSON = [(b"content-type", b"application/json")]


class CountTokensEndpoint:
    def __init__(self, edge: Serving) -> None:
        self.edge = edge
        self.upstream = ApiEndpoint(edge, "count_tokens")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            tenant = self.edge.tenants.of_key(self.edge.authorize(scope))
            if scope["method"] != "POST":
                raise MethodNotAllowed(f"{scope['method']} {scope['path']}: use POST", headers={"Allow": "POST"})
            check_content_type(scope)
            body = await read_body(scope, receive, self.edge.max_body_bytes, self.edge.bodies)
            model = _model_of(body)
            if model is not None and endpoints.counts_tokens(self.edge.catalog, model):
                await self.upstream(scope, _replay(body, receive), send)
                return
            count = self.count(body, tenant.policy.allows)
        except RequestError as exc:
            await send_error(send, error_response(exc, scope.get("iop.request_id") or new_request_id()))
            return
        await send({"type": "http.response.start", "status": 200, "headers": _JSON})
        await send({"type": "http.response.body", "body": _encode({"input_tokens": count})})

    def count(self, body: bytes, allows: Callable[[str], bool]) -> int:
        try:
            head = heads.count_tokens_head(body)
            request = _decode(body)
        except msgspec.ValidationError as exc:
            raise BadRequest(f"invalid request body: {exc}") from None
        except msgspec.DecodeError as exc:
            raise BadRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from None
        except RecursionError:
            raise BadRequest("request body is nested too deeply", code="invalid_json") from None
        catalog = self.edge.catalog
        # A model outside the tenant's list does not exist for its key (as on /v1/messages).
        if not allows(head.model) or (head.model not in catalog.pools and head.model not in catalog.routes):
            raise NotFound(f"model '{head.model}' does not exist; GET /v1/models lists the models", param="model")
        endpoints.check(catalog, head.model, "messages")
        # The translation wants max_tokens; the count does not depend on it.
        chat = messages_to_chat_request({**request, "max_tokens": 1, "stream": False})
        return estimate_input_tokens(chat.body)


class _Model(msgspec.Struct):
    model: str | None = None


_model = msgspec.json.Decoder(_Model).decode


def _model_of(body: bytes) -> str | None:
    """The body's model if it names one (anything wrong with the body is `count`'s to refuse)."""
    try:
        return _model(body).model
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body already read, given again to the endpoint that dispatches; then the client's own events."""
    given = False

    async def again() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again

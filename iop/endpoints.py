"""What each adapter can answer: the endpoints its upstream serves itself, and those iop translates.

An openai adapter's `api` names what its upstream serves (`chat`, `responses`, `both`, or a list
of endpoints: chat, responses, messages, embeddings, completions). Over those, the node translates:
Responses and Messages over chat, chat over Responses. Embeddings and completions are never
translated: an upstream without them cannot answer them. The mock and CLI adapters write chat and
Responses answers themselves, and Messages through the same translation over chat.

The edge refuses a request for an endpoint some member of the alias's pool cannot answer, at once
(the pool's endpoints are what all its members answer), so no request waits for a slot it cannot use.
"""

from __future__ import annotations

from typing import get_args

from iop import config, wire
from iop.errors import BadRequest

Endpoint = config.UpstreamApi
ALL: tuple[Endpoint, ...] = get_args(Endpoint)

PATHS: dict[Endpoint, str] = {
    "chat": "/v1/chat/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
    "embeddings": "/v1/embeddings",
    "completions": "/v1/completions",
}
"""The client's path of each endpoint on the edge."""


def native(adapter: config.Adapter) -> frozenset[Endpoint]:
    """The endpoints the adapter's upstream serves itself (passed through untranslated)."""
    if isinstance(adapter, config.OpenAIAdapter):
        api = adapter.api
        if api == "both":
            return frozenset(("chat", "responses"))
        if isinstance(api, str):
            return frozenset((api,))
        return frozenset(api)
    return frozenset(("chat", "responses"))  # the mock and CLI adapters write these answers themselves


def answers(adapter: config.Adapter) -> frozenset[Endpoint]:
    """Every endpoint the adapter answers: its upstream's own, and those the node translates over them."""
    own = native(adapter)
    out = set(own)
    if "chat" in own:
        out |= {"responses", "messages"}
    if "responses" in own:
        out.add("chat")
    return frozenset(out)


def of_alias(catalog: config.Catalog, alias: str) -> frozenset[Endpoint]:
    """What every provider behind `alias` answers (empty for an unknown alias)."""
    if alias in catalog.pools:
        members = [catalog.providers[p].adapter for p in catalog.pools[alias] if p in catalog.providers]
    elif alias in catalog.routes:
        ref = catalog.providers.get(catalog.routes[alias][1])
        members = [ref.adapter] if ref is not None else []
    else:
        return frozenset()
    if not members:
        return frozenset()
    common = answers(members[0])
    for adapter in members[1:]:
        common &= answers(adapter)
    return common


def compacts_natively(catalog: config.Catalog, alias: str) -> bool:
    """Every provider behind `alias` is an openai adapter whose upstream serves Responses itself: it
    is given `/v1/responses/compact` as it came (otherwise the edge compacts, iop/edge/responses_front.py)."""
    if alias in catalog.pools:
        refs = [catalog.providers.get(p) for p in catalog.pools[alias]]
    elif alias in catalog.routes:
        refs = [catalog.providers.get(catalog.routes[alias][1])]
    else:
        return False
    return bool(refs) and all(
        r is not None and isinstance(r.adapter, config.OpenAIAdapter) and "responses" in native(r.adapter) for r in refs
    )


def ordered(endpoints: frozenset[Endpoint]) -> list[Endpoint]:
    """The endpoints in one fixed order (for /v1/models and /status)."""
    return [e for e in ALL if e in endpoints]


def check(catalog: config.Catalog, alias: str, api: wire.Api) -> None:
    """Refuse at once (400 endpoint_not_served) a request for an endpoint some provider behind `alias` cannot answer."""
    served = of_alias(catalog, alias)
    if api == "count_tokens":
        api = "messages"  # counted by whoever answers the Messages request
    if api == "compact":
        if not compacts_natively(catalog, alias):
            raise BadRequest(
                f"model '{alias}' has a provider whose upstream does not serve /v1/responses/compact",
                code="endpoint_not_served",
                param="model",
            )
        return
    if api not in served:
        names = ", ".join(PATHS[e] for e in ordered(served)) or "nothing"
        raise BadRequest(
            f"model '{alias}' does not serve {PATHS[api]} (it serves {names})",
            code="endpoint_not_served",
            param="model",
        )


def counts_tokens(catalog: config.Catalog, alias: str) -> bool:
    """Every provider of the pool `alias` has an upstream tokenizer (`tokenize`): count_tokens asks it."""
    members = catalog.pools.get(alias)
    if not members:
        return False
    adapters = [catalog.providers[p].adapter for p in members if p in catalog.providers]
    return bool(adapters) and all(isinstance(a, config.OpenAIAdapter) and a.tokenize for a in adapters)

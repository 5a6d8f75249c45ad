"""Compaction of a Responses window by iop itself: the summarising request, and the sealed item it answers.

A client compacts in one of two ways: `POST /v1/responses/compact`, or (Codex's remote compaction)
an ordinary request whose input ends with a `{"type": "compaction_trigger"}` item. Either way the
model summarises the window with a fixed prompt and no tools, and the summary comes back in one
`compaction` item whose `encrypted_content` is the summary sealed by the edges (HMAC-SHA256 with a
key only they hold, over the summary and the id of the client key that asked). When that item
comes back as input, the edge opens it and the model reads the summary as a user message; an item
iop did not seal, or sealed for another client key, is refused (400 `invalid_encrypted_content`, as
OpenAI refuses another organisation's encrypted items), so no client can pass text off as a
summary of a conversation it did not have, nor replay another key's.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from collections.abc import Mapping
from typing import Any

import msgspec

from iop.errors import BadRequest
from iop.openai.responses_events import new_id

COMPACTION_PROMPT = (
    "CONTEXT CHECKPOINT. Write a summary of the conversation so far for another instance of you "
    "that will continue it with only this summary. Keep the user's goal and constraints, every "
    "decision made, what was done and what it showed (file names, commands, results, errors), "
    "and what is left to do next. Write only the summary, as plain text."
)
SUMMARY_PREFIX = "Summary of the conversation before this point (written when its context was compacted):\n\n"
_SEAL_VERSION = "iop2"
"""Items sealed by edges before seals named their key (`iop1`) are refused like any other."""
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


class Sealer:
    """Seals a summary into an `encrypted_content` string and opens it again; forgery fails the MAC."""

    def __init__(self, key: bytes) -> None:
        self._key = key

    def __repr__(self) -> str:
        return "Sealer(…)"

    @classmethod
    def derived(cls, secret: bytes) -> Sealer:
        """The edges' sealer from a secret every edge of the deployment holds (and no node does)."""
        return cls(hmac.new(secret, b"iop compaction seal v1", hashlib.sha256).digest())

    @classmethod
    def random(cls) -> Sealer:
        """A sealer of this process only: its items do not survive a restart or reach another edge."""
        return cls(secrets.token_bytes(32))

    def seal(self, summary: str, owner: str) -> str:
        """`summary` sealed for the client key whose owner id is `owner` (iop/responses/store.py)."""
        payload = _b64(_encode({"summary": summary}))
        return f"{_SEAL_VERSION}.{payload}.{self._mac(payload, owner)}"

    def open(self, token: str, owner: str) -> str | None:
        """The summary in `token`, or None when iop's edges did not seal it for `owner`."""
        version, _, rest = token.partition(".")
        payload, _, mac = rest.partition(".")
        if version != _SEAL_VERSION or not hmac.compare_digest(mac, self._mac(payload, owner)):
            return None
        try:
            value = _decode(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        except (ValueError, msgspec.DecodeError):
            return None
        summary = value.get("summary") if isinstance(value, dict) else None
        return summary if isinstance(summary, str) else None

    def _mac(self, payload: str, owner: str) -> str:
        signed = f"{_SEAL_VERSION}.{owner}.{payload}".encode()  # an owner id has no '.'
        return _b64(hmac.new(self._key, signed, hashlib.sha256).digest())


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def input_items(request: Mapping[str, Any]) -> list[Any] | None:
    items = request.get("input")
    return items if isinstance(items, list) else None


def ends_with_trigger(request: Mapping[str, Any]) -> bool:
    """Codex's remote compaction: the input's last item is `{"type": "compaction_trigger"}`."""
    items = input_items(request)
    return (
        items is not None
        and bool(items)
        and isinstance(items[-1], Mapping)
        and items[-1].get("type") == "compaction_trigger"
    )


def has_compaction(request: Mapping[str, Any]) -> bool:
    items = input_items(request) or []
    return any(isinstance(item, Mapping) and item.get("type") == "compaction" for item in items)


def expand(request: dict[str, Any], sealer: Sealer, owner: str, *, foreign: bool = False) -> dict[str, Any]:
    """The request with every `compaction` input item replaced by the summary it holds.

    An item iop did not seal for `owner` (another service's, another key's, or made up) is a 400
    naming it: dropping it would silently lose the conversation it stands for. `foreign`: the
    upstream compacts itself (a Responses one), and an item not in iop's form is its own: it
    passes untouched (one in iop's form must still open).
    """
    items = input_items(request)
    if items is None:
        return request
    return {**request, "input": opened(items, sealer, owner, foreign=foreign)}


def opened(items: list[Any], sealer: Sealer, owner: str, where: str = "input", *, foreign: bool = False) -> list[Any]:
    """`items` with each `compaction` item replaced by the summary it holds (see `expand`)."""
    out: list[Any] = []
    for i, item in enumerate(items):
        if isinstance(item, Mapping) and item.get("type") == "compaction":
            token = item.get("encrypted_content")
            if foreign and not (isinstance(token, str) and token.startswith("iop")):
                out.append(item)
                continue
            summary = sealer.open(token, owner) if isinstance(token, str) else None
            if summary is None:
                raise BadRequest(
                    "this compaction item was not made by iop for this API key (or was altered): iop "
                    "reads only the compaction items its own edges made for the key that sends them",
                    param=f"{where}[{i}].encrypted_content",
                    code="invalid_encrypted_content",
                )
            item = {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": SUMMARY_PREFIX + summary}],
            }
        out.append(item)
    return out


def summary_request(request: Mapping[str, Any], items: list[Any]) -> dict[str, Any]:
    """The request that has the model summarise `items`: the compaction prompt last, no tools, not streamed."""
    summarise: dict[str, Any] = {
        "model": request.get("model"),
        "input": [
            *items,
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": COMPACTION_PROMPT}]},
        ],
        "stream": False,
        "store": False,
    }
    if isinstance(request.get("instructions"), str):
        summarise["instructions"] = request["instructions"]
    if isinstance(request.get("previous_response_id"), str):
        # The window goes on before these items: the endpoint expands it from the store.
        summarise["previous_response_id"] = request["previous_response_id"]
    return summarise


def summary_text(response: Mapping[str, Any]) -> str:
    """The text of a response object's assistant messages."""
    parts: list[str] = []
    for item in response.get("output") or []:
        if isinstance(item, Mapping) and item.get("type") == "message":
            for part in item.get("content") or []:
                if isinstance(part, Mapping) and part.get("type") == "output_text":
                    parts.append(str(part.get("text") or ""))
    return "".join(parts).strip()


def user_message(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def compaction_item(sealed: str) -> dict[str, Any]:
    return {"id": new_id("cmp_"), "type": "compaction", "encrypted_content": sealed, "created_by": "iop"}


def kept_user_messages(items: list[Any]) -> list[dict[str, Any]]:
    """What `/responses/compact` keeps of the window beside the summary: the user's own messages,
    as output messages (an id, a status, content parts)."""
    kept: list[dict[str, Any]] = []
    for item in items:
        if not isinstance(item, Mapping) or item.get("role") != "user" or item.get("type", "message") != "message":
            continue
        content = item.get("content")
        parts = [{"type": "input_text", "text": content}] if isinstance(content, str) else list(content or [])
        item_id = item.get("id")
        kept.append(
            {
                "type": "message",
                "id": item_id if isinstance(item_id, str) else new_id("msg_"),
                "status": "completed",
                "role": "user",
                "content": parts,
            }
        )
    return kept

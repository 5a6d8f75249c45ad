"""Responses API answers: the response object and its SSE event sequence, built item by item."""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Mapping
from typing import Any

import msgspec

from iop.openai.tool_names import Origin
from iop.openai.usage import Usage, responses_usage

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode

# The error codes a response.failed may carry: the OpenAI SDK's `ResponseError.code` values
# plus the ones Codex CLI acts on (it compacts on context_length_exceeded). Anything else is
# reported as server_error, with iop's own code kept in `type`.
_RESPONSE_ERROR_CODES = frozenset(
    {
        "server_error",
        "rate_limit_exceeded",
        "invalid_prompt",
        "context_length_exceeded",
        "insufficient_quota",
    }
)
_IOP_TO_RESPONSE_ERROR = {"queue_full": "rate_limit_exceeded", "invalid_request": "invalid_prompt"}
# How vLLM, llama.cpp and OpenAI word a prompt too long for the model; Codex needs the code to react.
_CONTEXT_OVERFLOW = re.compile(
    r"maximum context length|maximum model length|context size|context window|context_length_exceeded", re.I
)


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def response_error(message: str, code: str) -> dict[str, Any]:
    """The `error` of a failed response object."""
    mapped = _IOP_TO_RESPONSE_ERROR.get(code, code)
    if mapped not in _RESPONSE_ERROR_CODES:
        mapped = "server_error"
    if mapped in ("server_error", "invalid_prompt") and _CONTEXT_OVERFLOW.search(message):
        mapped = "context_length_exceeded"
    return {"code": mapped, "message": message, "type": code}


# The tool types a chat translation serves (ToolMap): the others are dropped, so not echoed.
_SERVED_TOOLS = frozenset({"function", "custom", "namespace", "tool_search"})


def _number(value: object, default: float) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def _string(value: object) -> str | None:
    return value if isinstance(value, str) else None


def echoed_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    """A served tool as the response lists it: a function with every field the schema requires.

    `strict` says what the chat server was asked: the request's value, else not strict (a chat
    function without `strict` is not held to its schema).
    """
    if tool.get("type") == "function":
        strict = tool.get("strict")
        return {
            **tool,
            "description": tool.get("description"),
            "parameters": tool.get("parameters"),
            "strict": strict if isinstance(strict, bool) else False,
        }
    if tool.get("type") == "namespace" and isinstance(tool.get("tools"), list):
        children = [t for t in tool["tools"] if isinstance(t, Mapping) and t.get("type") in ("function", "custom")]
        return {**tool, "tools": [echoed_tool(t) for t in children]}
    return dict(tool)


def echoed_tools(tools: object) -> list[dict[str, Any]]:
    """The request's tools a chat translation serves, as the response echoes them."""
    if not isinstance(tools, list):
        return []
    return [echoed_tool(t) for t in tools if isinstance(t, Mapping) and _string(t.get("type")) in _SERVED_TOOLS]


def echoed_text(text: object) -> dict[str, Any]:
    """`text` with its `format` always present (plain text unless the request asked otherwise)."""
    out = dict(text) if isinstance(text, Mapping) else {}
    if not isinstance(out.get("format"), Mapping):
        out["format"] = {"type": "text"}
    return out


def response_object(request: Mapping[str, Any] | None, model: str) -> dict[str, Any]:
    """An in-progress response object echoing the request's settings as applied, with no output yet.

    Every field the Open Responses `ResponseResource` requires is present with its type: sampling
    settings the request left out read as the defaults a chat server applies (temperature and
    top_p 1, penalties 0), hosted tools the translation dropped are not listed.
    """
    req: Mapping[str, Any] = request or {}
    metadata = req.get("metadata")
    return {
        "id": new_id("resp_"),
        "object": "response",
        "created_at": int(time.time()),
        "completed_at": None,
        "status": "in_progress",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": req.get("instructions"),
        "max_output_tokens": req.get("max_output_tokens"),
        "max_tool_calls": req.get("max_tool_calls"),
        "model": model,
        "output": [],
        "parallel_tool_calls": bool(req.get("parallel_tool_calls", True)),
        "previous_response_id": None,
        "reasoning": req.get("reasoning"),
        # Whether the edge keeps it is the edge's to say (it sets this on what it relays).
        "store": False,
        "temperature": _number(req.get("temperature"), 1.0),
        "top_p": _number(req.get("top_p"), 1.0),
        "presence_penalty": _number(req.get("presence_penalty"), 0.0),
        "frequency_penalty": _number(req.get("frequency_penalty"), 0.0),
        # Logprobs are refused when translating (responses_request.check_stateless): none are given.
        "top_logprobs": 0,
        # iop has no service tiers: every request is served alike.
        "service_tier": "default",
        "text": echoed_text(req.get("text")),
        "tool_choice": req.get("tool_choice") or "auto",
        "tools": echoed_tools(req.get("tools")),
        "truncation": req.get("truncation") or "disabled",
        "usage": None,
        "user": req.get("user"),
        "safety_identifier": _string(req.get("safety_identifier")),
        "prompt_cache_key": _string(req.get("prompt_cache_key")),
        "metadata": metadata if isinstance(metadata, Mapping) else {},
    }


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [output_text_part(text)],
    }


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def function_call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str = "completed", namespace: str | None = None
) -> dict[str, Any]:
    item = {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "arguments": arguments,
        "call_id": call_id,
        "name": name,
    }
    if namespace is not None:
        item["namespace"] = namespace  # Codex finds a namespaced tool by both, never by a joined name
    return item


def call_item(origin: Origin, item_id: str, call_id: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    """The output item for a chat tool call whose function stands for `origin` (see ToolMap).

    `arguments` is the chat call's JSON string: a custom tool's is `{"input": ...}` (its raw text
    when it is not that JSON), a tool search's is parsed into an object.
    """
    if origin.kind == "custom":
        item = {
            "id": item_id,
            "type": "custom_tool_call",
            "status": status,
            "call_id": call_id,
            "name": origin.name,
            "input": custom_input(arguments),
        }
        if origin.namespace is not None:
            item["namespace"] = origin.namespace
        return item
    if origin.kind == "tool_search":
        return {
            "id": item_id,
            "type": "tool_search_call",
            "status": status,
            "call_id": call_id,
            "execution": "client",
            "arguments": search_arguments(arguments),
        }
    return function_call_item(item_id, call_id, origin.name, arguments, status, origin.namespace)


def custom_input(arguments: str) -> str:
    """A custom tool's input out of the one-string-parameter function's arguments."""
    try:
        value = _decode(arguments)
    except msgspec.DecodeError:
        return arguments  # a model that answered with the raw text: take it as it is
    if isinstance(value, dict) and isinstance(value.get("input"), str):
        return str(value["input"])
    return value if isinstance(value, str) else arguments


def search_arguments(arguments: str) -> object:
    try:
        value = _decode(arguments) if arguments.strip() else {}
    except msgspec.DecodeError:
        return {"query": arguments}
    return value if isinstance(value, dict) else {"query": arguments}


CALL_ID_PREFIX = {"function": "fc_", "custom": "ctc_", "tool_search": "tsc_"}


def final_status(finish_reason: str | None) -> tuple[str, dict[str, str] | None]:
    """Response status and incomplete_details for a chat finish_reason."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "content_filter":
        return "incomplete", {"reason": "content_filter"}
    return "completed", None


def finish_response(
    response: dict[str, Any], output: list[dict[str, Any]], usage: Usage | None, finish_reason: str | None
) -> dict[str, Any]:
    """Fill in a response object's outcome (in place) and return it."""
    status, details = final_status(finish_reason)
    response["status"] = status
    response["incomplete_details"] = details
    response["output"] = output
    response["usage"] = responses_usage(usage) if usage is not None else None
    if status == "completed":
        response["completed_at"] = int(time.time())
    return response


class _TextItem:
    """An open message or reasoning item whose text is still streaming."""

    def __init__(self, kind: str, item_id: str, output_index: int, delta_head: bytes) -> None:
        self.kind = kind
        self.item_id = item_id
        self.output_index = output_index
        self.delta_head = delta_head
        self.pieces: list[str] = []


class _CallItem:
    """A tool call item whose arguments are still streaming."""

    def __init__(self, item_id: str, call_id: str, origin: Origin, output_index: int) -> None:
        self.item_id = item_id
        self.call_id = call_id
        self.origin = origin
        self.output_index = output_index
        self.pieces: list[str] = []

    def item(self, status: str) -> dict[str, Any]:
        return call_item(self.origin, self.item_id, self.call_id, "".join(self.pieces), status)


class ResponseEvents:
    """The SSE events of one streamed Responses answer, in order, each with its sequence_number.

    Feed it what the model produces (`text`, `reasoning`, `open_call` + `arguments`); it opens and closes
    output items as the kind of output changes, and `finish` / `fail` end the stream with the
    whole response object. Every method returns the bytes to send (possibly empty); after
    the stream ended every method returns b"".
    """

    def __init__(self, request: Mapping[str, Any] | None, model: str) -> None:
        self.response = response_object(request, model)
        self.output: list[dict[str, Any]] = []
        self._seq = 0
        self._text: _TextItem | None = None
        self._calls: dict[int, _CallItem] = {}
        self.started = False
        self.ended = False

    def _event(self, type_: str, payload: dict[str, Any]) -> bytes:
        payload["type"] = type_
        payload["sequence_number"] = self._seq
        self._seq += 1
        return b"event: " + type_.encode() + b"\ndata: " + _encode(payload) + b"\n\n"

    def _lifecycle(self, type_: str) -> bytes:
        return self._event(type_, {"response": self.response})

    def start(self) -> bytes:
        """response.created and response.in_progress (once)."""
        if self.started:
            return b""
        self.started = True
        return self._lifecycle("response.created") + self._lifecycle("response.in_progress")

    def _add(self, item: dict[str, Any]) -> tuple[int, bytes]:
        index = len(self.output)
        self.output.append(item)
        return index, self._event("response.output_item.added", {"output_index": index, "item": dict(item)})

    def open_text(self) -> bytes:
        """Open the assistant message (it opens by itself on the first text)."""
        return self._open("message") if not self.ended else b""

    def _open(self, kind: str) -> bytes:
        out = self.start() + self._close_text("completed")
        if kind == "message":
            item_id = new_id("msg_")
            index, added = self._add({**message_item(item_id, "", "in_progress"), "content": []})
            part = output_text_part("")
            head_type = b"response.output_text.delta"
        else:
            item_id = new_id("rs_")
            index, added = self._add({**reasoning_item(item_id, "", "in_progress"), "content": []})
            part = {"type": "reasoning_text", "text": ""}
            head_type = b"response.reasoning_text.delta"
        out += added + self._event(
            "response.content_part.added",
            {"item_id": item_id, "output_index": index, "content_index": 0, "part": part},
        )
        # Everything in a delta event but the sequence number and the text, encoded once.
        logprobs = b'"logprobs":[],' if kind == "message" else b""
        head = (
            b"event: "
            + head_type
            + b'\ndata: {"type":"'
            + head_type
            + b'","item_id":"'
            + item_id.encode()
            + b'","output_index":'
            + str(index).encode()
            + b',"content_index":0,'
            + logprobs
            + b'"sequence_number":'
        )
        self._text = _TextItem(kind, item_id, index, head)
        return out

    def _delta(self, kind: str, text: str) -> bytes:
        if self.ended or not text:
            return b""
        out = b""
        if self._text is None or self._text.kind != kind:
            out = self._open(kind)
        item = self._text
        assert item is not None
        item.pieces.append(text)
        seq = self._seq
        self._seq += 1
        return out + item.delta_head + str(seq).encode() + b',"delta":' + _encode(text) + b"}\n\n"

    def text(self, delta: str) -> bytes:
        return self._delta("message", delta)

    def reasoning(self, delta: str) -> bytes:
        return self._delta("reasoning", delta)

    def _close_text(self, status: str) -> bytes:
        item, self._text = self._text, None
        if item is None:
            return b""
        text = "".join(item.pieces)
        where = {"item_id": item.item_id, "output_index": item.output_index, "content_index": 0}
        if item.kind == "message":
            part = output_text_part(text)
            done = self._event("response.output_text.done", {**where, "text": text, "logprobs": []})
            final = message_item(item.item_id, text, status)
        else:
            part = {"type": "reasoning_text", "text": text}
            done = self._event("response.reasoning_text.done", {**where, "text": text})
            final = reasoning_item(item.item_id, text, status)
        self.output[item.output_index] = final
        return (
            done
            + self._event("response.content_part.done", {**where, "part": part})
            + self._event("response.output_item.done", {"output_index": item.output_index, "item": final})
        )

    def open_call(self, key: int, call_id: str, origin: Origin | str) -> bytes:
        """Open a tool call item; `key` (the caller's choice) names it to `arguments`.

        A function call streams its arguments as they come; a custom tool's input and a tool
        search's arguments are only whole once the JSON around them is, so they go out at the end.
        """
        if self.ended or key in self._calls:
            return b""
        origin = Origin("function", origin) if isinstance(origin, str) else origin
        out = self.start() + self._close_text("completed")
        item = call_item(origin, new_id(CALL_ID_PREFIX[origin.kind]), call_id, "", "in_progress")
        if origin.kind == "tool_search":
            item["arguments"] = {}
        index, added = self._add(item)
        self._calls[key] = _CallItem(item["id"], call_id, origin, index)
        return out + added

    def arguments(self, key: int, delta: str) -> bytes:
        call = self._calls.get(key)
        if self.ended or call is None or not delta:
            return b""
        call.pieces.append(delta)
        if call.origin.kind != "function":
            return b""
        return self._event(
            "response.function_call_arguments.delta",
            {"item_id": call.item_id, "output_index": call.output_index, "delta": delta},
        )

    def _close_calls(self, status: str) -> bytes:
        out = b""
        for call in self._calls.values():
            final = call.item(status)
            self.output[call.output_index] = final
            where = {"item_id": call.item_id, "output_index": call.output_index}
            if final["type"] == "function_call":
                done = {**where, "name": final["name"], "arguments": final["arguments"]}
                out += self._event("response.function_call_arguments.done", done)
            elif final["type"] == "custom_tool_call":
                if final["input"]:
                    out += self._event("response.custom_tool_call_input.delta", {**where, "delta": final["input"]})
                out += self._event("response.custom_tool_call_input.done", {**where, "input": final["input"]})
            index = call.output_index
            out += self._event("response.output_item.done", {"output_index": index, "item": final})
        self._calls = {}
        return out

    def finish(self, usage: Usage | None, finish_reason: str | None = "stop") -> bytes:
        """Close every open item, then response.completed (or response.incomplete)."""
        if self.ended:
            return b""
        out = self.start()
        if not self.output and not self._calls:
            out += self._open("message")  # an answer always has a message, even an empty one
        status, _ = final_status(finish_reason)
        item_status = "completed" if status == "completed" else "incomplete"
        out += self._close_text(item_status) + self._close_calls(item_status)
        self.ended = True
        finish_response(self.response, self.output, usage, finish_reason)
        return out + self._lifecycle("response.completed" if status == "completed" else "response.incomplete")

    def finish_items(self, items: list[dict[str, Any]], usage: Usage | None) -> bytes:
        """The whole answer at once: each finished item (added, then done), then response.completed.

        For answers the edge makes itself (a warm-up has no item, a compaction one), which have no
        deltas to stream.
        """
        if self.ended:
            return b""
        out = self.start()
        for item in items:
            index, added = self._add(item)
            out += added + self._event("response.output_item.done", {"output_index": index, "item": item})
        self.ended = True
        finish_response(self.response, self.output, usage, "stop")
        return out + self._lifecycle("response.completed")

    def fail(self, message: str, code: str) -> bytes:
        """End the stream with response.failed, keeping whatever output was produced so far."""
        if self.ended:
            return b""
        out = self.start()
        self.ended = True
        self.response["status"] = "failed"
        self.response["error"] = response_error(message, code)
        # Output cut short stays in the failed response, marked incomplete.
        if self._text is not None:
            item = self._text
            make = message_item if item.kind == "message" else reasoning_item
            self.output[item.output_index] = make(item.item_id, "".join(item.pieces), "incomplete")
        for call in self._calls.values():
            self.output[call.output_index] = call.item("incomplete")
        self.response["output"] = self.output
        return out + self._lifecycle("response.failed")

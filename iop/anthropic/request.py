"""A Messages request as the chat-completions request a chat-only upstream understands.

What maps (docs/anthropic-compat.md): `system` (a string or text blocks) becomes the first system
message; a `system` message inside `messages` (Claude Code sends one) stays a system message where
it stands, so the prefix a model server caches does not move between turns; text and image blocks
become content parts; an assistant's `tool_use` blocks become `tool_calls`; a user's `tool_result`
blocks become `tool` messages, placed before the rest of that user turn as chat requires; `tools`,
`tool_choice`, `stop_sequences`, `temperature`, `top_p`, `top_k`, `max_tokens`, `stream`.
What is dropped because a chat server has no place for it: Claude Code's billing line (a system
block starting `x-anthropic-billing-header:`), `thinking` and `redacted_thinking`
blocks of earlier turns, `cache_control`, `metadata`, `thinking`, `context_management`,
`output_config`, and server tools (a `type` other than `custom`), which are named back to the
caller so the edge can say so in a header. Anything else malformed is a `BadRequest` naming its path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from iop.errors import BadRequest

_encode = msgspec.json.Encoder().encode

_PASSED = ("temperature", "top_p", "top_k")


@dataclass
class ChatRequest:
    """The chat body for the upstream, and the server tools the request offered that it cannot carry."""

    body: dict[str, Any]
    dropped_tools: list[str] = field(default_factory=list)


def messages_to_chat_request(request: Mapping[str, Any], model: str | None = None) -> ChatRequest:
    """The chat-completions request for `request` (a decoded Messages body); `model` replaces its model."""
    messages: list[dict[str, Any]] = []
    system = request.get("system")
    if system is not None:
        text = _text_of(system, "system", skip=_BILLING)
        if text:
            messages.append({"role": "system", "content": text})
    turns = request.get("messages")
    if not isinstance(turns, list) or not turns:
        raise BadRequest("messages: must be a non-empty list of messages", param="messages")
    for i, turn in enumerate(turns):
        messages.extend(_turn(turn, f"messages[{i}]"))
    body: dict[str, Any] = {"model": model if model is not None else request.get("model"), "messages": messages}
    max_tokens = request.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise BadRequest("max_tokens: must be a positive integer", param="max_tokens")
    body["max_tokens"] = max_tokens
    for name in _PASSED:
        if (value := request.get(name)) is not None:
            body[name] = value
    stops = request.get("stop_sequences")
    if stops:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise BadRequest("stop_sequences: must be a list of strings", param="stop_sequences")
        body["stop"] = stops
    if request.get("stream") is True:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    dropped: list[str] = []
    tools = request.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise BadRequest("tools: must be a list", param="tools")
        functions = []
        for i, tool in enumerate(tools):
            fn = _tool(tool, f"tools[{i}]")
            if fn is None:
                dropped.append(str(tool.get("type")))
            else:
                functions.append(fn)
        if functions:
            body["tools"] = functions
    choice = request.get("tool_choice")
    if choice is not None and "tools" in body:
        body.update(_tool_choice(choice))
    return ChatRequest(body, dropped)


def _turn(turn: object, path: str) -> list[dict[str, Any]]:
    if not isinstance(turn, Mapping):
        raise BadRequest(f"{path}: must be an object with role and content", param=path)
    role = turn.get("role")
    content = turn.get("content")
    if role == "system":
        return [{"role": "system", "content": _text_of(content, f"{path}.content")}]
    if role not in ("user", "assistant"):
        raise BadRequest(f"{path}.role: must be 'user' or 'assistant'", param=f"{path}.role")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise BadRequest(f"{path}.content: must be a string or a list of content blocks", param=f"{path}.content")
    if role == "assistant":
        return [_assistant(content, path)]
    return _user(content, path)


def _assistant(blocks: Sequence[object], path: str) -> dict[str, Any]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        where = f"{path}.content[{j}]"
        kind, block = _block(block, where)
        if kind == "text":
            texts.append(_str(block, "text", where))
        elif kind == "tool_use":
            calls.append(
                {
                    "id": _str(block, "id", where),
                    "type": "function",
                    "function": {
                        "name": _str(block, "name", where),
                        "arguments": _encode(block.get("input", {})).decode(),
                    },
                }
            )
        elif kind in ("thinking", "redacted_thinking"):
            continue  # a chat server cannot take reasoning back; the answer's text and calls carry on
        else:
            raise BadRequest(f"{where}.type: '{kind}' is not a block an assistant turn can hold here", param=where)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
    if calls:
        message["tool_calls"] = calls
    return message


def _user(blocks: Sequence[object], path: str) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        where = f"{path}.content[{j}]"
        kind, block = _block(block, where)
        if kind == "tool_result":
            text = _result_text(block.get("content"), f"{where}.content")
            if block.get("is_error") is True:
                text = f"Error: {text}" if text else "Error"
            results.append({"role": "tool", "tool_call_id": _str(block, "tool_use_id", where), "content": text})
        elif kind == "text":
            parts.append({"type": "text", "text": _str(block, "text", where)})
        elif kind == "image":
            parts.append(
                {"type": "image_url", "image_url": {"url": _image_url(block.get("source"), f"{where}.source")}}
            )
        elif kind == "document":
            parts.append({"type": "text", "text": _document_text(block.get("source"), f"{where}.source")})
        else:
            raise BadRequest(f"{where}.type: '{kind}' is not a block a user turn can hold here", param=where)
    out = results
    if parts:
        if all(p["type"] == "text" for p in parts):
            # One block per line: Claude Code's `<system-reminder>` block must not run into the prompt.
            out.append({"role": "user", "content": "\n".join(p["text"] for p in parts)})
        else:
            out.append({"role": "user", "content": parts})
    return out


def _tool(tool: object, path: str) -> dict[str, Any] | None:
    if not isinstance(tool, Mapping):
        raise BadRequest(f"{path}: must be an object", param=path)
    kind = tool.get("type")
    if kind not in (None, "custom"):
        return None  # a server tool (web search, code execution, ...): Anthropic runs those, a chat server cannot
    function: dict[str, Any] = {"name": _str(tool, "name", path)}
    if isinstance(description := tool.get("description"), str):
        function["description"] = description
    schema = tool.get("input_schema")
    function["parameters"] = schema if isinstance(schema, Mapping) else {"type": "object", "properties": {}}
    return {"type": "function", "function": function}


def _tool_choice(choice: object) -> dict[str, Any]:
    if not isinstance(choice, Mapping):
        raise BadRequest("tool_choice: must be an object with a type", param="tool_choice")
    kind = choice.get("type")
    out: dict[str, Any] = {}
    if kind == "auto":
        out["tool_choice"] = "auto"
    elif kind == "any":
        out["tool_choice"] = "required"
    elif kind == "none":
        out["tool_choice"] = "none"
    elif kind == "tool":
        out["tool_choice"] = {"type": "function", "function": {"name": _str(choice, "name", "tool_choice")}}
    else:
        raise BadRequest("tool_choice.type: must be 'auto', 'any', 'tool' or 'none'", param="tool_choice.type")
    if choice.get("disable_parallel_tool_use") is True:
        out["parallel_tool_calls"] = False
    return out


def _block(block: object, path: str) -> tuple[str, Mapping[str, Any]]:
    """A content block's type and the block, or a BadRequest naming its path."""
    if not isinstance(block, Mapping) or not isinstance(kind := block.get("type"), str):
        raise BadRequest(f"{path}: must be a content block with a type", param=path)
    return kind, block


def _str(obj: Mapping[str, Any], key: str, path: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str):
        raise BadRequest(f"{path}.{key}: must be a string", param=f"{path}.{key}")
    return value


_BILLING = "x-anthropic-billing-header:"
"""Claude Code's first system block is a line for Anthropic's billing, not for a model: dropped."""


def _text_of(value: object, path: str, skip: str | None = None) -> str:
    """The text of a string or of a list of text blocks (system prompts, system turns); blocks
    starting with `skip` are left out."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise BadRequest(f"{path}: must be a string or a list of text blocks", param=path)
    texts = []
    for j, block in enumerate(value):
        where = f"{path}[{j}]"
        kind, block = _block(block, where)
        if kind != "text":
            raise BadRequest(f"{where}.type: only text blocks can stand here", param=where)
        text = _str(block, "text", where)
        if skip is None or not text.startswith(skip):
            texts.append(text)
    return "\n".join(texts)


def _result_text(content: object, path: str) -> str:
    """A tool_result's content as text: a string, or text blocks joined; an image inside is named, not sent."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{path}: must be a string or a list of content blocks", param=path)
    texts = []
    for j, block in enumerate(content):
        where = f"{path}[{j}]"
        kind, block = _block(block, where)
        if kind == "text":
            texts.append(_str(block, "text", where))
        elif kind == "image":
            texts.append("[image]")  # a chat `tool` message holds text only
        else:
            raise BadRequest(f"{where}.type: '{kind}' cannot stand in a tool result here", param=where)
    return "\n".join(texts)


def _image_url(source: object, path: str) -> str:
    if not isinstance(source, Mapping):
        raise BadRequest(f"{path}: must be an image source object", param=path)
    kind = source.get("type")
    if kind == "base64":
        return f"data:{_str(source, 'media_type', path)};base64,{_str(source, 'data', path)}"
    if kind == "url":
        return _str(source, "url", path)
    raise BadRequest(f"{path}.type: must be 'base64' or 'url'", param=f"{path}.type")


def _document_text(source: object, path: str) -> str:
    if isinstance(source, Mapping) and source.get("type") == "text":
        return _str(source, "data", path)
    raise BadRequest(f"{path}: only plain-text documents can be sent to this model", param=path)


# --- the same translation on the body's bytes --------------------------------------------------------
# What a chat server needs of a turn is its structure; its texts (tool outputs, prompts, the system
# prompt: nearly all of an agent's body) only move from one key to another. Here they stay the
# client's JSON (msgspec.Raw) from the body into the chat body, neither decoded nor re-encoded.
# A body of any other shape (or a wrong one) is translated decoded, which names what is wrong.

_NULL = msgspec.Raw(b"null")
_EMPTY = msgspec.Raw(b'""')


class _RawBlock(msgspec.Struct):
    type: str
    text: msgspec.Raw = _NULL
    id: Any = None
    name: Any = None
    input: msgspec.Raw = msgspec.Raw(b"{}")
    tool_use_id: Any = None
    content: msgspec.Raw = _NULL
    is_error: Any = None
    source: Any = None


class _RawTurn(msgspec.Struct):
    role: Any = None
    # Blocks decoded with the request, in the one pass over its bytes (their texts stay raw); a
    # string content is a string (a turn's own text is short beside its tool results).
    content: str | list[_RawBlock] | None = None


class _RawRequest(msgspec.Struct):
    messages: list[_RawTurn]
    system: msgspec.Raw = _NULL
    # The small fields, decoded: the decoded translation takes them.
    model: Any = None
    max_tokens: Any = None
    temperature: Any = None
    top_p: Any = None
    top_k: Any = None
    stop_sequences: Any = None
    stream: Any = None
    tools: Any = None
    tool_choice: Any = None


_raw_request = msgspec.json.Decoder(_RawRequest).decode
_raw_blocks = msgspec.json.Decoder(list[_RawBlock]).decode
_decode = msgspec.json.Decoder().decode


class _Decoded(Exception):
    """This body takes the decoded translation."""


def chat_body_of(body: bytes, model: str | None = None) -> tuple[bytes, list[str]]:
    """The chat body (bytes) for a Messages body, and the server tools it dropped: what
    `messages_to_chat_request` gives for the decoded body, its texts kept as the client's bytes."""
    try:
        raw = _raw_request(body)
        messages = _raw_system(raw.system)
        if not raw.messages:
            raise _Decoded
        for turn in raw.messages:
            messages.extend(_raw_turn(turn))
    except (_Decoded, BadRequest, msgspec.DecodeError, RecursionError):
        return _decoded(body, model)  # its error names the path of what is wrong
    rest = {name: getattr(raw, name) for name in _RawRequest.__struct_fields__[2:]}
    rest["messages"] = [{"role": "user", "content": ""}]  # a stand-in: the turns are translated above
    chat = messages_to_chat_request(rest, model)
    chat.body["messages"] = messages
    return _encode(chat.body), chat.dropped_tools


def _decoded(body: bytes, model: str | None) -> tuple[bytes, list[str]]:
    request = _decode(body)
    if not isinstance(request, Mapping):
        raise BadRequest("the request body must be a JSON object")
    chat = messages_to_chat_request(request, model)
    return _encode(chat.body), chat.dropped_tools


def _is_str(raw: msgspec.Raw) -> bool:
    return memoryview(raw)[0] == 0x22  # "


def _is_list(raw: msgspec.Raw) -> bool:
    return memoryview(raw)[0] == 0x5B  # [


def _join(texts: list[msgspec.Raw], sep: bytes) -> msgspec.Raw:
    """JSON strings joined as their texts would be (`sep` already escaped)."""
    if len(texts) == 1:
        return texts[0]
    return msgspec.Raw(b'"' + sep.join(bytes(memoryview(t)[1:-1]) for t in texts) + b'"')


def _texts(blocks: list[_RawBlock], skip: bool = False) -> list[msgspec.Raw]:
    out = []
    for block in blocks:
        if block.type != "text" or not _is_str(block.text):
            raise _Decoded
        head = bytes(memoryview(block.text)[:40])
        maybe = head.startswith(b'"' + _BILLING.encode()) or b"\\" in head
        if skip and maybe and _decode(block.text).startswith(_BILLING):
            continue
        out.append(block.text)
    return out


def _raw_text_of(content: msgspec.Raw, skip: bool = False) -> msgspec.Raw:
    if _is_str(content):
        return content
    if not _is_list(content):
        raise _Decoded
    return _blocks_text(_raw_blocks(content), skip)


def _blocks_text(blocks: list[_RawBlock], skip: bool = False) -> msgspec.Raw:
    texts = _texts(blocks, skip)
    return _join(texts, b"\\n") if texts else _EMPTY


def _raw_system(system: msgspec.Raw) -> list[dict[str, Any]]:
    if system == _NULL:
        return []
    text = _raw_text_of(system, skip=True)
    return [{"role": "system", "content": text}] if text != _EMPTY else []


def _raw_turn(turn: _RawTurn) -> list[dict[str, Any]]:
    role, content = turn.role, turn.content
    if content is None or role not in ("user", "assistant", "system"):
        raise _Decoded
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if role == "system":
        return [{"role": "system", "content": _blocks_text(content)}]
    return [_raw_assistant(content)] if role == "assistant" else _raw_user(content)


def _raw_assistant(blocks: list[_RawBlock]) -> dict[str, Any]:
    texts: list[msgspec.Raw] = []
    calls: list[dict[str, Any]] = []
    for block in blocks:
        if block.type == "text":
            texts += _texts([block])
        elif block.type == "tool_use":
            if not isinstance(block.id, str) or not isinstance(block.name, str):
                raise _Decoded
            arguments = _encode(_decode(block.input)).decode()  # a call's input: small, and compact here
            fn = {"name": block.name, "arguments": arguments}
            calls.append({"id": block.id, "type": "function", "function": fn})
        elif block.type not in ("thinking", "redacted_thinking"):
            raise _Decoded
    message: dict[str, Any] = {"role": "assistant", "content": _join(texts, b"") if texts else None}
    if calls:
        message["tool_calls"] = calls
    return message


def _raw_user(blocks: list[_RawBlock]) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for block in blocks:
        if block.type == "tool_result":
            if not isinstance(block.tool_use_id, str):
                raise _Decoded
            text = _raw_result_text(block.content)
            if block.is_error is True:
                text = msgspec.Raw(b'"Error: ' + bytes(memoryview(text)[1:])) if text != _EMPTY else _raw_str("Error")
            results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": text})
        elif block.type == "text":
            parts.append({"type": "text", "text": _texts([block])[0]})
        elif block.type == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block.source, "source")}})
        elif block.type == "document":
            parts.append({"type": "text", "text": _raw_str(_document_text(block.source, "source"))})
        else:
            raise _Decoded
    out = results
    if parts:
        if all(p["type"] == "text" for p in parts):
            out.append({"role": "user", "content": _join([p["text"] for p in parts], b"\\n")})
        else:
            out.append({"role": "user", "content": parts})
    return out


def _raw_result_text(content: msgspec.Raw) -> msgspec.Raw:
    if content == _NULL:
        return _EMPTY
    if _is_str(content):
        return content
    if not _is_list(content):
        raise _Decoded
    texts = []
    for block in _raw_blocks(content):
        if block.type == "image":
            texts.append(_raw_str("[image]"))
        else:
            texts += _texts([block])
    return _join(texts, b"\\n") if texts else _EMPTY


def _raw_str(text: str) -> msgspec.Raw:
    return msgspec.Raw(_encode(text))

"""Responses ⇄ chat translation for upstreams that serve only one of the two APIs (see docs/openai-compat.md).

Client called /v1/responses, upstream serves chat:
    responses_to_chat_request(request, model)        -> the chat request to send upstream
    chat_to_responses_answer(body, request, model)   -> the response object for the client
    ChatToResponsesStream(request, model)            -> chat SSE bytes in, Responses SSE bytes out
Client called /v1/chat/completions, upstream serves Responses:
    chat_to_responses_request(request, model)        -> the Responses request to send upstream
    responses_to_chat_answer(body, model)            -> the chat.completion for the client
    ResponsesToChatStream(request, model)            -> Responses SSE bytes in, chat SSE bytes out

Requests that need what a chat-only server cannot give (stored responses, hosted tools) raise
`BadRequest(code="unsupported_parameter")` naming the field; answers that are not answers
raise `UpstreamError`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from iop.errors import BadRequest, UpstreamError
from iop.openai.chat_events import chat_completion
from iop.openai.responses_events import (
    final_status,
    finish_response,
    function_call_item,
    message_item,
    new_id,
    reasoning_item,
    response_object,
)
from iop.openai.translate_stream import ChatToResponsesStream, ResponsesToChatStream, as_mapping, chat_finish_reason
from iop.openai.usage import usage_from_chat, usage_from_responses

__all__ = [
    "ChatToResponsesStream",
    "ResponsesToChatStream",
    "chat_to_responses_answer",
    "chat_to_responses_request",
    "responses_to_chat_answer",
    "responses_to_chat_request",
]

_encode = msgspec.json.Encoder().encode

_NO_STATE = "iop keeps no responses or conversations; send the whole conversation in `input`"


def _refuse(param: str, message: str) -> BadRequest:
    return BadRequest(message, param=param, code="unsupported_parameter")


def _present(value: object) -> bool:
    return value is not None and value is not False and value != [] and value != {}


# --- Responses request -> chat request --------------------------------------------------------


def responses_to_chat_request(request: Mapping[str, Any], model: str) -> dict[str, Any]:
    """The chat request that asks `model` what the Responses `request` asks.

    Fields are mapped, dropped or refused as docs/openai-compat.md lists; fields this module
    does not know are dropped (a chat server may reject them, and none of them is chat's).
    """
    if request.get("store") is True:
        raise _refuse("store", "store: true is not supported: iop keeps no responses; send store: false")
    for field in ("previous_response_id", "conversation", "prompt"):
        if _present(request.get(field)):
            raise _refuse(field, f"{field} is not supported: {_NO_STATE}")
    if request.get("background") is True:
        raise _refuse("background", "background: true is not supported: iop answers while the client waits")
    if _present(request.get("top_logprobs")) or "message.output_text.logprobs" in (request.get("include") or []):
        raise _refuse("top_logprobs", "logprobs are not supported when translating Responses to chat")

    chat: dict[str, Any] = {"model": model, "messages": _messages(request)}
    tools = [_chat_tool(tool, f"tools[{i}]") for i, tool in enumerate(request.get("tools") or [])]
    if tools:
        chat["tools"] = tools
        # OpenAI rejects these two without tools; without tools they mean nothing anyway.
        if request.get("tool_choice") is not None:
            chat["tool_choice"] = _chat_tool_choice(request["tool_choice"])
        if request.get("parallel_tool_calls") is not None:
            chat["parallel_tool_calls"] = request["parallel_tool_calls"]
    for field in ("temperature", "top_p", "stop", "user"):
        if request.get(field) is not None:
            chat[field] = request[field]
    if request.get("max_output_tokens") is not None:
        chat["max_tokens"] = request["max_output_tokens"]
    reasoning = request.get("reasoning")
    if isinstance(reasoning, Mapping) and reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    text = request.get("text")
    if isinstance(text, Mapping) and (response_format := _chat_response_format(text.get("format"))):
        chat["response_format"] = response_format
    if request.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


def _messages(request: Mapping[str, Any]) -> list[dict[str, Any]]:
    # Leading system text (instructions, then developer/system items) becomes one system
    # message: many chat templates accept a single system message, and only first.
    system: list[str] = []
    if isinstance(request.get("instructions"), str) and request["instructions"]:
        system.append(request["instructions"])
    messages: list[dict[str, Any]] = []
    items = request.get("input")
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    elif items is None:
        items = []
    elif not isinstance(items, Sequence):
        raise BadRequest("input must be a string or a list of items", param="input")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise BadRequest(f"{where} must be an object", param=where)
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role in ("system", "developer"):
                text = _text_of(item.get("content"), f"{where}.content")
                if messages:
                    messages.append({"role": "system", "content": text})
                else:
                    system.append(text)
            elif role == "user":
                messages.append({"role": "user", "content": _chat_content(item.get("content"), where)})
            elif role == "assistant":
                messages.append({"role": "assistant", "content": _text_of(item.get("content"), f"{where}.content")})
            else:
                message = f"{where}.role {role!r} is not one of user, assistant, system, developer"
                raise BadRequest(message, param=f"{where}.role")
        elif kind == "function_call":
            call = {
                "id": item.get("call_id") or new_id("call_"),
                "type": "function",
                "function": {"name": item.get("name", ""), "arguments": item.get("arguments", "")},
            }
            last = messages[-1] if messages else None
            # Consecutive calls (and calls right after the assistant's text) are one chat turn.
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _text_of(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": content})
        elif kind == "reasoning":
            continue  # earlier reasoning (often encrypted, always upstream-specific) has no chat form
        elif kind == "item_reference":
            raise _refuse(where, f"input items of type item_reference are not supported: {_NO_STATE}")
        else:
            raise _refuse(where, f"input items of type {kind!r} are not supported by a chat-only model server")
    if system:
        messages.insert(0, {"role": "system", "content": "\n\n".join(system)})
    return messages


def _text_of(content: object, where: str) -> str:
    """The text of a content that may only hold text parts."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, Sequence):
        raise BadRequest(f"{where} must be a string or a list of content parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in ("input_text", "output_text", "text", "refusal"):
            raise _refuse(f"{where}[{j}]", f"content parts of type {kind!r} are not supported here (text only)")
        texts.append(str(part.get("refusal" if kind == "refusal" else "text", "")))
    return "\n".join(texts)


def _chat_content(content: object, where: str) -> str | list[dict[str, Any]]:
    """A user message's content: a plain string unless it holds images (servers take strings best)."""
    if not isinstance(content, Sequence) or isinstance(content, str):
        return _text_of(content, f"{where}.content")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if isinstance(part, Mapping) and kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        elif isinstance(part, Mapping) and kind == "input_image":
            if not part.get("image_url"):
                raise _refuse(f"{where}.content[{j}]", "input_image by file_id is not supported; send image_url")
            image: dict[str, Any] = {"url": part["image_url"]}
            if part.get("detail") is not None:
                image["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": image})
        else:
            message = f"content parts of type {kind!r} are not supported here (text and images only)"
            raise _refuse(f"{where}.content[{j}]", message)
    if all(part["type"] == "text" for part in parts):
        return "\n".join(part["text"] for part in parts)
    return parts


def _chat_tool(tool: object, where: str) -> dict[str, Any]:
    kind = tool.get("type") if isinstance(tool, Mapping) else None
    if not isinstance(tool, Mapping) or kind != "function":
        raise _refuse(where, f"tools of type {kind!r} are not supported by a chat-only model server: function only")
    function: dict[str, Any] = {"name": tool.get("name")}
    for field in ("description", "parameters", "strict"):
        if tool.get(field) is not None:
            function[field] = tool[field]
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: object) -> object:
    if choice in ("auto", "none", "required"):
        return choice
    kind = choice.get("type") if isinstance(choice, Mapping) else None
    if isinstance(choice, Mapping) and kind == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if isinstance(choice, Mapping) and kind == "allowed_tools":
        tools = []
        for tool in choice.get("tools") or []:
            if not isinstance(tool, Mapping) or tool.get("type") != "function":
                raise _refuse("tool_choice", "tool_choice.allowed_tools may only name function tools here")
            tools.append({"type": "function", "function": {"name": tool.get("name")}})
        return {"type": "allowed_tools", "allowed_tools": {"mode": choice.get("mode", "auto"), "tools": tools}}
    raise _refuse("tool_choice", f"tool_choice of type {kind!r} is not supported by a chat-only model server")


def _chat_response_format(fmt: object) -> dict[str, Any] | None:
    kind = fmt.get("type") if isinstance(fmt, Mapping) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if isinstance(fmt, Mapping) and kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": schema}
    raise _refuse("text.format", f"text.format of type {kind!r} is not supported")


# --- chat answer -> Responses answer ----------------------------------------------------------


def chat_to_responses_answer(body: Mapping[str, Any], request: Mapping[str, Any], model: str) -> dict[str, Any]:
    """The response object for a chat.completion `body`; `request` is the client's Responses request."""
    choices = body.get("choices")
    if not isinstance(choices, Sequence) or not choices or not isinstance(choices[0], Mapping):
        raise UpstreamError("upstream chat answer has no choices", code="upstream_error")
    choice = choices[0]
    message = as_mapping(choice.get("message"))
    finish_reason = choice.get("finish_reason")
    status = "completed" if final_status(finish_reason)[0] == "completed" else "incomplete"
    output: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if isinstance(reasoning, str) and reasoning:
        output.append(reasoning_item(new_id("rs_"), reasoning, status))
    text = _chat_text(message.get("content")) or _chat_text(message.get("refusal"))
    calls = [c for c in message.get("tool_calls") or [] if isinstance(c, Mapping)]
    if text or not calls:
        output.append(message_item(new_id("msg_"), text, status))
    for call in calls:
        function = as_mapping(call.get("function"))
        arguments = function.get("arguments", "")
        if not isinstance(arguments, str):  # some servers send an object
            arguments = _encode(arguments).decode()
        call_id = call.get("id") or new_id("call_")
        output.append(function_call_item(new_id("fc_"), call_id, function.get("name", ""), arguments, status))
    usage = usage_from_chat(body["usage"]) if isinstance(body.get("usage"), Mapping) else None
    return finish_response(response_object(request, model), output, usage, finish_reason)


def _chat_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):  # a few servers answer with content parts
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return ""


# --- chat request -> Responses request --------------------------------------------------------


def chat_to_responses_request(request: Mapping[str, Any], model: str) -> dict[str, Any]:
    """The Responses request that asks `model` what the chat `request` asks (never stored upstream)."""
    if request.get("n") not in (None, 1):
        raise _refuse("n", "n > 1 is not supported: a Responses upstream gives one answer per request")
    if request.get("store") is True:
        raise _refuse("store", "store: true is not supported: iop keeps no completions")
    refused = {
        "stop": "stop sequences are not supported by a Responses upstream",
        "logprobs": "logprobs are not supported when translating chat to Responses",
        "top_logprobs": "logprobs are not supported when translating chat to Responses",
        "audio": "audio output is not supported by a Responses upstream",
        "prediction": "predicted outputs are not supported by a Responses upstream",
        "web_search_options": "web search is not supported through translation",
        "functions": "legacy functions are not supported through translation; use tools",
        "function_call": "legacy function_call is not supported through translation; use tool_choice",
        "presence_penalty": "presence_penalty is not supported by a Responses upstream",
        "frequency_penalty": "frequency_penalty is not supported by a Responses upstream",
        "logit_bias": "logit_bias is not supported by a Responses upstream",
    }
    for field, message in refused.items():
        if _present(request.get(field)) and request.get(field) != 0:
            raise _refuse(field, message)
    if "audio" in (request.get("modalities") or []):
        raise _refuse("modalities", "audio output is not supported by a Responses upstream")

    instructions, items = _input_items(request.get("messages"))
    out: dict[str, Any] = {"model": model, "input": items, "store": False}
    if instructions:
        out["instructions"] = instructions
    tools = [_responses_tool(tool, f"tools[{i}]") for i, tool in enumerate(request.get("tools") or [])]
    if tools:
        out["tools"] = tools
    if request.get("tool_choice") is not None:
        out["tool_choice"] = _responses_tool_choice(request["tool_choice"])
    for field in ("temperature", "top_p", "parallel_tool_calls", "user", "safety_identifier", "prompt_cache_key"):
        if request.get(field) is not None:
            out[field] = request[field]
    max_tokens = request.get("max_completion_tokens") or request.get("max_tokens")
    if max_tokens is not None:
        out["max_output_tokens"] = max_tokens
    if request.get("reasoning_effort") is not None:
        out["reasoning"] = {"effort": request["reasoning_effort"]}
    text: dict[str, Any] = {}
    if (fmt := _responses_format(request.get("response_format"))) is not None:
        text["format"] = fmt
    if request.get("verbosity") is not None:
        text["verbosity"] = request["verbosity"]
    if text:
        out["text"] = text
    if request.get("stream"):
        out["stream"] = True
    return out


def _input_items(messages: object) -> tuple[str, list[dict[str, Any]]]:
    if not isinstance(messages, Sequence) or isinstance(messages, str):
        raise BadRequest("messages must be a list", param="messages")
    system: list[str] = []
    items: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, Mapping) else None
        if not isinstance(message, Mapping):
            raise BadRequest(f"{where} must be an object", param=where)
        content = message.get("content")
        if role in ("system", "developer"):
            text = _text_of(content, f"{where}.content")
            if items:
                items.append({"type": "message", "role": role, "content": text})
            else:
                system.append(text)  # leading system messages are the instructions
        elif role == "user":
            items.append({"type": "message", "role": "user", "content": _input_content(content, where)})
        elif role == "assistant":
            text = _text_of(content, f"{where}.content")
            if text:
                items.append({"type": "message", "role": "assistant", "content": text})
            for call in message.get("tool_calls") or []:
                function = call.get("function") or {}
                items.append(
                    {
                        "type": "function_call",
                        "call_id": call.get("id"),
                        "name": function.get("name"),
                        "arguments": function.get("arguments", ""),
                    }
                )
        elif role == "tool":
            output = _text_of(content, f"{where}.content")
            items.append({"type": "function_call_output", "call_id": message.get("tool_call_id"), "output": output})
        else:
            raise _refuse(where, f"messages with role {role!r} are not supported through translation")
    return "\n\n".join(system), items


def _input_content(content: object, where: str) -> str | list[dict[str, Any]]:
    if isinstance(content, str) or not isinstance(content, Sequence):
        return _text_of(content, f"{where}.content")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text":
            parts.append({"type": "input_text", "text": part.get("text", "")})
        elif kind == "image_url":
            image = part.get("image_url") or {}
            url = image if isinstance(image, str) else image.get("url")
            detail = image.get("detail", "auto") if isinstance(image, Mapping) else "auto"
            parts.append({"type": "input_image", "image_url": url, "detail": detail})
        elif kind == "file":
            file = part.get("file") or {}
            parts.append({"type": "input_file", **{k: v for k, v in file.items() if v is not None}})
        else:
            message = f"content parts of type {kind!r} are not supported through translation"
            raise _refuse(f"{where}.content[{j}]", message)
    return parts


def _responses_tool(tool: object, where: str) -> dict[str, Any]:
    kind = tool.get("type") if isinstance(tool, Mapping) else None
    function = tool.get("function") if isinstance(tool, Mapping) else None
    if kind != "function" or not isinstance(function, Mapping):
        raise _refuse(where, f"tools of type {kind!r} are not supported through translation: function only")
    out: dict[str, Any] = {"type": "function", "name": function.get("name")}
    if function.get("description") is not None:
        out["description"] = function["description"]
    out["parameters"] = function.get("parameters")
    # Responses functions are strict unless told otherwise; chat ones are not.
    out["strict"] = bool(function.get("strict", False))
    return out


def _responses_tool_choice(choice: object) -> object:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        function = choice.get("function") or {}
        return {"type": "function", "name": function.get("name")}
    if isinstance(choice, Mapping) and choice.get("type") == "allowed_tools":
        allowed = choice.get("allowed_tools") or {}
        names = [(t.get("function") or {}).get("name") for t in allowed.get("tools") or []]
        tools = [{"type": "function", "name": name} for name in names]
        return {"type": "allowed_tools", "mode": allowed.get("mode", "auto"), "tools": tools}
    raise _refuse("tool_choice", "tool_choice names a tool type that is not supported through translation")


def _responses_format(fmt: object) -> dict[str, Any] | None:
    kind = fmt.get("type") if isinstance(fmt, Mapping) else None
    if fmt is None:
        return None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if isinstance(fmt, Mapping) and kind == "json_schema":
        schema = fmt.get("json_schema") or {}
        return {"type": "json_schema", **{k: v for k, v in schema.items() if v is not None}}
    raise _refuse("response_format", f"response_format of type {kind!r} is not supported")


# --- Responses answer -> chat answer ----------------------------------------------------------


def responses_to_chat_answer(body: Mapping[str, Any], model: str) -> dict[str, Any]:
    """The chat.completion for a Responses response object `body`."""
    status = body.get("status")
    if status == "failed":
        error = as_mapping(body.get("error"))
        raise UpstreamError(f"upstream: {error.get('message', 'response failed')}", code="upstream_error")
    if status not in ("completed", "incomplete"):
        raise UpstreamError(f"upstream answered a response with status {status!r}", code="upstream_error")
    texts: list[str] = []
    refusals: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for item in body.get("output") or []:
        kind = item.get("type") if isinstance(item, Mapping) else None
        if kind == "message":
            for part in item.get("content") or []:
                if part.get("type") == "output_text":
                    texts.append(part.get("text", ""))
                elif part.get("type") == "refusal":
                    refusals.append(part.get("refusal", ""))
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning.extend(str(p.get("text", "")) for p in parts if isinstance(p, Mapping))
        elif kind == "function_call":
            function = {"name": item.get("name", ""), "arguments": item.get("arguments", "")}
            calls.append({"id": item.get("call_id") or new_id("call_"), "type": "function", "function": function})
    usage = usage_from_responses(body["usage"]) if isinstance(body.get("usage"), Mapping) else None
    content = "".join(texts) if texts or not (calls or refusals) else None
    created = body.get("created_at")
    return chat_completion(
        model,
        content,
        chat_finish_reason(body, bool(calls)),
        usage,
        tool_calls=calls,
        reasoning="".join(reasoning) or None,
        refusal="".join(refusals) or None,
        created=int(created) if isinstance(created, int | float) else None,
    )

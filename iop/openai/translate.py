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
    CALL_ID_PREFIX,
    call_item,
    final_status,
    finish_response,
    message_item,
    new_id,
    reasoning_item,
    response_object,
)
from iop.openai.responses_request import refuse, responses_to_chat_request, text_only
from iop.openai.tool_names import ToolMap
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


_refuse = refuse


def _present(value: object) -> bool:
    return value is not None and value is not False and value != [] and value != {}


# --- chat answer -> Responses answer ----------------------------------------------------------


def chat_to_responses_answer(
    body: Mapping[str, Any], request: Mapping[str, Any], model: str, tools: ToolMap | None = None
) -> dict[str, Any]:
    """The response object for a chat.completion `body`; `request` is the client's Responses request.

    Tool calls are decoded through `tools`, the request's ToolMap (rebuilt from `request` if not given).
    """
    tools = tools if tools is not None else ToolMap.of(request)
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
        origin = tools.origin(str(function.get("name") or ""))
        output.append(call_item(origin, new_id(CALL_ID_PREFIX[origin.kind]), call_id, arguments, status))
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
            text = text_only(content, f"{where}.content")
            if items:
                items.append({"type": "message", "role": role, "content": text})
            else:
                system.append(text)  # leading system messages are the instructions
        elif role == "user":
            items.append({"type": "message", "role": "user", "content": _input_content(content, where)})
        elif role == "assistant":
            text = text_only(content, f"{where}.content")
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
            output = text_only(content, f"{where}.content")
            items.append({"type": "function_call_output", "call_id": message.get("tool_call_id"), "output": output})
        else:
            raise _refuse(where, f"messages with role {role!r} are not supported through translation")
    return "\n\n".join(system), items


def _input_content(content: object, where: str) -> str | list[dict[str, Any]]:
    if isinstance(content, str) or not isinstance(content, Sequence):
        return text_only(content, f"{where}.content")
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

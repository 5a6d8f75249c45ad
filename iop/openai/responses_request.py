"""A Responses request as a chat request, for chat-only model servers (see docs/openai-compat.md).

Codex CLI is the client this is built against (its observed requests are the test tables): every
tool it offers becomes a chat function through the request's `ToolMap`, every item of its history
becomes chat messages, hosted tools and items a chat server cannot use are dropped. State (stored
responses, references) is expanded by the edge first; what needs state iop does not keep is
refused, naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from iop.errors import BadRequest
from iop.openai.responses_events import new_id
from iop.openai.tool_names import Origin, ToolMap

NO_STATE = "iop keeps no conversations or prompts; send the conversation in `input` or use `previous_response_id`"
# The edge expands stored state before dispatch (iop/responses): what reaches a node still naming
# it came around the edge, and a node has no store to read.
UNEXPANDED = "it is expanded by the edge, and this request did not come through one"
IMAGE_PLACEHOLDER = "[image omitted: this model takes text only]"
# Items of other APIs' hosted tools and of server-side compaction: a chat model cannot use them,
# and Codex only sends them in sessions begun with another provider.
DROPPED_ITEMS = frozenset(
    {
        "web_search_call",
        "image_generation_call",
        "file_search_call",
        "code_interpreter_call",
        "computer_call",
        "computer_call_output",
        "local_shell_call",
        "local_shell_call_output",
        "shell_call",
        "shell_call_output",
        "apply_patch_call",
        "apply_patch_call_output",
        "mcp_call",
        "mcp_list_tools",
        "mcp_approval_request",
        "mcp_approval_response",
        "compaction",
        "compaction_summary",
        "compaction_trigger",
        "agent_message",
        "additional_tools",  # its tools join the chat `tools` (ToolMap); it has no message
    }
)


def refuse(param: str, message: str) -> BadRequest:
    return BadRequest(message, param=param, code="unsupported_parameter")


def _present(value: object) -> bool:
    return value is not None and value is not False and value != [] and value != {}


def _is_map(value: object) -> bool:
    """isinstance(value, Mapping), a decoded request's dict first: the ABC's check costs 150 ns
    against 20, several times per input item (the 3 MB fixture's translation 12 % faster)."""
    return type(value) is dict or isinstance(value, Mapping)


def check_stateless(request: Mapping[str, Any]) -> None:
    """Refuse what needs state iop does not keep, or output a chat server cannot give.

    The edge runs this too, for a pool that mixes chat-only and Responses providers: a request
    must get the same decision whichever provider the pool picks.
    """
    if request.get("store") is True:
        raise refuse("store", f"store: true is not supported here: {UNEXPANDED}")
    if _present(request.get("previous_response_id")):
        raise refuse("previous_response_id", f"previous_response_id is not supported here: {UNEXPANDED}")
    for field in ("conversation", "prompt"):
        if _present(request.get(field)):
            raise refuse(field, f"{field} is not supported: {NO_STATE}")
    if request.get("background") is True:
        raise refuse("background", "background: true is not supported: iop answers while the client waits")
    if _present(request.get("top_logprobs")) or "message.output_text.logprobs" in (request.get("include") or []):
        raise refuse("top_logprobs", "logprobs are not supported when translating Responses to chat")
    items = request.get("input")
    if isinstance(items, Sequence) and not isinstance(items, str):
        for i, item in enumerate(items):
            if _is_map(item) and item.get("type") == "item_reference":
                raise refuse(f"input[{i}]", f"input items of type item_reference are not supported here: {UNEXPANDED}")


def responses_to_chat_request(
    request: Mapping[str, Any],
    model: str,
    *,
    tools: ToolMap | None = None,
    vision: bool = False,
    replay_reasoning: bool = False,
) -> dict[str, Any]:
    """The chat request that asks `model` what the Responses `request` asks.

    `tools` is the request's ToolMap (built here when not given; the answer side needs the same
    one). `vision`: the model takes images (else they become a text placeholder). `replay_reasoning`:
    earlier reasoning goes back as the assistant's `reasoning_content` (else it is dropped).
    Fields this module does not know are dropped: a chat server may reject them.
    """
    check_stateless(request)
    tools = tools if tools is not None else ToolMap.of(request)
    chat: dict[str, Any] = {
        "model": model,
        "messages": _Messages(tools, vision, replay_reasoning).of(request),
    }
    if tools.tools:
        chat["tools"] = tools.tools
        # OpenAI rejects these two without tools; without tools they mean nothing anyway.
        if request.get("tool_choice") is not None and (choice := _chat_tool_choice(request["tool_choice"], tools)):
            chat["tool_choice"] = choice
        if request.get("parallel_tool_calls") is not None:
            chat["parallel_tool_calls"] = request["parallel_tool_calls"]
    for field in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "stop", "user"):
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


class _Messages:
    """The chat messages of a Responses `instructions` + `input`."""

    def __init__(self, tools: ToolMap, vision: bool, replay_reasoning: bool) -> None:
        self.tools = tools
        self.vision = vision
        self.replay_reasoning = replay_reasoning
        self.system: list[str] = []
        self.messages: list[dict[str, Any]] = []
        self.reasoning: list[str] = []

    def of(self, request: Mapping[str, Any]) -> list[dict[str, Any]]:
        # Leading system text (instructions, then developer/system items) becomes one system
        # message: many chat templates accept a single system message, and only first.
        if isinstance(request.get("instructions"), str) and request["instructions"]:
            self.system.append(request["instructions"])
        items = request.get("input")
        if isinstance(items, str):
            items = [{"type": "message", "role": "user", "content": items}]
        elif items is None:
            items = []
        elif not isinstance(items, Sequence):
            raise BadRequest("input must be a string or a list of items", param="input")
        for i, item in enumerate(items):
            where = f"input[{i}]"
            if not _is_map(item):
                raise BadRequest(f"{where} must be an object", param=where)
            self._item(item, where)
        if self.system:
            self.messages.insert(0, {"role": "system", "content": "\n\n".join(self.system)})
        return self.messages

    def _item(self, item: Mapping[str, Any], where: str) -> None:
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            self._message(item, where)
        elif kind == "function_call":
            origin = Origin("function", str(item.get("name") or ""), _namespace(item))
            self._call(item, origin, _string_arguments(item.get("arguments")))
        elif kind == "custom_tool_call":
            origin = Origin("custom", str(item.get("name") or ""), _namespace(item))
            self._call(item, origin, json.dumps({"input": str(item.get("input") or "")}, ensure_ascii=False))
        elif kind == "tool_search_call":
            self._call(item, Origin("tool_search", "tool_search"), _string_arguments(item.get("arguments")))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            content = self._content(item.get("output"), f"{where}.output", tool=True)
            self.messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": content})
        elif kind == "tool_search_output":
            # The found tools joined the chat `tools` (ToolMap); the model reads which they are.
            names = [self.tools.name(o) for o in _found(item.get("tools"))]
            found = ", ".join(names) if names else "none"
            content = f"Tools found and now available: {found}"
            self.messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": content})
        elif kind == "reasoning":
            # Earlier reasoning (often encrypted, always model-specific) has no chat field, except
            # for servers whose templates interleave thinking with tool calls.
            if self.replay_reasoning and (text := _reasoning_text(item)):
                self.reasoning.append(text)
        elif kind == "item_reference":
            raise refuse(where, f"input items of type item_reference are not supported here: {UNEXPANDED}")
        elif kind in DROPPED_ITEMS or isinstance(kind, str):
            return  # hosted-tool, compaction and unknown items: nothing a chat model can use
        else:
            raise BadRequest(f"{where}.type must be a string", param=f"{where}.type")

    def _message(self, item: Mapping[str, Any], where: str) -> None:
        role = item.get("role")
        if role in ("system", "developer"):
            text = text_only(item.get("content"), f"{where}.content")
            if self.messages:
                self.messages.append({"role": "system", "content": text})
            else:
                self.system.append(text)
        elif role == "user":
            self.messages.append({"role": "user", "content": self._content(item.get("content"), f"{where}.content")})
        elif role == "assistant":
            self._assistant()["content"] = text_only(item.get("content"), f"{where}.content")
        else:
            message = f"{where}.role {role!r} is not one of user, assistant, system, developer"
            raise BadRequest(message, param=f"{where}.role")

    def _assistant(self) -> dict[str, Any]:
        """A new assistant message, carrying the reasoning that came before it when replayed."""
        message: dict[str, Any] = {"role": "assistant", "content": None}
        if self.reasoning:
            message["reasoning_content"] = "\n\n".join(self.reasoning)
            self.reasoning = []
        self.messages.append(message)
        return message

    def _call(self, item: Mapping[str, Any], origin: Origin, arguments: str) -> None:
        call = {
            "id": item.get("call_id") or new_id("call_"),
            "type": "function",
            "function": {"name": self.tools.name(origin), "arguments": arguments},
        }
        last = self.messages[-1] if self.messages else None
        # Consecutive calls (and calls right after the assistant's text) are one chat turn.
        if last is None or last["role"] != "assistant" or self.reasoning:
            last = self._assistant()
        last.setdefault("tool_calls", []).append(call)

    def _content(self, content: object, where: str, tool: bool = False) -> str | list[dict[str, Any]]:
        """User or tool content: a plain string unless it keeps images (servers take strings best)."""
        if isinstance(content, str) or content is None:
            return content or ""
        if not isinstance(content, Sequence):
            raise BadRequest(f"{where} must be a string or a list of content parts", param=where)
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(content):
            kind = part.get("type") if (mapping := _is_map(part)) else None
            if mapping and kind in ("input_text", "output_text", "text"):
                parts.append({"type": "text", "text": str(part.get("text", ""))})
            elif mapping and kind == "input_image":
                if self.vision and isinstance(part.get("image_url"), str) and part["image_url"]:
                    image: dict[str, Any] = {"url": part["image_url"]}
                    if part.get("detail") is not None and part["detail"] != "original":
                        image["detail"] = part["detail"]
                    parts.append({"type": "image_url", "image_url": image})
                else:
                    # A text-only model (or an image by file_id, which iop cannot fetch): say
                    # there was one rather than fail the whole turn.
                    parts.append({"type": "text", "text": IMAGE_PLACEHOLDER})
            elif tool and mapping and kind in ("input_file", "file"):
                name = part.get("filename") or part.get("file_id") or "a file"
                parts.append({"type": "text", "text": f"[file omitted: {name}]"})
            else:
                allowed = "text and images only"
                message = f"content parts of type {kind!r} are not supported here ({allowed})"
                raise refuse(f"{where}[{j}]", message)
        if all(part["type"] == "text" for part in parts):
            return "\n".join(part["text"] for part in parts)
        return parts


def _namespace(item: Mapping[str, Any]) -> str | None:
    namespace = item.get("namespace")
    return namespace if isinstance(namespace, str) and namespace else None


def _string_arguments(arguments: object) -> str:
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)


def _found(tools: object) -> list[Origin]:
    """The Origins of the tools a tool_search_output found (namespaces by their children)."""
    if not isinstance(tools, Sequence) or isinstance(tools, str):
        return []
    origins: list[Origin] = []
    for tool in tools:
        if not isinstance(tool, Mapping):
            continue
        if tool.get("type") == "namespace":
            ns = str(tool.get("name") or "")
            for child in tool.get("tools") or []:
                if isinstance(child, Mapping) and child.get("type") in ("function", "custom"):
                    origins.append(Origin(child["type"], str(child.get("name") or ""), ns))
        elif tool.get("type") in ("function", "custom"):
            origins.append(Origin(tool["type"], str(tool.get("name") or "")))
    return origins


def _reasoning_text(item: Mapping[str, Any]) -> str:
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, Sequence):
        return ""
    return "\n".join(str(p.get("text", "")) for p in parts if isinstance(p, Mapping) and p.get("text"))


def text_only(content: object, where: str) -> str:
    """The text of a content that may only hold text (system, developer and assistant messages)."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, Sequence):
        raise BadRequest(f"{where} must be a string or a list of content parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if _is_map(part) else None
        if kind not in ("input_text", "output_text", "text", "refusal"):
            raise refuse(f"{where}[{j}]", f"content parts of type {kind!r} are not supported here (text only)")
        texts.append(str(part.get("refusal" if kind == "refusal" else "text", "")))
    return "\n".join(texts)


def _chat_tool_choice(choice: object, tools: ToolMap) -> object:
    """The chat tool_choice, or None when it names a tool that was dropped (the model picks)."""
    if choice in ("auto", "none", "required"):
        return choice
    kind = choice.get("type") if isinstance(choice, Mapping) else None
    if isinstance(choice, Mapping) and kind in ("function", "custom"):
        name = tools.name(Origin(kind, str(choice.get("name") or ""), _namespace(choice)))
        return {"type": "function", "function": {"name": name}}
    if isinstance(choice, Mapping) and kind == "allowed_tools":
        allowed = []
        for tool in choice.get("tools") or []:
            tool_kind = tool.get("type") if isinstance(tool, Mapping) else None
            if isinstance(tool, Mapping) and tool_kind in ("function", "custom"):
                name = tools.name(Origin(tool_kind, str(tool.get("name") or ""), _namespace(tool)))
                allowed.append({"type": "function", "function": {"name": name}})
        if not allowed:
            return None
        return {"type": "allowed_tools", "allowed_tools": {"mode": choice.get("mode", "auto"), "tools": allowed}}
    if isinstance(choice, Mapping) and kind == "tool_search":
        return {"type": "function", "function": {"name": tools.name(Origin("tool_search", "tool_search"))}}
    return None  # a hosted tool type: the tool itself was dropped


def _chat_response_format(fmt: object) -> dict[str, Any] | None:
    kind = fmt.get("type") if isinstance(fmt, Mapping) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if isinstance(fmt, Mapping) and kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": schema}
    raise refuse("text.format", f"text.format of type {kind!r} is not supported")

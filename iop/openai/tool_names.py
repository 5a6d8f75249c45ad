"""Responses tools as chat functions, and the per-request name map that turns chat calls back.

A chat server knows only flat functions. A Responses client (Codex CLI above all) also offers
namespaces of functions, freeform `custom` tools and `tool_search`, and expects each call back in
its own shape. `ToolMap.of(request)` flattens every tool the request offers (top-level `tools`,
`additional_tools` items, tools found by `tool_search_output` items) into chat functions and keeps
`chat name -> Origin` for the answer. The map is a plain function of the request, so the request
and answer sides build the same one.

Names: a plain function keeps its name; a namespace child is `<namespace>__<child>`; anything
that is not a chat-safe name (`[A-Za-z0-9_-]{1,64}`) or is already taken gets a hashed alias.
A name is only ever looked up in the map, never split (`mcp__demo__echo_text` is ambiguous).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from iop.errors import BadRequest

Kind = Literal["function", "custom", "tool_search"]

_CHAT_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
MAX_NAME = 64
CUSTOM_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"input": {"type": "string", "description": "The whole input of the tool, as free text."}},
    "required": ["input"],
}
TOOL_SEARCH_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"query": {"type": "string"}, "limit": {"type": "number"}},
    "required": ["query"],
}


@dataclass(frozen=True)
class Origin:
    """What a chat function stands for: the tool's kind, its name and its namespace (if any)."""

    kind: Kind
    name: str
    namespace: str | None = None


@dataclass
class _Offered:
    origin: Origin
    description: str | None
    parameters: object
    strict: object


class ToolMap:
    """The chat `tools` for one request, and the reversible map between chat names and Origins."""

    def __init__(self) -> None:
        self.tools: list[dict[str, Any]] = []
        """The chat `tools` array, in the order the request offered them."""
        self.dropped: list[str] = []
        """Types of tools a chat server cannot run (hosted tools), each once, in order."""
        self._by_chat: dict[str, Origin] = {}
        self._by_origin: dict[Origin, str] = {}

    @classmethod
    def of(cls, request: Mapping[str, Any]) -> ToolMap:
        tools = cls()
        offered: list[_Offered] = []
        for tool, where in _offered_tools(request):
            offered.extend(tools._flatten(tool, where))
        # Plain functions first: they keep their names whatever the namespaces are called.
        ordered = sorted(offered, key=lambda o: o.origin.namespace is not None or o.origin.kind != "function")
        for o in ordered:
            tools.name(o.origin)
        seen: set[Origin] = set()
        for o in offered:
            if o.origin in seen:
                continue  # offered twice (top level and found again by a tool search): one chat tool
            seen.add(o.origin)
            function: dict[str, Any] = {"name": tools._by_origin[o.origin]}
            if o.description is not None:
                function["description"] = o.description
            if o.parameters is not None:
                function["parameters"] = o.parameters
            if o.strict is not None:
                function["strict"] = o.strict
            tools.tools.append({"type": "function", "function": function})
        return tools

    def name(self, origin: Origin) -> str:
        """The chat name of `origin` (a new one if the request did not offer it: history may name it)."""
        known = self._by_origin.get(origin)
        if known is not None:
            return known
        plain = origin.name if origin.namespace is None else f"{origin.namespace}__{origin.name}"
        if origin.kind == "tool_search" and origin.namespace is None:
            plain = "tool_search"
        name = plain
        if not _CHAT_NAME.fullmatch(name) or name in self._by_chat:
            digest = hashlib.sha256(f"{origin.kind}\0{origin.namespace}\0{origin.name}".encode()).hexdigest()
            stem = _UNSAFE.sub("_", plain)[: MAX_NAME - 13] or "tool"
            name = f"{stem}_{digest[:12]}"
            n = 1
            while name in self._by_chat:  # a second hash collision: still never two origins per name
                name = f"{stem[: MAX_NAME - 17]}_{digest[:12]}_{n:03d}"
                n += 1
        self._by_chat[name] = origin
        self._by_origin[origin] = name
        return name

    def origin(self, chat_name: str) -> Origin:
        """What a chat call names; a name the request never offered is a plain function of that name."""
        return self._by_chat.get(chat_name) or Origin("function", chat_name)

    def _flatten(self, tool: object, where: str, namespace: str | None = None) -> Iterator[_Offered]:
        if not isinstance(tool, Mapping):
            raise BadRequest(f"{where} must be an object", param=where)
        kind = tool.get("type")
        if kind in ("function", "custom") or (kind == "tool_search" and namespace is None):
            name = tool.get("name") if kind != "tool_search" else "tool_search"
            if not isinstance(name, str) or not name:
                raise BadRequest(f"{where}.name must be a non-empty string", param=f"{where}.name")
            description = tool.get("description")
            description = description if isinstance(description, str) else None
            if kind == "function":
                yield _Offered(
                    Origin("function", name, namespace), description, tool.get("parameters"), tool.get("strict")
                )
            elif kind == "custom":
                yield _Offered(Origin("custom", name, namespace), _custom_description(tool), CUSTOM_PARAMETERS, None)
            else:
                parameters = tool.get("parameters") or TOOL_SEARCH_PARAMETERS
                yield _Offered(Origin("tool_search", "tool_search"), description, parameters, None)
        elif kind == "namespace" and namespace is None:
            ns = tool.get("name")
            if not isinstance(ns, str) or not ns:
                raise BadRequest(f"{where}.name must be a non-empty string", param=f"{where}.name")
            for j, child in enumerate(tool.get("tools") or []):
                yield from self._flatten(child, f"{where}.tools[{j}]", ns)
        else:
            # Hosted tools (web_search, file_search, mcp, ...) run on OpenAI's side; a chat
            # server cannot, and a client like Codex never needs them: drop, and say so.
            label = kind if isinstance(kind, str) and kind else "unknown"
            if label not in self.dropped:
                self.dropped.append(label)


def _custom_description(tool: Mapping[str, Any]) -> str:
    description = tool.get("description") if isinstance(tool.get("description"), str) else ""
    fmt = tool.get("format")
    if isinstance(fmt, Mapping) and fmt.get("type") == "grammar" and isinstance(fmt.get("definition"), str):
        syntax = fmt.get("syntax") or "lark"
        grammar = (
            f"Put the whole input in the `input` string; it must follow this {syntax} grammar:\n{fmt['definition']}"
        )
        return f"{description}\n\n{grammar}" if description else grammar
    return description or "Put the whole input of the tool in the `input` string."


def _offered_tools(request: Mapping[str, Any]) -> Iterator[tuple[object, str]]:
    """Every tool the request offers, with where it was: top-level, additional_tools, tool_search_output."""
    tools = request.get("tools")
    if isinstance(tools, Sequence) and not isinstance(tools, str):
        for i, tool in enumerate(tools):
            yield tool, f"tools[{i}]"
    items = request.get("input")
    if not isinstance(items, Sequence) or isinstance(items, str):
        return
    for i, item in enumerate(items):
        mapping = type(item) is dict or isinstance(item, Mapping)  # a dict first: the ABC's check is 150 ns
        if mapping and item.get("type") in ("additional_tools", "tool_search_output"):
            found = item.get("tools")
            if isinstance(found, Sequence) and not isinstance(found, str):
                for j, tool in enumerate(found):
                    yield tool, f"input[{i}].tools[{j}]"

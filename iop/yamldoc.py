"""The deployment file as YAML with positions: each path's line and column, and problems at paths.

Problems are reported in document order, with the path a person can find (`nodes[0].id`); the
structural check (`validate`) and the cross-check (`crosscheck`) both speak in these terms.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import yaml

Path = tuple[str | int, ...]
Position = tuple[int, int]


def render(path: Path) -> str:
    """`("nodes", 0, "id")` → `nodes[0].id`."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


@dataclass(frozen=True)
class Problem:
    """One thing wrong (or worth a warning) at one place in the document."""

    path: Path
    message: str

    def __str__(self) -> str:
        return f"{render(self.path)}: {self.message}" if self.path else self.message


@dataclass
class Document:
    """Parsed YAML plus where each path starts, so problems can be reported in document order."""

    data: Any
    positions: dict[Path, Position] = field(default_factory=dict)
    duplicate_keys: list[Problem] = field(default_factory=list)

    def position(self, path: Path) -> Position:
        # A missing field has no position of its own; its parent mapping's is the next best thing.
        for end in range(len(path), -1, -1):
            pos = self.positions.get(path[:end])
            if pos is not None:
                return pos
        return (0, 0)

    def in_order(self, problems: Iterable[Problem]) -> list[Problem]:
        return sorted(problems, key=lambda p: self.position(p.path))


class YamlSyntaxError(Exception):
    """The text is not YAML; `line` and `column` are 1-based when known."""

    def __init__(self, message: str, line: int | None, column: int | None) -> None:
        super().__init__(message)
        self.message = message
        self.line = line
        self.column = column


def read_yaml(text: str) -> Document | None:
    """Parse one YAML document keeping positions; None for a document with no content at all."""
    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            return None
        doc = Document(data=None)
        # Index before constructing: construction flattens `<<` merge keys into their mapping,
        # which would look like duplicate keys.
        _index(root, (), doc, set())
        doc.data = loader.construct_document(root)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        what = exc.problem or exc.context or "not valid YAML"
        if exc.problem and exc.context:
            what += f" ({exc.context})"
        raise YamlSyntaxError(what, mark.line + 1 if mark else None, mark.column + 1 if mark else None) from exc
    except yaml.YAMLError as exc:
        raise YamlSyntaxError(str(exc), None, None) from exc
    finally:
        loader.dispose()
    return doc


def _index(node: yaml.Node, path: Path, doc: Document, active: set[int]) -> None:
    if id(node) in active:
        mark = node.start_mark
        raise YamlSyntaxError("an alias refers to a node that contains it", mark.line + 1, mark.column + 1)
    doc.positions.setdefault(path, (node.start_mark.line, node.start_mark.column))
    if not isinstance(node, yaml.MappingNode | yaml.SequenceNode):
        return
    active.add(id(node))
    if isinstance(node, yaml.MappingNode):
        seen: dict[object, int] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            line = key_node.start_mark.line + 1
            if key is None:
                continue
            child = (*path, key)
            if key in seen:
                doc.duplicate_keys.append(Problem(child, f"duplicate key (also on line {seen[key]})"))
            seen[key] = line
            doc.positions[child] = (key_node.start_mark.line, key_node.start_mark.column)
            _index(value_node, child, doc, active)
    else:
        for i, item in enumerate(node.value):
            _index(item, (*path, i), doc, active)
    active.discard(id(node))

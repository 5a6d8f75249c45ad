"""Check YAML data against msgspec types, collecting every problem with its path and position.

msgspec stops at the first invalid value; a person fixing a deployment file wants the whole list at
once. So the walker here reads the Struct definitions (`msgspec.inspect`) and the raw YAML data side
by side, and `msgspec.convert` runs only once the data is known to be clean. The rules that relate
one part of the file to another (unique ids, references, capacity, credentials) are `CrossCheck`.
"""

from __future__ import annotations

import difflib
import ipaddress
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

import msgspec.inspect as mi

from iop.yamldoc import Path, Problem

ID_PATTERN = r"^[A-Za-z0-9_-]+$"
"""Node, adapter and provider ids: they become NATS subject tokens."""

Format = Callable[[str], str | None]
"""A named check of a string value (`Meta(extra={"format": name})`): a problem message or None."""


def suggest(word: str, choices: Iterable[str]) -> str | None:
    """The closest of `choices` to a misspelt `word`, if any is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return close[0] if close else None


def _got(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        text = repr(value)
        return text if len(text) <= 40 else text[:37] + "...'"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return f"a {type(value).__name__}"


class Checker:
    """Walks data against a `msgspec.inspect` type; `formats` name extra checks for strings."""

    def __init__(self, formats: Mapping[str, Format]) -> None:
        self.formats = formats

    def check(self, value: object, t: mi.Type, path: Path = ()) -> list[Problem]:
        out: list[Problem] = []
        self._check(value, t, path, out)
        return out

    def _check(self, value: object, t: mi.Type, path: Path, out: list[Problem]) -> None:
        fmt: str | None = None
        while isinstance(t, mi.Metadata):
            if t.extra and "format" in t.extra:
                fmt = t.extra["format"]
            t = t.type
        if isinstance(t, mi.UnionType):
            self._union(value, t, path, out, fmt)
        elif isinstance(t, mi.StructType):
            if not isinstance(value, dict):
                out.append(Problem(path, f"expected a mapping, got {_got(value)}"))
            else:
                self._struct(value, t, path, out)
        elif isinstance(t, mi.ListType):
            if not isinstance(value, list):
                out.append(Problem(path, f"expected a list, got {_got(value)}"))
                return
            if t.min_length and len(value) < t.min_length:
                need = "must not be empty" if t.min_length == 1 else f"needs at least {t.min_length} items"
                out.append(Problem(path, need))
            for i, item in enumerate(value):
                self._check(item, t.item_type, (*path, i), out)
        elif isinstance(t, mi.DictType):
            if not isinstance(value, dict):
                out.append(Problem(path, f"expected a mapping, got {_got(value)}"))
                return
            for key, item in value.items():
                self._check(key, t.key_type, (*path, str(key)), out)
                self._check(item, t.value_type, (*path, str(key)), out)
        elif isinstance(t, mi.StrType):
            self._str(value, t, path, out, fmt)
        elif isinstance(t, mi.IntType | mi.FloatType):
            self._number(value, t, path, out)
        elif isinstance(t, mi.LiteralType):
            if value not in t.values:
                allowed = ", ".join(str(v) for v in t.values)
                near = suggest(value, map(str, t.values)) if isinstance(value, str) else None
                hint = f"; did you mean {near!r}?" if near else ""
                out.append(Problem(path, f"expected one of {allowed}, got {_got(value)}{hint}"))
        elif isinstance(t, mi.BoolType):
            if not isinstance(value, bool):
                out.append(Problem(path, f"expected true or false, got {_got(value)}"))
        elif isinstance(t, mi.NoneType):
            if value is not None:
                out.append(Problem(path, f"expected null, got {_got(value)}"))
        elif not isinstance(t, mi.AnyType):
            raise TypeError(f"the config checker does not handle {t!r} yet")

    def _union(self, value: object, t: mi.UnionType, path: Path, out: list[Problem], fmt: str | None) -> None:
        if value is None and t.includes_none:
            return
        members = [m for m in t.types if not isinstance(m, mi.NoneType)]
        if members and all(isinstance(m, mi.StructType) and m.tag is not None for m in members):
            self._tagged(value, [m for m in members if isinstance(m, mi.StructType)], path, out)
        elif len(members) == 1:
            self._check(value, _with_format(members[0], fmt), path, out)
        else:
            attempts = [self.check(value, m, path) for m in members]
            if all(attempts):
                # A list is told what is wrong inside it, not that it should have been a string.
                same_kind = [
                    a for m, a in zip(members, attempts, strict=True) if _is_list(m) == isinstance(value, list)
                ]
                out.extend(same_kind[0] if same_kind else attempts[0])

    def _tagged(self, value: object, members: list[mi.StructType], path: Path, out: list[Problem]) -> None:
        if not isinstance(value, dict):
            out.append(Problem(path, f"expected a mapping, got {_got(value)}"))
            return
        tag_field = members[0].tag_field or "type"
        by_tag = {str(m.tag): m for m in members}
        known = ", ".join(by_tag)
        tag = value.get(tag_field)
        if tag is None:
            out.append(Problem((*path, tag_field), f"missing (required: one of {known})"))
        elif not isinstance(tag, str) or tag not in by_tag:
            hint = suggest(tag, by_tag) if isinstance(tag, str) else None
            near = f"; did you mean {hint!r}?" if hint else ""
            out.append(Problem((*path, tag_field), f"unknown type {_got(tag)} (known types: {known}){near}"))
        else:
            self._struct(value, by_tag[tag], path, out)

    def _struct(self, value: dict[Any, Any], t: mi.StructType, path: Path, out: list[Problem]) -> None:
        fields = {f.encode_name: f for f in t.fields}
        known = [*([t.tag_field] if t.tag_field else []), *fields]
        for key, item in value.items():
            name = str(key)
            f = fields.get(name) if isinstance(key, str) else None
            if f is not None:
                self._check(item, f.type, (*path, name), out)
            elif name == t.tag_field:
                continue
            elif t.forbid_unknown_fields:
                hint = suggest(name, known)
                detail = f"did you mean {hint!r}?" if hint else f"known fields: {', '.join(known)}"
                out.append(Problem((*path, name), f"unknown field; {detail}"))
        for f in t.fields:
            if f.required and f.encode_name not in value:
                out.append(Problem((*path, f.encode_name), "missing (required)"))

    def _str(self, value: object, t: mi.StrType, path: Path, out: list[Problem], fmt: str | None) -> None:
        if not isinstance(value, str):
            out.append(Problem(path, f"expected a string, got {_got(value)}"))
            return
        if fmt is not None:
            # A named format knows how to explain itself better than a bare regular expression.
            message = self.formats[fmt](value)
            if message:
                out.append(Problem(path, message))
        elif t.min_length and len(value) < t.min_length:
            out.append(Problem(path, "must not be empty"))
        elif t.pattern and not re.search(t.pattern, value):
            out.append(Problem(path, f"{_got(value)} does not match {t.pattern}"))

    def _number(self, value: object, t: mi.IntType | mi.FloatType, path: Path, out: list[Problem]) -> None:
        # bool is an int to Python but not to msgspec; a float is never an int, even 2.0.
        is_int = isinstance(value, int) and not isinstance(value, bool)
        if isinstance(t, mi.IntType) and not is_int:
            out.append(Problem(path, f"expected an integer, got {_got(value)}"))
            return
        if not (is_int or isinstance(value, float)):
            out.append(Problem(path, f"expected a number, got {_got(value)}"))
            return
        assert isinstance(value, int | float)
        bounds = (
            (t.ge, value >= t.ge if t.ge is not None else True, "at least"),
            (t.gt, value > t.gt if t.gt is not None else True, "greater than"),
            (t.le, value <= t.le if t.le is not None else True, "at most"),
            (t.lt, value < t.lt if t.lt is not None else True, "less than"),
        )
        for bound, ok, words in bounds:
            if not ok:
                out.append(Problem(path, f"must be {words} {bound}, got {_got(value)}"))
                return


def _is_list(t: mi.Type) -> bool:
    while isinstance(t, mi.Metadata):
        t = t.type
    return isinstance(t, mi.ListType)


def _with_format(t: mi.Type, fmt: str | None) -> mi.Type:
    return mi.Metadata(t, extra={"format": fmt}) if fmt is not None else t


def is_loopback(host: str) -> bool:
    """Whether `host` (of a listen address) is only reachable from this machine."""
    host = host.removeprefix("[").removesuffix("]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # another host name: it may resolve to anything


# --- string formats named by `Meta(extra={"format": ...})` in the Structs ----------------------


def _id_problem(value: str) -> str | None:
    if not value:
        return "must not be empty"
    if re.match(ID_PATTERN, value):
        return None
    return (
        f"{value!r} is not a valid id: use only letters, digits, '_' and '-' "
        "(ids become NATS subject tokens, where '.', '*', '>' and spaces have meaning)"
    )


def _alias_problem(value: str) -> str | None:
    if not value:
        return "must not be empty"
    return f"{value!r}: an alias may not contain whitespace" if re.search(r"\s", value) else None


def _port_ok(port: str) -> bool:
    # 0 asks the OS for a free port: `iop smoke` runs its own edge that way, and reads the bound ports back.
    return re.fullmatch(r"[0-9]{1,5}", port) is not None and 0 <= int(port) <= 65535


def _address_problem(value: str) -> str | None:
    host, sep, port = value.rpartition(":")
    if sep and host and not re.search(r"\s", host) and _port_ok(port):
        return None
    return f"expected host:port with a port from 0 to 65535, got {value!r}"


def _url_ok(value: str, schemes: tuple[str, ...]) -> bool:
    try:
        url = urlsplit(value)
        _ = url.port  # raises on a port that is not a number in range
    except ValueError:
        return False
    return url.scheme in schemes and bool(url.hostname)


def _nats_url_problem(value: str) -> str | None:
    if value == "embedded":
        return None
    for item in value.split(","):
        if not _url_ok(item.strip(), ("nats", "tls")):
            return f"expected 'embedded' or comma-separated nats:// or tls:// URLs, and {item.strip()!r} is not one"
    return None


def _http_url_problem(value: str) -> str | None:
    if _url_ok(value, ("http", "https")):
        return None
    return f"expected an http:// or https:// URL with a host, got {value!r}"


def _env_problem(value: str) -> str | None:
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
        return None
    return f"{value!r} is not an environment variable name (letters, digits, '_'; not starting with a digit)"


def _regex_problem(value: str) -> str | None:
    try:
        re.compile(value)
    except re.error as exc:
        return f"{value!r} is not a regular expression: {exc}"
    return None


FORMATS: dict[str, Format] = {
    "id": _id_problem,
    "alias": _alias_problem,
    "address": _address_problem,
    "nats_url": _nats_url_problem,
    "http_url": _http_url_problem,
    "env": _env_problem,
    "regex": _regex_problem,
}


# --- rules across fields and sections ------------------------------------------------------------

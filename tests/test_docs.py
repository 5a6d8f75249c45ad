"""docs/architecture.md matches the tree: its module table names every module of iop/, and its
layer diagram is the layers contract in pyproject.toml."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
PATH = re.compile(r"[\w/]+(?:\.py|/)")


def _section(title: str) -> str:
    return ARCHITECTURE.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def _has_code(init: Path) -> bool:
    """A package's `__init__.py` that holds more than its docstring is a module of its own."""
    body = ast.parse(init.read_text(encoding="utf-8")).body
    return any(
        not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))
        and not (isinstance(s, ast.ImportFrom) and s.module == "__future__")
        for s in body
    )


def _modules() -> set[str]:
    found = set()
    for f in (ROOT / "iop").rglob("*.py"):
        rel = f.relative_to(ROOT).as_posix()
        if f.name != "__init__.py":
            found.add(rel)
        elif _has_code(f) and f.parent != ROOT / "iop":  # iop/__init__.py: the version
            found.add(rel.removesuffix("__init__.py"))
    return found


def _table_mentions() -> set[str]:
    """Every path in the table's rows; a bare name is in the directory of the row's last `iop/` path."""
    mentioned = set()
    for line in _section("Modules").splitlines():
        if not line.startswith("| `"):
            continue
        here = "iop/"
        for token in re.findall(r"`([^`]+)`", line):
            if not PATH.fullmatch(token):
                continue
            path = token if token.startswith("iop/") else here + token
            if token.startswith("iop/"):
                here = path if path.endswith("/") else path.rsplit("/", 1)[0] + "/"
            mentioned.add(path)
    return mentioned


def test_module_table_names_every_module() -> None:
    mentioned = _table_mentions()
    assert _modules() - mentioned == set(), "add them to the module table of docs/architecture.md"
    assert {m for m in mentioned if not (ROOT / m).exists()} == set(), "no such module"


def test_every_path_in_the_page_exists() -> None:
    paths = {p for p in re.findall(r"`(iop/[\w/.]*)`", ARCHITECTURE) if PATH.fullmatch(p)}
    assert {p for p in paths if not (ROOT / p).exists()} == set()


def test_layer_diagram_is_the_import_contract() -> None:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["importlinter"]
    layers = next(c for c in contracts["contracts"] if c["type"] == "layers")["layers"]
    contract = [{m.strip() for m in layer.split("|")} for layer in layers]
    diagram = _section("Layers").split("```", 2)[1]
    drawn = [
        {p.removesuffix(".py").removesuffix("/").replace("/", ".") for p in re.findall(r"iop/[\w/.]*", row)}
        for row in diagram.splitlines()
        if "iop/" in row
    ]
    assert drawn == contract

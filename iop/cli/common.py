"""What every `iop` command shares: one-line failures, reading the deployment file, logging, the event loop."""

from __future__ import annotations

import sys
from typing import Any

import click

from iop import config as config_mod
from iop.errors import ConfigError


def fail(message: str, code: int = 1) -> None:
    click.echo(f"iop: {message}", err=True)
    sys.exit(code)


def load_or_exit(path: str, *, show_warnings: bool = True) -> config_mod.Loaded:
    try:
        loaded = config_mod.load(path)
    except ConfigError as exc:
        for line in exc.problems:
            click.echo(f"error: {line}", err=True)
        sys.exit(2)
    if show_warnings:
        for w in loaded.warnings:
            click.echo(f"warning: {w}", err=True)
    return loaded


def loop_factory() -> Any:
    """The event loop iop's processes run on: uvloop's when it is installed (IOP_LOOP=asyncio forces
    asyncio's own); None for asyncio's."""
    import contextlib
    import importlib
    import os

    if os.environ.get("IOP_LOOP", "uvloop") == "uvloop":
        # By name: uvloop is absent on some platforms (Windows), where asyncio's loop serves.
        with contextlib.suppress(ImportError):
            return importlib.import_module("uvloop").new_event_loop
    return None


def run_async(main: Any) -> Any:
    """Run `main` to its end on iop's event loop (`loop_factory`)."""
    import asyncio

    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)


def log_warnings(loaded: config_mod.Loaded, node_id: str | None = None) -> None:
    """Log the file's warnings with the process's other lines: a node only its own section's."""
    import logging

    prefix = ""
    if node_id is not None:
        index = [n.id for n in loaded.deployment.nodes].index(node_id)
        prefix = f"nodes[{index}]"
    for w in loaded.warnings:
        if w.startswith(prefix) and (not prefix or w[len(prefix)] in ".:"):
            logging.getLogger("iop.config").warning("%s", w)


def setup_logging(verbose: bool, level: str = "info", fmt: str = "text") -> None:
    from iop import logs

    logs.setup("debug" if verbose else level, fmt)


def log_options(f: Any) -> Any:
    """--log-level and --log-format, shared by edge and node."""
    from iop.logs import FORMATS, LEVELS

    f = click.option(
        "--log-format",
        type=click.Choice(FORMATS),
        default="text",
        show_default=True,
        help="text lines, or one JSON object per line.",
    )(f)
    return click.option(
        "--log-level",
        type=click.Choice(LEVELS),
        default="info",
        show_default=True,
        help="info shows one access line per request; -v is debug.",
    )(f)


def edge_address(edge: str | None, config_file: str | None) -> str:
    """--edge as a URL; without it, the edge.listen of --config; else the default (exit 2 if bad)."""
    from iop.client import DEFAULT_EDGE, EdgeAddressError, edge_url, edge_url_of

    if edge is not None:
        try:
            return edge_url(edge)
        except EdgeAddressError as exc:
            fail(str(exc), 2)
    if config_file is not None:
        return edge_url_of(load_or_exit(config_file, show_warnings=False).deployment)
    return DEFAULT_EDGE


EDGE_HELP = "The edge's address, e.g. 127.0.0.1:8080 (default: edge.listen of --config, else 127.0.0.1:8080)."

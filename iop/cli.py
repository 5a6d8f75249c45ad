"""The `iop` command line: click only parses here; the modules it calls do the work."""

from __future__ import annotations

import sys

import click

from iop import __version__
from iop import config as config_mod
from iop.errors import ConfigError, IopError


def _fail(message: str, code: int = 1) -> None:
    click.echo(f"iop: {message}", err=True)
    sys.exit(code)


def _load_or_exit(path: str, *, show_warnings: bool = True) -> config_mod.Loaded:
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


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="iop")
def main() -> None:
    """iop: one OpenAI-compatible endpoint over a handful of machines."""


@main.group("config")
def config_group() -> None:
    """Check the deployment file, or print its JSON Schema."""


@config_group.command("check")
@click.argument("file", type=click.Path(dir_okay=False))
def config_check(file: str) -> None:
    """Validate FILE and print a summary of the deployment (exit 2 on errors)."""
    loaded = _load_or_exit(file, show_warnings=False)  # the summary lists them
    click.echo(config_mod.summary(loaded))


@config_group.command("schema")
def config_schema() -> None:
    """Print the JSON Schema of the deployment file (for editors)."""
    click.echo(config_mod.json_schema_text())

def _logging(verbose: bool) -> None:
    import logging

    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # Our own lines are what an operator reads; the libraries' chatter only with -v.
    for name in ("nats", "uvicorn", "httpx"):
        logging.getLogger(name).setLevel(logging.DEBUG if verbose else logging.WARNING)


@main.command("edge")
@click.option("--config", "config_file", required=True, type=click.Path(dir_okay=False), help="Deployment file.")
@click.option("--listen", default=None, help="HOST:PORT for the HTTP API (overrides edge.listen).")
@click.option("--nats", "nats_url", default=None, help="Use this NATS instead of edge.nats.url.")
@click.option("-v", "--verbose", is_flag=True)
def edge_cmd(config_file: str, listen: str | None, nats_url: str | None, verbose: bool) -> None:
    """Serve the OpenAI API for the deployment in FILE (starts the bundled nats-server by default)."""
    import asyncio

    from iop.edge.server import run_edge

    loaded = _load_or_exit(config_file)
    _logging(verbose)
    try:
        asyncio.run(run_edge(loaded, listen=listen, nats_url=nats_url))
    except IopError as exc:
        _fail(str(exc))
    except OSError as exc:
        _fail(f"cannot serve: {exc.strerror or exc}")


@main.command("node")
@click.option("--config", "config_file", required=True, type=click.Path(dir_okay=False), help="Deployment file.")
@click.option("--node", "node_id", required=True, help="This node's id in the file.")
@click.option("--nats", "nats_url", default=None, help="NATS URL (default: the edge's address from the file).")
@click.option("-v", "--verbose", is_flag=True)
def node_cmd(config_file: str, node_id: str, nats_url: str | None, verbose: bool) -> None:
    """Serve one node's catalog: its providers and CLI resources."""
    import asyncio
    import signal

    from iop import bus
    from iop.node.runtime import NodeRuntime

    loaded = _load_or_exit(config_file)
    dep = loaded.deployment
    if node_id not in {n.id for n in dep.nodes}:
        known = ", ".join(n.id for n in dep.nodes) or "none"
        _fail(f"node '{node_id}' is not in {config_file} (its nodes: {known})", 2)
    url = nats_url or default_nats_url(dep)
    _logging(verbose)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        # The node's connections use the deployment's NATS credentials and CA (edge.nats).
        bus.default_access.set(bus.NatsAccess.from_settings(dep.edge.nats))
        runtime = NodeRuntime(dep, node_id, url)
        await runtime.start()
        print(f"iop node {node_id} serving (nats={url})", flush=True)
        await stop.wait()
        await runtime.stop()

    try:
        asyncio.run(run())
    except IopError as exc:
        _fail(str(exc))


def default_nats_url(dep: config_mod.Deployment) -> str:
    """Where a node finds NATS when not told: the edge's embedded server, or the external URL."""
    nats = dep.edge.nats
    if nats.url != "embedded":
        return nats.url
    host, _, port = nats.listen.rpartition(":")
    if host in ("0.0.0.0", "", "::", "[::]"):
        host = "127.0.0.1"
    return f"nats://{host}:{port}"


@main.command("status")
@click.option("--edge", "edge_url", default="http://127.0.0.1:8080", show_default=True, help="The edge's HTTP URL.")
@click.option("--json", "as_json", is_flag=True, help="Print the raw JSON.")
@click.option("--api-key", envvar="IOP_API_KEY", default=None, help="Bearer key (env IOP_API_KEY).")
def status_cmd(edge_url: str, as_json: bool, api_key: str | None) -> None:
    """Show nodes, providers, pools and routes of a running edge."""
    from iop.statusview import fetch_status, render_status

    try:
        data = fetch_status(edge_url, api_key)
    except IopError as exc:
        _fail(str(exc))
        return
    if as_json:
        import json

        click.echo(json.dumps(data, indent=2))
    else:
        click.echo(render_status(data))


__all__ = ["IopError", "main"]

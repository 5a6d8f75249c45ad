"""`iop provider restart|drain|enable`: an administrator's actions on one provider of a running deployment."""

from __future__ import annotations

import click

from iop.cli.common import EDGE_HELP, edge_address, fail
from iop.errors import IopError

_ADMIN_KEY = click.option(
    "--admin-key",
    "api_key",
    envvar="IOP_ADMIN_KEY",
    default=None,
    help="An admin key of the edge (env IOP_ADMIN_KEY); without admin keys the edge answers only loopback.",
)
_EDGE = click.option("--edge", "edge_url", default=None, help=EDGE_HELP)
_CONFIG = click.option(
    "--config", "config_file", default=None, type=click.Path(dir_okay=False), help="Deployment file naming the edge."
)


@click.group("provider")
def provider_group() -> None:
    """Act on one provider of a running deployment (admin key): restart its server, drain it, enable it."""


@provider_group.command("restart")
@click.argument("provider")
@click.option("--config", "config_file", default=None, type=click.Path(dir_okay=False), help="Deployment file.")
@click.option("--edge", "edge_url", default=None, help=EDGE_HELP)
@click.option(
    "--admin-key",
    "api_key",
    envvar="IOP_ADMIN_KEY",
    default=None,
    help="An admin key of the edge (env IOP_ADMIN_KEY); without admin keys the edge answers only loopback.",
)
def restart_cmd(provider: str, config_file: str | None, edge_url: str | None, api_key: str | None) -> None:
    """Restart the model server its node runs for PROVIDER (drained first: running requests finish)."""
    import asyncio

    from iop.client import EdgeClient

    url = edge_address(edge_url, config_file)

    async def send() -> str:
        async with EdgeClient(url, api_key=api_key) as edge:
            return await edge.restart_provider(provider)

    try:
        click.echo(asyncio.run(send()))
    except IopError as exc:
        fail(str(exc))


@provider_group.command("drain")
@click.argument("provider")
@click.option("--reason", default="", help="Why, as /status and iop status show it.")
@_EDGE
@_CONFIG
@_ADMIN_KEY
def drain_cmd(provider: str, reason: str, edge_url: str | None, config_file: str | None, api_key: str | None) -> None:
    """Take PROVIDER out of its pools: it finishes what it runs; its pools' requests go elsewhere or wait."""
    import asyncio

    from iop.client import EdgeClient

    url = edge_address(edge_url, config_file)

    async def send() -> str:
        async with EdgeClient(url, api_key=api_key) as edge:
            answer = await edge.drain_provider(provider, reason)
        return f"{provider}: drained ({answer['drain']['reason']})"

    try:
        click.echo(asyncio.run(send()))
    except IopError as exc:
        fail(str(exc))


@provider_group.command("enable")
@click.argument("provider")
@_EDGE
@_CONFIG
@_ADMIN_KEY
def enable_cmd(provider: str, edge_url: str | None, config_file: str | None, api_key: str | None) -> None:
    """Put PROVIDER back in its pools after a drain (an operator's, its policy's or a failed qualification's)."""
    import asyncio

    from iop.client import EdgeClient

    url = edge_address(edge_url, config_file)

    async def send() -> str:
        async with EdgeClient(url, api_key=api_key) as edge:
            answer = await edge.enable_provider(provider)
        if answer["drained"]:
            return f"{provider}: still out of its pools (an exclusive qualification holds it)"
        return f"{provider}: back in its pools" + ("" if answer["was_drained"] else " (it was not drained)")

    try:
        click.echo(asyncio.run(send()))
    except IopError as exc:
        fail(str(exc))

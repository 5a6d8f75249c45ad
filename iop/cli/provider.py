"""`iop provider ...`: an administrator's actions on one provider of a running deployment."""

from __future__ import annotations

import click

from iop.cli.common import EDGE_HELP, edge_address, fail
from iop.errors import IopError


@click.group("provider")
def provider_group() -> None:
    """Act on one provider of a running deployment (admin key)."""


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

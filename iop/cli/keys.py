"""`iop keys create|list|rotate|revoke`: managed client keys of a running deployment (admin key)."""

from __future__ import annotations

import time
from typing import Any

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


def _call(edge_url: str | None, config_file: str | None, api_key: str | None, *ask: Any) -> dict[str, Any]:
    import asyncio

    from iop.client import EdgeClient

    url = edge_address(edge_url, config_file)

    async def send() -> dict[str, Any]:
        async with EdgeClient(url, api_key=api_key) as edge:
            return await edge.keys(*ask)

    try:
        return asyncio.run(send())
    except IopError as exc:
        fail(str(exc))
        raise  # not reached: fail exits


def _when(t: object) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t)) if isinstance(t, int | float) else "never"


def _secret(answer: dict[str, Any], what: str) -> None:
    click.echo(answer["key"])
    click.echo(
        f"{what} {answer['id']} ({answer['name']}, tenant {answer['tenant']}, expires {_when(answer['expires'])}); "
        "the key above is shown only now",
        err=True,
    )


@click.group("keys")
def keys_group() -> None:
    """Managed client keys (admin key): made, listed, rotated and revoked on every edge at once."""


@keys_group.command("create")
@click.argument("name")
@click.option("--tenant", default=None, help="The tenant it belongs to (default: NAME).")
@click.option("--expires-days", type=float, default=None, help="Refused after this many days (default: never).")
@_EDGE
@_CONFIG
@_ADMIN_KEY
def create_cmd(
    name: str,
    tenant: str | None,
    expires_days: float | None,
    edge_url: str | None,
    config_file: str | None,
    api_key: str | None,
) -> None:
    """Make a key named NAME; print it (once: it is stored only as a digest)."""
    body: dict[str, object] = {"name": name, "tenant": tenant, "expires_in_days": expires_days}
    _secret(_call(edge_url, config_file, api_key, "POST", "", body), "created")


@keys_group.command("list")
@_EDGE
@_CONFIG
@_ADMIN_KEY
def list_cmd(edge_url: str | None, config_file: str | None, api_key: str | None) -> None:
    """The managed keys: id, name, tenant, created, expires (never a key)."""
    keys = _call(edge_url, config_file, api_key, "GET")["keys"]
    if not keys:
        click.echo("no managed keys")
    for k in keys:
        click.echo(
            f"{k['id']}  {k['name']}  tenant {k['tenant']}  created {_when(k['created'])}  "
            f"expires {_when(k['expires'])}"
        )


@keys_group.command("rotate")
@click.argument("key_id")
@_EDGE
@_CONFIG
@_ADMIN_KEY
def rotate_cmd(key_id: str, edge_url: str | None, config_file: str | None, api_key: str | None) -> None:
    """Give KEY_ID a new secret (printed once); the old one is refused from now on."""
    _secret(_call(edge_url, config_file, api_key, "POST", f"/{key_id}/rotate"), "rotated")


@keys_group.command("revoke")
@click.argument("key_id")
@_EDGE
@_CONFIG
@_ADMIN_KEY
def revoke_cmd(key_id: str, edge_url: str | None, config_file: str | None, api_key: str | None) -> None:
    """Refuse KEY_ID on every edge from now on."""
    answer = _call(edge_url, config_file, api_key, "DELETE", f"/{key_id}")
    click.echo(f"revoked {answer['id']} ({answer['name']})")

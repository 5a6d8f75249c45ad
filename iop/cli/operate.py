"""`iop status`, `iop usage` and `iop refresh`: reading and changing a running edge."""

from __future__ import annotations

import sys

import click

from iop.cli.common import (
    EDGE_HELP,
    edge_address,
    fail,
    load_or_exit,
)
from iop.errors import ConfigError, IopError


@click.command("status")
@click.option("--edge", "edge_url", default=None, help=EDGE_HELP)
@click.option(
    "--config", "config_file", default=None, type=click.Path(dir_okay=False), help="Deployment file naming the edge."
)
@click.option("--json", "as_json", is_flag=True, help="Print the raw JSON.")
@click.option("--summary", is_flag=True, help="Totals, pools and only what is not healthy (/status?view=summary).")
@click.option("--api-key", envvar="IOP_API_KEY", default=None, help="Bearer key (env IOP_API_KEY).")
def status_cmd(
    edge_url: str | None, config_file: str | None, as_json: bool, summary: bool, api_key: str | None
) -> None:
    """Show nodes, providers, pools and routes of a running edge."""
    import asyncio

    import msgspec

    from iop.client import EdgeClient
    from iop.statusview import render_status, render_summary

    url = edge_address(edge_url, config_file)

    async def fetch() -> str:
        async with EdgeClient(url, api_key=api_key) as edge:
            if not as_json:
                return render_summary(await edge.summary()) if summary else render_status(await edge.status())
            # As the edge sent it: a newer edge's fields survive.
            raw = await edge.status_json("summary" if summary else "full")
            try:
                return msgspec.json.format(raw, indent=2).decode()
            except msgspec.DecodeError as exc:
                raise IopError(f"{url}/status is not JSON: {exc}") from None

    try:
        click.echo(asyncio.run(fetch()))
    except IopError as exc:
        fail(str(exc))


@click.command("usage")
@click.option("--edge", "edge_url", default=None, help=EDGE_HELP)
@click.option(
    "--config", "config_file", default=None, type=click.Path(dir_okay=False), help="Deployment file naming the edge."
)
@click.option(
    "--since",
    default=None,
    help="Start: a duration ago (7d, 24h, 30m), ISO time or Unix time [default: 24h; with --tail: now].",
)
@click.option("--until", default=None, help="End (default: now), same forms as --since.")
@click.option(
    "--by",
    default="model",
    show_default=True,
    help="Group by: model,provider,node,key,tenant,day,hour,api,route,status.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the JSON the edge answered.")
@click.option("--csv", "as_csv", is_flag=True, help="Print CSV.")
@click.option("--tail", is_flag=True, help="Follow records as they are written (--json: one JSON object a line).")
@click.option("--model", default=None, help="With --tail: only this model alias.")
@click.option("--api-key", envvar="IOP_API_KEY", default=None, help="Bearer key (env IOP_API_KEY).")
def usage_cmd(
    edge_url: str | None,
    config_file: str | None,
    since: str | None,
    until: str | None,
    by: str,
    as_json: bool,
    as_csv: bool,
    tail: bool,
    model: str | None,
    api_key: str | None,
) -> None:
    """Who used what, how much, how fast, and what failed: the ledger of a running edge as a table
    (requests, errors, tokens in/out, p50/p95 duration and queue wait per group)."""
    import asyncio

    import msgspec

    from iop.client import EdgeClient
    from iop.contracts.usage import parse_query
    from iop.errors import BadRequest
    from iop.usageview import record_line, to_table

    if as_json and as_csv:
        fail("--json and --csv exclude each other", 2)
    try:
        parse_query(since, until, by)  # bad input never leaves this machine
    except BadRequest as exc:
        fail(f"--{exc.param}: {exc.message}", 2)
    url = edge_address(edge_url, config_file)

    async def follow() -> None:
        params = {k: v for k, v in (("since", since), ("model", model)) if v}
        async with EdgeClient(url, api_key=api_key) as edge:
            async for line in edge.follow_usage(params):
                click.echo(line.decode() if as_json else record_line(msgspec.json.decode(line)))

    async def table() -> str:
        params = {"since": since or "24h", "by": by, "format": "csv" if as_csv else "json"}
        if until:
            params["until"] = until
        async with EdgeClient(url, api_key=api_key) as edge:
            raw = await edge.usage(params)
        if as_csv or as_json:
            return raw.decode().rstrip("\n")
        return to_table(msgspec.json.decode(raw))

    try:
        if tail:
            asyncio.run(follow())
        else:
            click.echo(asyncio.run(table()))
    except IopError as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        return


@click.command("refresh")
@click.option("--config", "config_file", required=True, type=click.Path(dir_okay=False), help="Deployment file.")
@click.option("--edge", "edge_url", default=None, help=EDGE_HELP)
@click.option("--dry-run", is_flag=True, help="Print what would change; apply nothing.")
@click.option(
    "--admin-key",
    "api_key",
    envvar="IOP_ADMIN_KEY",
    default=None,
    help="An admin key of the edge (env IOP_ADMIN_KEY); without admin keys the edge answers only loopback.",
)
def refresh_cmd(config_file: str, edge_url: str | None, dry_run: bool, api_key: str | None) -> None:
    """Apply FILE to a running deployment without a restart (or show the diff with --dry-run)."""
    import asyncio
    from pathlib import Path

    from iop.client import EdgeClient
    from iop.contracts.refresh import RefreshResult

    url = edge_address(edge_url, config_file)
    load_or_exit(config_file)  # an invalid file never leaves this machine
    text = Path(config_file).read_text(encoding="utf-8")

    async def send() -> RefreshResult:
        async with EdgeClient(url, api_key=api_key) as edge:
            return await edge.refresh(text, dry_run=dry_run)

    try:
        result = asyncio.run(send())
    except ConfigError as exc:
        for line in exc.problems:
            click.echo(f"error: {line}", err=True)
        sys.exit(2)
    except IopError as exc:
        fail(str(exc))
        return
    click.echo("\n".join(result.changes) if result.changes else "no changes")
    if result.error:
        click.echo(f"iop: refresh failed and was rolled back: {result.error}", err=True)
        for line in result.applied:
            click.echo(f"  had applied (undone): {line}", err=True)
        sys.exit(1)
    if result.changes and not dry_run:
        click.echo("applied.")
    if result.drift and not dry_run:
        click.echo(
            f"note: the edge now differs from the file it was started from ({len(result.drift)} changes); "
            "a restart or SIGHUP of the edge reads that file again and undoes them: write them there to keep them",
            err=True,
        )

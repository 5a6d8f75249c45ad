"""`iop qualify` and `iop smoke`: measuring providers and checking a whole deployment under load."""

from __future__ import annotations

import sys

import click

from iop.cli.common import (
    EDGE_HELP,
    edge_address,
    fail,
)
from iop.errors import IopError


@click.command("qualify")
@click.option("--edge", "edge_url", default=None, help=EDGE_HELP)
@click.option(
    "--config", "config_file", default=None, type=click.Path(dir_okay=False), help="Deployment file naming the edge."
)
@click.option("--provider", "providers", multiple=True, help="Qualify this provider (repeatable; default: all).")
@click.option("--pool", default=None, help="Qualify the providers of this pool alias.")
@click.option(
    "--exclusive",
    is_flag=True,
    help="Drain each provider out of its pools while it is measured and sweep up to twice its capacity.",
)
@click.option("--quick", is_flag=True, help="Under a minute per provider: fewer, shorter requests.")
@click.option("--out", "out_dir", default=None, type=click.Path(file_okay=False), help="Write the reports here.")
@click.option("--show", is_flag=True, help="Print the latest results the edge keeps; measure nothing.")
@click.option("--apply-capacity", is_flag=True, help="Print the YAML change the recommendations call for.")
@click.option(
    "--context", type=click.IntRange(min=1024), default=None, help="Also find the context window, up to N tokens."
)
@click.option("--tokens", type=click.IntRange(min=2, max=4096), default=None, help="Output tokens per sweep request.")
@click.option(
    "--lease-ttl", type=click.FloatRange(min=1.0, max=60.0), default=6.0, help="Seconds the edge waits for a renewal."
)
@click.option(
    "--admin-key",
    envvar="IOP_ADMIN_KEY",
    default=None,
    help="An admin key of the edge (env IOP_ADMIN_KEY); without admin keys the edge answers only loopback.",
)
def qualify_cmd(
    edge_url: str | None,
    config_file: str | None,
    providers: tuple[str, ...],
    pool: str | None,
    exclusive: bool,
    quick: bool,
    out_dir: str | None,
    show: bool,
    apply_capacity: bool,
    context: int | None,
    tokens: int | None,
    lease_ttl: float,
    admin_key: str | None,
) -> None:
    """Measure what each provider really does: protocol, capabilities, throughput and the capacity to set."""
    from pathlib import Path

    from iop.qualify import runner
    from iop.qualify.pages import markdown
    from iop.qualify.schema import Report

    opts = runner.Options(
        edge=edge_address(edge_url, config_file),
        admin_key=admin_key,
        providers=providers,
        pool=pool,
        exclusive=exclusive,
        quick=quick,
        out=Path(out_dir) if out_dir else None,
        context=context,
        output_tokens=tokens,
        lease_ttl_s=lease_ttl,
    )

    def echo(line: str) -> None:
        click.echo(line, err=True)

    try:
        if show:
            import asyncio

            reports = asyncio.run(runner.show(opts))
            if not reports:
                click.echo("no qualification results kept yet (run iop qualify)")
            else:
                click.echo(markdown(reports))
            if opts.out is not None and reports:
                runner.write(opts.out, reports)
        else:
            found: list[Report] = []

            async def go() -> None:
                import signal

                task = asyncio.current_task()
                assert task is not None
                # SIGTERM ends the run like Ctrl-C: the lease is ended, the provider back in its pools.
                asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
                found.extend(await runner.run(opts, echo))

            import asyncio

            try:
                asyncio.run(go())
            except (KeyboardInterrupt, asyncio.CancelledError):
                fail("interrupted: the providers were put back; no report kept for the one being measured", 130)
            reports = found
            click.echo(markdown(reports))
            if opts.out is not None:
                click.echo(f"reports written to {opts.out}", err=True)
        if apply_capacity:
            click.echo(runner.capacity_change(reports))
    except IopError as exc:
        fail(str(exc))


@click.command("smoke")
@click.option(
    "--config",
    "config_file",
    default=None,
    type=click.Path(dir_okay=False),
    help="Deployment to start and check (default: the built-in iop/configs/smoke.yaml).",
)
@click.option(
    "--edge",
    "edge_url",
    default=None,
    help="Check the deployment behind this running edge (e.g. 127.0.0.1:8080) instead.",
)
@click.option("--model", default=None, help="Pool alias to fill (default: the first pool).")
@click.option("--direct", default=None, help="Direct-route alias to call while the pool is full (default: the first).")
@click.option(
    "--expect-nodes",
    type=click.IntRange(min=0),
    default=None,
    help="Connected nodes expected (default: every node of the deployment).",
)
@click.option(
    "--expect-capacity",
    type=click.IntRange(min=1),
    default=None,
    help="Connected capacity of the pool expected (default: its total capacity).",
)
@click.option(
    "--requests",
    "requests_n",
    type=click.IntRange(min=1),
    default=None,
    help="Pool requests in the burst, more than the capacity (default: 40, or 4x the capacity).",
)
@click.option(
    "--ready-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=20.0,
    show_default=True,
    help="Seconds to wait for nodes, pool and route to be connected.",
)
@click.option(
    "--request-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Seconds one request may take (default: 30, or 300 with --edge).",
)
@click.option(
    "--skip-node",
    "skip_nodes",
    multiple=True,
    metavar="ID",
    help="Do not start this node (start it yourself with --nats, or see how a missing node is reported).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--api-key", envvar="IOP_API_KEY", default=None, help="Bearer key for --edge (env IOP_API_KEY).")
def smoke_cmd(
    config_file: str | None,
    edge_url: str | None,
    model: str | None,
    direct: str | None,
    expect_nodes: int | None,
    expect_capacity: int | None,
    requests_n: int | None,
    ready_timeout: float,
    request_timeout: float | None,
    skip_nodes: tuple[str, ...],
    as_json: bool,
    api_key: str | None,
) -> None:
    """Check a whole deployment under load: start it here (edge, bundled NATS, every node, as separate
    processes) or reach a running one (--edge), fill a pool past its capacity, check that capacity held
    exactly and the direct route never waited, and report. Exit 0 pass, 1 fail, 2 bad options."""
    from iop.smoke import Options, run

    if edge_url is not None and (config_file is not None or skip_nodes):
        fail("--edge checks a running deployment; --config and --skip-node are for the one smoke starts", 2)
    options = Options(
        config=config_file,
        edge=None if edge_url is None else edge_address(edge_url, None),
        model=model,
        direct=direct,
        expect_nodes=expect_nodes,
        expect_capacity=expect_capacity,
        requests=requests_n,
        ready_timeout_s=ready_timeout,
        request_timeout_s=request_timeout,
        skip_nodes=skip_nodes,
        as_json=as_json,
        api_key=api_key,
    )
    sys.exit(run(options))

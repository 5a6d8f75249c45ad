"""The `iop` command line: click only parses here; the modules it calls do the work."""

from __future__ import annotations

import sys
from typing import Any

import click

from iop import __version__, configview
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
    click.echo(configview.summary(loaded))


@config_group.command("schema")
def config_schema() -> None:
    """Print the JSON Schema of the deployment file (for editors)."""
    click.echo(configview.json_schema_text())


def _run_async(main: Any) -> None:
    """Run on uvloop when it is installed (IOP_LOOP=asyncio forces asyncio's own loop)."""
    import asyncio
    import contextlib
    import importlib
    import os

    factory = None
    if os.environ.get("IOP_LOOP", "uvloop") == "uvloop":
        # By name: uvloop is absent on some platforms (Windows), where asyncio's loop serves.
        with contextlib.suppress(ImportError):
            factory = importlib.import_module("uvloop").new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main)


def _log_warnings(loaded: config_mod.Loaded, node_id: str | None = None) -> None:
    """Log the file's warnings with the process's other lines: a node only its own section's."""
    import logging

    prefix = ""
    if node_id is not None:
        index = [n.id for n in loaded.deployment.nodes].index(node_id)
        prefix = f"nodes[{index}]"
    for w in loaded.warnings:
        if w.startswith(prefix) and (not prefix or w[len(prefix)] in ".:"):
            logging.getLogger("iop.config").warning("%s", w)


def _logging(verbose: bool, level: str = "info", fmt: str = "text") -> None:
    from iop import logs

    logs.setup("debug" if verbose else level, fmt)


def _log_options(f: Any) -> Any:
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


@main.command("edge")
@click.option("--config", "config_file", required=True, type=click.Path(dir_okay=False), help="Deployment file.")
@click.option("--listen", default=None, help="HOST:PORT for the HTTP API (overrides edge.listen).")
@click.option("--nats", "nats_url", default=None, help="Use this NATS instead of edge.nats.url.")
@click.option(
    "--check-cluster",
    is_flag=True,
    help="Print each NATS server's health and each stream's replica state, then exit (non-zero if any is unwell).",
)
@click.option("-v", "--verbose", is_flag=True)
@_log_options
def edge_cmd(
    config_file: str,
    listen: str | None,
    nats_url: str | None,
    check_cluster: bool,
    verbose: bool,
    log_level: str,
    log_format: str,
) -> None:
    """Serve the OpenAI API for the deployment in FILE (starts the bundled nats-server by default)."""
    from iop.edge.process import run_edge

    loaded = _load_or_exit(config_file, show_warnings=False)
    if check_cluster:
        _check_cluster(loaded.deployment, nats_url)
        return
    _logging(verbose, log_level, log_format)
    _log_warnings(loaded)
    try:
        _run_async(run_edge(loaded, listen=listen, nats_url=nats_url))
    except ConfigError as exc:
        _fail("; ".join(exc.problems), 2)
    except IopError as exc:
        _fail(str(exc))
    except OSError as exc:
        _fail(f"cannot serve: {exc.strerror or exc}")


def _check_cluster(dep: config_mod.Deployment, nats_url: str | None) -> None:
    import asyncio

    from iop.nats import cluster

    try:
        url, access = cluster.target(dep, nats_url)
        report = asyncio.run(cluster.check(url, access))
    except IopError as exc:
        _fail(str(exc))
        return
    for line in report.lines:
        click.echo(line)
    if not report.healthy:
        sys.exit(1)


@main.command("node")
@click.option("--node", "node_id", required=True, help="This node's id.")
@click.option(
    "--config",
    "config_file",
    default=None,
    type=click.Path(dir_okay=False),
    help="Deployment file to start from (default: take this node's catalog from the edge).",
)
@click.option("--nats", "nats_url", default=None, help="NATS URL (default: the edge's address from the file).")
@click.option("--nats-token-env", default=None, help="Without --config: env variable holding the NATS token.")
@click.option("--nats-user-env", default=None, help="Without --config: env variable holding the NATS user.")
@click.option("--nats-password-env", default=None, help="Without --config: env variable holding the NATS password.")
@click.option("--nats-ca", default=None, type=click.Path(dir_okay=False), help="Without --config: CA file for tls://.")
@click.option("--no-follow", is_flag=True, help="With --config: ignore catalog changes from the edge.")
@click.option(
    "--allow-commands",
    "policy_file",
    default=None,
    type=click.Path(dir_okay=False),
    help="This machine's node_policy (commands, upstream_hosts, env); default: exactly what --config names.",
)
@click.option("-v", "--verbose", is_flag=True)
@_log_options
def node_cmd(
    node_id: str,
    config_file: str | None,
    nats_url: str | None,
    nats_token_env: str | None,
    nats_user_env: str | None,
    nats_password_env: str | None,
    nats_ca: str | None,
    no_follow: bool,
    policy_file: str | None,
    verbose: bool,
    log_level: str,
    log_format: str,
) -> None:
    """Serve one node's catalog: its providers and CLI resources.

    With --config the node starts from its section of the file; without, it needs only the NATS
    address (and credentials) and takes its catalog from the edge. Either way it follows the
    catalog the edge publishes, so `iop refresh` reaches it — but runs only the commands, upstream
    hosts and variables this machine allows (--allow-commands FILE; with --config, by default
    exactly those of its section there; without either, none): the rest is refused and shown as
    such in the edge's status.
    """
    from iop.node import policy
    from iop.node.main import default_nats_url, run_node

    dep: config_mod.Deployment | None = None
    if config_file is not None:
        loaded = _load_or_exit(config_file, show_warnings=False)
        dep = loaded.deployment
        if node_id not in {n.id for n in dep.nodes}:
            known = ", ".join(n.id for n in dep.nodes) or "none"
            _fail(f"node '{node_id}' is not in {config_file} (its nodes: {known})", 2)
        nats_settings = dep.edge.nats
        url = nats_url or default_nats_url(dep)
    else:
        if nats_url is None:
            _fail("--nats URL is needed without --config (the node takes its catalog from the edge there)", 2)
        try:
            nats_settings = config_mod.NatsSettings(
                url=str(nats_url),
                token_env=nats_token_env,
                user_env=nats_user_env,
                password_env=nats_password_env,
                tls_ca=nats_ca,
            )
        except TypeError as exc:
            _fail(f"NATS options: {exc}", 2)
            return
        url = str(nats_url)
    _logging(verbose, log_level, log_format)
    if config_file is not None:
        _log_warnings(loaded, node_id)

    try:
        node_policy = policy.load(policy_file) if policy_file is not None else None
        _run_async(
            run_node(
                dep,
                node_id,
                nats_url=url,
                nats_settings=nats_settings,
                follow_edge=not no_follow,
                node_policy=node_policy,
            )
        )
    except ConfigError as exc:
        _fail("; ".join(exc.problems), 2)
    except IopError as exc:
        _fail(str(exc))


@main.command("nats-creds")
@click.option("--config", "config_file", required=True, type=click.Path(dir_okay=False), help="Deployment file.")
@click.option("--node", "node_id", default=None, help="Print this node's own credential.")
@click.option("--edge", "for_edge", is_flag=True, help="Print the edge's credential (an external NATS).")
@click.option(
    "--server-config",
    is_flag=True,
    help="Print the nats-server `authorization` block: the edge and every node with its permissions.",
)
def nats_creds_cmd(config_file: str, node_id: str | None, for_edge: bool, server_config: bool) -> None:
    """Print NATS credentials derived from the deployment's secret (in edge.nats.store_dir).

    --node ID: that node's own user and password as VAR=value lines; set them on the node's machine,
    where `iop node --config FILE --node ID` reads them from edge.nats user_env/password_env (default
    IOP_NATS_USER, IOP_NATS_PASSWORD). Run it where the edge runs: the embedded server uses the same
    secret. For an external NATS, --server-config prints the users and permissions to put in that
    server's configuration, and --edge the edge's own lines.
    """
    from iop.nats.access import Credentials

    if [node_id is not None, for_edge, server_config].count(True) != 1:
        _fail("give exactly one of --node ID, --edge, --server-config", 2)
    dep = _load_or_exit(config_file, show_warnings=False).deployment
    if node_id is not None and node_id not in {n.id for n in dep.nodes}:
        known = ", ".join(n.id for n in dep.nodes) or "none"
        _fail(f"node '{node_id}' is not in {config_file} (its nodes: {known})", 2)
    nats = dep.edge.nats
    try:
        creds = Credentials.load(nats.store_dir)
    except (IopError, OSError) as exc:
        _fail(str(exc))
        return
    if server_config:
        click.echo(creds.authorization(dep.nodes), nl=False)
        return
    access = creds.edge() if for_edge else creds.node(str(node_id))
    click.echo(f"{nats.user_env or 'IOP_NATS_USER'}={access.user}")
    click.echo(f"{nats.password_env or 'IOP_NATS_PASSWORD'}={access.password}")


def _edge_address(edge: str | None, config_file: str | None) -> str:
    """--edge as a URL; without it, the edge.listen of --config; else the default (exit 2 if bad)."""
    from iop.client import DEFAULT_EDGE, EdgeAddressError, edge_url, edge_url_of

    if edge is not None:
        try:
            return edge_url(edge)
        except EdgeAddressError as exc:
            _fail(str(exc), 2)
    if config_file is not None:
        return edge_url_of(_load_or_exit(config_file, show_warnings=False).deployment)
    return DEFAULT_EDGE


_EDGE_HELP = "The edge's address, e.g. 127.0.0.1:8080 (default: edge.listen of --config, else 127.0.0.1:8080)."


@main.command("status")
@click.option("--edge", "edge_url", default=None, help=_EDGE_HELP)
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

    url = _edge_address(edge_url, config_file)

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
        _fail(str(exc))


@main.command("usage")
@click.option("--edge", "edge_url", default=None, help=_EDGE_HELP)
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
    "--by", default="model", show_default=True, help="Group by: model,provider,node,key,day,hour,api,route,status."
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
    from iop.edge.usage_query import parse_query, record_line, to_table
    from iop.errors import BadRequest

    if as_json and as_csv:
        _fail("--json and --csv exclude each other", 2)
    try:
        parse_query(since, until, by)  # bad input never leaves this machine
    except BadRequest as exc:
        _fail(f"--{exc.param}: {exc.message}", 2)
    url = _edge_address(edge_url, config_file)

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
        _fail(str(exc))
    except KeyboardInterrupt:
        return


@main.command("refresh")
@click.option("--config", "config_file", required=True, type=click.Path(dir_okay=False), help="Deployment file.")
@click.option("--edge", "edge_url", default=None, help=_EDGE_HELP)
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

    url = _edge_address(edge_url, config_file)
    _load_or_exit(config_file)  # an invalid file never leaves this machine
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
        _fail(str(exc))
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


@main.command("qualify")
@click.option("--edge", "edge_url", default=None, help=_EDGE_HELP)
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
    from iop.qualify.render import markdown
    from iop.qualify.schema import Report

    opts = runner.Options(
        edge=_edge_address(edge_url, config_file),
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
                _fail("interrupted: the providers were put back; no report kept for the one being measured", 130)
            reports = found
            click.echo(markdown(reports))
            if opts.out is not None:
                click.echo(f"reports written to {opts.out}", err=True)
        if apply_capacity:
            click.echo(runner.capacity_change(reports))
    except IopError as exc:
        _fail(str(exc))


@main.command("smoke")
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
        _fail("--edge checks a running deployment; --config and --skip-node are for the one smoke starts", 2)
    options = Options(
        config=config_file,
        edge=None if edge_url is None else _edge_address(edge_url, None),
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


__all__ = ["IopError", "main"]

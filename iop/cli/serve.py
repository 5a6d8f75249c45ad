"""`iop edge`, `iop node` and `iop nats-creds`: the processes of a deployment and their NATS credentials."""

from __future__ import annotations

import sys

import click

from iop import config as config_mod
from iop import heap
from iop.cli.common import (
    fail,
    load_or_exit,
    log_options,
    log_warnings,
    run_async,
    setup_logging,
)
from iop.errors import ConfigError, IopError


@click.command("edge")
@click.option("--config", "config_file", required=True, type=click.Path(dir_okay=False), help="Deployment file.")
@click.option("--listen", default=None, help="HOST:PORT for the HTTP API (overrides edge.listen).")
@click.option("--nats", "nats_url", default=None, help="Use this NATS instead of edge.nats.url.")
@click.option(
    "--check-cluster",
    is_flag=True,
    help="Print each NATS server's health and each stream's replica state, then exit (non-zero if any is unwell).",
)
@click.option("-v", "--verbose", is_flag=True)
@log_options
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

    loaded = load_or_exit(config_file, show_warnings=False)
    if check_cluster:
        _check_cluster(loaded.deployment, nats_url)
        return
    setup_logging(verbose, log_level, log_format)
    log_warnings(loaded)
    heap.keep_large_buffers()  # bodies of megabytes pass through several buffers (iop/heap.py)
    _freeze_start_up()
    try:
        run_async(run_edge(loaded, listen=listen, nats_url=nats_url))
    except ConfigError as exc:
        fail("; ".join(exc.problems), 2)
    except IopError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"cannot serve: {exc.strerror or exc}")


def _freeze_start_up() -> None:
    try:
        heap.freeze_start_up()  # what start-up loaded is never walked again (iop/heap.py)
    except ValueError as exc:
        fail(str(exc), 2)


def _check_cluster(dep: config_mod.Deployment, nats_url: str | None) -> None:
    import asyncio

    from iop.nats import cluster

    try:
        url, access = cluster.target(dep, nats_url)
        report = asyncio.run(cluster.check(url, access))
    except IopError as exc:
        fail(str(exc))
        return
    for line in report.lines:
        click.echo(line)
    if not report.healthy:
        sys.exit(1)


@click.command("node")
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
@log_options
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
        loaded = load_or_exit(config_file, show_warnings=False)
        dep = loaded.deployment
        if node_id not in {n.id for n in dep.nodes}:
            known = ", ".join(n.id for n in dep.nodes) or "none"
            fail(f"node '{node_id}' is not in {config_file} (its nodes: {known})", 2)
        nats_settings = dep.edge.nats
        url = nats_url or default_nats_url(dep)
    else:
        if nats_url is None:
            fail("--nats URL is needed without --config (the node takes its catalog from the edge there)", 2)
        try:
            nats_settings = config_mod.NatsSettings(
                url=str(nats_url),
                token_env=nats_token_env,
                user_env=nats_user_env,
                password_env=nats_password_env,
                tls_ca=nats_ca,
            )
        except TypeError as exc:
            fail(f"NATS options: {exc}", 2)
            return
        url = str(nats_url)
    setup_logging(verbose, log_level, log_format)
    if config_file is not None:
        log_warnings(loaded, node_id)
    heap.keep_large_buffers()
    _freeze_start_up()

    try:
        node_policy = policy.load(policy_file) if policy_file is not None else None
        run_async(
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
        fail("; ".join(exc.problems), 2)
    except IopError as exc:
        fail(str(exc))


@click.command("nats-creds")
@click.option("--config", "config_file", required=True, type=click.Path(dir_okay=False), help="Deployment file.")
@click.option("--node", "node_id", default=None, help="Print this node's own credential.")
@click.option("--edge", "for_edge", is_flag=True, help="Print the edge's credential (an external NATS).")
@click.option(
    "--server-config",
    is_flag=True,
    help="Print the nats-server `accounts` block: the edge's account and every node's, with its user.",
)
def nats_creds_cmd(config_file: str, node_id: str | None, for_edge: bool, server_config: bool) -> None:
    """Print NATS credentials derived from the deployment's secret (in edge.nats.store_dir).

    --node ID: that node's own user and password as VAR=value lines; set them on the node's machine,
    where `iop node --config FILE --node ID` reads them from edge.nats user_env/password_env (default
    IOP_NATS_USER, IOP_NATS_PASSWORD). Run it where the edge runs: the embedded server uses the same
    secret. For an external NATS, --server-config prints the accounts and users to put in that
    server's configuration, and --edge the edge's own lines.
    """
    from iop.nats.access import Credentials

    if [node_id is not None, for_edge, server_config].count(True) != 1:
        fail("give exactly one of --node ID, --edge, --server-config", 2)
    dep = load_or_exit(config_file, show_warnings=False).deployment
    if node_id is not None and node_id not in {n.id for n in dep.nodes}:
        known = ", ".join(n.id for n in dep.nodes) or "none"
        fail(f"node '{node_id}' is not in {config_file} (its nodes: {known})", 2)
    nats = dep.edge.nats
    try:
        creds = Credentials.load(nats.store_dir)
    except (IopError, OSError) as exc:
        fail(str(exc))
        return
    if server_config:
        click.echo(creds.accounts(dep.nodes), nl=False)
        return
    access = creds.edge() if for_edge else creds.node(str(node_id))
    click.echo(f"{nats.user_env or 'IOP_NATS_USER'}={access.user}")
    click.echo(f"{nats.password_env or 'IOP_NATS_PASSWORD'}={access.password}")

"""The `iop` command line: click only parses here; the modules it calls do the work."""

from __future__ import annotations

import click

from iop import __version__, configview
from iop.cli import check, keys, operate, provider, serve
from iop.cli.common import load_or_exit
from iop.errors import IopError


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
    loaded = load_or_exit(file, show_warnings=False)  # the summary lists them
    click.echo(configview.summary(loaded))


@config_group.command("schema")
def config_schema() -> None:
    """Print the JSON Schema of the deployment file (for editors)."""
    click.echo(configview.json_schema_text())


main.add_command(serve.edge_cmd)
main.add_command(serve.node_cmd)
main.add_command(serve.nats_creds_cmd)
main.add_command(operate.status_cmd)
main.add_command(operate.usage_cmd)
main.add_command(operate.refresh_cmd)
main.add_command(provider.provider_group)
main.add_command(keys.keys_group)
main.add_command(check.qualify_cmd)
main.add_command(check.smoke_cmd)

__all__ = ["IopError", "main"]

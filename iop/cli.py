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


def _load_or_exit(path: str) -> config_mod.Loaded:
    try:
        loaded = config_mod.load(path)
    except ConfigError as exc:
        for line in exc.problems:
            click.echo(f"error: {line}", err=True)
        sys.exit(2)
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
    loaded = _load_or_exit(file)
    click.echo(config_mod.summary(loaded))


@config_group.command("schema")
def config_schema() -> None:
    """Print the JSON Schema of the deployment file (for editors)."""
    click.echo(config_mod.json_schema_text())

__all__ = ["IopError", "main"]

"""Adapters: how a node reaches what actually answers (an OpenAI server, a CLI, the mock model)."""

from __future__ import annotations

from iop import config
from iop.node.adapters.base import Adapter


def build(cfg: config.Adapter) -> Adapter:
    """The adapter instance for one `nodes[].adapters[]` entry (Messages over chat where it has no Messages)."""
    from iop.endpoints import native
    from iop.node.adapters.messages import MessagesOverChat

    return MessagesOverChat(_build(cfg), "messages" in native(cfg))


def _build(cfg: config.Adapter) -> Adapter:
    if isinstance(cfg, config.MockAdapter):
        from iop.node.adapters.mock import MockAdapter

        return MockAdapter(cfg)
    if isinstance(cfg, config.CliAdapter):
        from iop.node.adapters.cli import CliAdapter

        return CliAdapter(cfg)
    from iop.node.adapters.openai import OpenAIAdapter

    return OpenAIAdapter(cfg)

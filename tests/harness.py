"""Run edges and nodes inside the test's event loop, on a real NATS and real uvicorn."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
import openai

from iop import bus, config
from iop.edge.server import Edge, build_app
from iop.node.runtime import NodeRuntime
from tests.fakes import serve_asgi


async def until(predicate: Callable[[], bool], changed: asyncio.Event, timeout_s: float = 10.0) -> None:
    """Wait until `predicate()` holds, re-checking each time `changed` is set."""
    async with asyncio.timeout(timeout_s):
        while not predicate():
            changed.clear()
            await changed.wait()


def deployment(text: str) -> config.Deployment:
    return config.parse(text).deployment


@dataclass
class EdgeHandle:
    url: str
    edge: Edge

    def client(self, **kw: object) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="test", max_retries=0, **kw)  # type: ignore[arg-type]

    def http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=30)


@asynccontextmanager
async def running_edge(dep: config.Deployment, nats_url: str) -> AsyncIterator[EdgeHandle]:
    nc = await bus.connect(nats_url, "test-edge", wait_s=5)
    edge = Edge(dep, nc, nats_url=nats_url)
    await edge.start()
    try:
        async with serve_asgi(build_app(edge)) as url:
            yield EdgeHandle(url, edge)
    finally:
        await edge.stop()
        await nc.close()


@asynccontextmanager
async def running_node(dep: config.Deployment, node_id: str, nats_url: str) -> AsyncIterator[NodeRuntime]:
    node = NodeRuntime(dep, node_id, nats_url)
    await node.start(connect_wait_s=5)
    try:
        yield node
    finally:
        await node.stop(grace_s=2)


@asynccontextmanager
async def deployment_running(dep: config.Deployment, nats_url: str) -> AsyncIterator[EdgeHandle]:
    """An edge plus every node of the deployment, returned once the edge sees all nodes connected."""
    async with running_edge(dep, nats_url) as handle:
        nodes = [running_node(dep, n.id, nats_url) for n in dep.nodes]
        entered = []
        try:
            for cm in nodes:
                await cm.__aenter__()
                entered.append(cm)
            await handle.edge.registry.wait_connected([n.id for n in dep.nodes], timeout_s=10)
            yield handle
        finally:
            for cm in reversed(entered):
                await cm.__aexit__(None, None, None)

"""Two edges on one pool: each sees the slots the other holds (from the nodes' heartbeats)."""

from __future__ import annotations

import asyncio

from iop.bus import EmbeddedNats
from tests.fakes import fake_upstream
from tests.harness import deployment, running_edge, running_node, until


def ask(content: str) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "user", "content": content}]}


async def test_an_edge_dispatches_where_the_other_edge_left_a_slot_free(nats_server: EmbeddedNats) -> None:
    url = nats_server.url
    gate = asyncio.Event()
    async with fake_upstream(gate=gate) as up_x, fake_upstream(gate=gate) as up_y:
        dep = deployment(f"""
edge:
  queue: {{timeout_s: 30, max_waiting: 100}}
models: [{{alias: m, pool: [x, y]}}]
nodes:
  - id: n
    adapters:
      - {{id: ux, type: openai, base_url: "{up_x.url}", api: both}}
      - {{id: uy, type: openai, base_url: "{up_y.url}", api: both}}
    providers: [{{id: x, adapter: ux, capacity: 1}}, {{id: y, adapter: uy, capacity: 1}}]
""")
        async with (
            running_edge(dep, url) as e1,
            running_edge(dep, url) as e2,
            running_node(dep, "n", url),
            e1.http() as http1,
            e2.http() as http2,
        ):
            for h in (e1, e2):
                await h.edge.registry.wait_connected(["n"], timeout_s=10)
            first = asyncio.create_task(http1.post("/v1/chat/completions", json=ask("one")))
            # Checked on every heartbeat (each second): the request has reached its upstream.
            await until(lambda: up_x.in_flight + up_y.in_flight == 1, e1.edge.registry.changed)
            held = "x" if up_x.in_flight else "y"
            free = "y" if held == "x" else "x"
            s2 = e2.edge.scheduler
            # The node's next heartbeat tells the second edge that the first holds `held`.
            await until(lambda: s2.providers[held].elsewhere == 1, e2.edge.registry.changed)
            assert s2.providers[held].free == 0 and s2.providers[free].free == 1

            # Two requests at the second edge: one goes to the free provider, the other waits in
            # this edge's FIFO (not in the broker behind the first edge's request).
            more = [asyncio.create_task(http2.post("/v1/chat/completions", json=ask(f"two{i}"))) for i in range(2)]
            await until(lambda: len(s2.pools["m"].waiters) == 1, s2.changed)
            assert s2.providers[free].in_flight == 1 and s2.providers[held].in_flight == 0
            await until(lambda: up_x.in_flight + up_y.in_flight == 2, e2.edge.registry.changed, timeout_s=5)

            gate.set()
            answers = [await t for t in (first, *more)]
            assert [a.status_code for a in answers] == [200, 200, 200]
            assert up_x.peak == 1 and up_y.peak == 1
            # Once the first edge's request is done, the heartbeat clears what the second edge counted.
            await until(lambda: s2.providers[held].elsewhere == 0, e2.edge.registry.changed)

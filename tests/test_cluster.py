"""iop on a 3-server NATS cluster (R3): two edges, a lost stream leader, a lost edge, bad cluster configs.

One cluster serves the whole module (it takes ~5 s to elect its JetStream leader); each test uses
its own provider ids, so the durable consumers of one test never meet another's.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from nats.js import JetStreamContext

from iop import config, wire
from iop.edge.qualification import RESULTS_BUCKET
from iop.errors import BusError
from iop.nats import connection, streams
from iop.nats.access import SECRET_FILE, Credentials
from iop.nats.server import EmbeddedNats
from tests.fakes import FakeUpstream, bound_socket, fake_upstream
from tests.harness import deployment, edge_process, eventually, iop_process, port_to_reuse, running_edge, running_node

pytestmark = pytest.mark.asyncio(loop_scope="module")

RETRYABLE = {429, 503}
"""What a client retries here: the edge says these before the request ran (502 may come after it ran)."""


@dataclass
class Cluster:
    servers: list[EmbeddedNats]
    routes: list[str]

    @property
    def url(self) -> str:
        """Every member, with the edge's credential: a client rides through the loss of any one."""
        return ",".join(s.url for s in self.servers)

    @property
    def addresses(self) -> str:
        return ",".join(s.address for s in self.servers)

    def by_name(self, name: str) -> EmbeddedNats:
        return next(s for s in self.servers if s.server_name == name)


def free_ports(n: int) -> list[int]:
    socks = [bound_socket() for _ in range(n)]
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def ports_to_reuse(n: int) -> list[int]:
    """n distinct ports no other process is handed meanwhile: a member killed and started again
    (test_stream_leader_killed_...) takes its client and route ports back."""
    ports: list[int] = []
    while len(ports) < n:
        if (p := port_to_reuse()) not in ports:
            ports.append(p)
    return ports


async def start_cluster(base: Path, name: str = "iop-test") -> Cluster:
    ports = ports_to_reuse(6)
    routes = [f"127.0.0.1:{p}" for p in ports[:3]]
    servers = []
    for i, listen in enumerate(routes):
        store = base / f"s{i}"
        store.mkdir(parents=True)
        # The members share one secret: a node's (and the routes') password works on any of them.
        if i == 0:
            Credentials.load(store)
        else:
            shutil.copy(base / "s0" / SECRET_FILE, store / SECRET_FILE)
        cluster = config.ClusterSettings(name=name, listen=listen, routes=routes, server_name=f"s{i}")
        servers.append(EmbeddedNats(f"127.0.0.1:{ports[3 + i]}", store, cluster=cluster))
    await asyncio.gather(*(s.start() for s in servers))
    return Cluster(servers, routes)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Cluster]:
    c = await start_cluster(tmp_path_factory.mktemp("cluster"))
    try:
        nc = await connection.connect(c.url, "test-cluster", wait_s=10)
        try:
            waited = await connection.wait_jetstream(nc, 30)
        finally:
            await nc.close()
        print(f"\n3-server cluster: JetStream usable {waited:.1f}s after the servers were ready")
        yield c
    finally:
        for s in c.servers:
            await s.stop()


def two_nodes_yaml(c: Cluster, prefix: str, up_a: FakeUpstream, up_b: FakeUpstream) -> str:
    # keepalive_s past the test's length: a client connection left idle through a recovery longer
    # than the default 5 s could be closed by the edge just as the client reuses it (an HTTP/1.1
    # race a client's retry covers, which the load here does not make), not a lost request.
    return f"""
edge:
  queue: {{timeout_s: 30, max_waiting: 1000}}
  http: {{keepalive_s: 120}}
  nats: {{url: "{c.addresses}", replicas: 3}}
models: [{{alias: m, pool: [{prefix}a, {prefix}b]}}]
nodes:
  - id: {prefix}na
    adapters: [{{id: up, type: openai, base_url: "{up_a.url}", api: both}}]
    providers: [{{id: {prefix}a, adapter: up, capacity: 2}}]
  - id: {prefix}nb
    adapters: [{{id: up, type: openai, base_url: "{up_b.url}", api: both}}]
    providers: [{{id: {prefix}b, adapter: up, capacity: 3}}]
"""


def ask(content: str) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "user", "content": content}]}


@dataclass
class Load:
    """Requests sent through several edges; what each got, and when answers came."""

    statuses: dict[str, list[int | str]] = field(default_factory=dict)
    """Per request: every attempt's status (or the exception's name when the connection failed)."""
    codes: dict[str, str] = field(default_factory=dict)
    """The error code of a request's last failed attempt."""
    answered_at: list[float] = field(default_factory=list)
    done: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def send(self, http: httpx.AsyncClient, name: str, *, retries: int = 0, retry_wait_s: float = 0.2) -> None:
        tries = self.statuses.setdefault(name, [])
        for attempt in range(retries + 1):
            try:
                r = await http.post("/v1/chat/completions", json=ask(name))
            except httpx.HTTPError as exc:
                tries.append(type(exc).__name__)
                break  # the edge itself is gone: nothing the client can retry there
            tries.append(r.status_code)
            if r.status_code != 200:
                self.codes[name] = r.json()["error"]["code"]
            if r.status_code == 200:
                self.answered_at.append(time.monotonic())
                break
            if r.status_code not in RETRYABLE or attempt == retries:
                break
            await asyncio.sleep(retry_wait_s)  # a client's back-off before its retry
        self.done += 1
        self.changed.set()

    async def run(
        self, clients: Sequence[httpx.AsyncClient], names: Sequence[str], concurrency: int, retries: int = 0
    ) -> None:
        """Each name once, round-robin over `clients`, at most `concurrency` at a time."""
        sem = asyncio.Semaphore(concurrency)

        async def one(i: int, name: str) -> None:
            async with sem:
                await self.send(clients[i % len(clients)], name, retries=retries)

        await asyncio.gather(*(one(i, n) for i, n in enumerate(names)))

    async def wait_done(self, n: int, timeout_s: float = 30) -> None:
        async with asyncio.timeout(timeout_s):
            while self.done < n:
                self.changed.clear()
                await self.changed.wait()


def runs_per_request(*ups: FakeUpstream) -> dict[str, int]:
    seen: dict[str, int] = {}
    for up in ups:
        for body in up.bodies:
            for m in body["messages"]:
                seen[m["content"]] = seen.get(m["content"], 0) + 1
    return seen


async def stream_leader(js: JetStreamContext) -> str:
    info = await js.stream_info(wire.WORK_STREAM)
    assert info.cluster is not None and info.cluster.leader
    return info.cluster.leader


async def test_stream_leader_killed_mid_load_nothing_lost_nothing_twice(cluster: Cluster, tmp_path: Path) -> None:
    async with fake_upstream(latency_s=0.25) as up_a, fake_upstream(latency_s=0.25) as up_b:
        dep = deployment(two_nodes_yaml(cluster, "l", up_a, up_b))
        async with (
            running_edge(dep, cluster.url) as e1,
            running_edge(dep, cluster.url) as e2,
            running_node(dep, "lna", cluster.url) as na,
            running_node(dep, "lnb", cluster.url) as nb,
            e1.http() as http1,
            e2.http() as http2,
        ):
            for h in (e1, e2):
                await h.edge.registry.wait_connected(["lna", "lnb"], timeout_s=10)
            js = e1.edge.js
            info = await js.stream_info(wire.WORK_STREAM)
            assert info.config.num_replicas == 3
            kv = await js.stream_info("KV_" + streams.CATALOG_BUCKET)
            assert kv.config.num_replicas == 3

            load = Load()
            names = [f"r{i}" for i in range(60)]
            # Retries as a client does on 503: the test below proves each such failure came before
            # the request ran (the upstream saw every name exactly once).
            running = asyncio.create_task(load.run([http1, http2], names, concurrency=16, retries=5))
            await load.wait_done(12)
            leader = cluster.by_name(await stream_leader(js))
            assert leader.pid is not None
            os.kill(leader.pid, signal.SIGKILL)  # a server this test started, by its PID
            killed = time.monotonic()
            await asyncio.wait_for(running, 90)
            # The longest silence in answers after the kill: how long the cluster took to serve again.
            after = sorted(t for t in load.answered_at if t > killed)
            gaps = [b - a for a, b in zip([killed, *after], after, strict=False)]
            recover_s = max(gaps)
            new_leader = await stream_leader(js)
            resends = e1.edge.relay.recovery.resends + e2.edge.relay.recovery.resends
            duplicates = e1.edge.relay.duplicates + e2.edge.relay.duplicates
            resent = sum(n._running.replay.resent for n in (na, nb) if n._running is not None)

            # Every request answered: replies lost with the server (core NATS) were sent again by
            # their node, and a request that failed did so before it ran, retryably, and was then
            # served on the client's retry.
            unanswered = {n: s for n, s in load.statuses.items() if s[-1] != 200}
            assert not unanswered, (unanswered, load.codes)
            retried = {n: s for n, s in load.statuses.items() if len(s) > 1}
            assert all(set(s[:-1]) <= RETRYABLE for s in retried.values()), retried
            assert runs_per_request(up_a, up_b) == dict.fromkeys(names, 1)
            assert up_a.peak <= 2 and up_b.peak <= 3, (up_a.peak, up_b.peak)
            assert new_leader != leader.server_name

            # The killed server comes back (same store, same ports), catches up and serves.
            try:
                await leader.restart()
            except BusError as exc:
                # Its client port was taken meanwhile (other tests run on this machine): any port
                # serves, the members find it by its route port and clients by the others' INFO.
                assert "address already in use" in str(exc)
                leader.port = 0
                await leader.start()
            restarted = time.monotonic()

            async def caught_up() -> bool:
                info = await js.stream_info(wire.WORK_STREAM)
                peers = {p.name: p.current for p in (info.cluster.replicas or [])} if info.cluster else {}
                peers[info.cluster.leader if info.cluster else ""] = True
                return bool(peers.get(leader.server_name or "")) and len(peers) == 3

            await eventually(caught_up, timeout_s=30, every_s=0.1)
            caught_s = time.monotonic() - restarted
            more = Load()
            await more.run([http1, http2], [f"after{i}" for i in range(10)], concurrency=5)
            assert all(s == [200] for s in more.statuses.values()), more.statuses

            # The operator's view of the same: every server up, every stream R3 with current replicas.
            cfg = tmp_path / "iop.yaml"
            cfg.write_text(two_nodes_yaml(cluster, "l", up_a, up_b))
            async with iop_process("edge", "--config", str(cfg), "--nats", cluster.url, "--check-cluster") as p:
                assert await p.exit_code() == 0, p.lines
            assert sum(line.startswith("server ") and "JetStream ok" in line for line in p.stdout) == 3, p.stdout
            work = next(line for line in p.stdout if line.startswith(f"stream {wire.WORK_STREAM}:"))
            assert "R3" in work and work.count("(current)") == 2 and "(leader)" in work, work
    print(
        f"\nstream leader {leader.server_name} SIGKILLed mid-load: new leader {new_leader}; longest pause in answers "
        f"{recover_s:.2f}s; {len(retried)} of {len(names)} requests got a retryable 503 first; "
        f"{resends} resends asked, {resent} replies sent again, {duplicates} copies dropped; "
        f"restarted server current again {caught_s:.2f}s after restart"
    )


async def test_edge_killed_mid_load_the_other_keeps_serving_with_exact_caps(cluster: Cluster, tmp_path: Path) -> None:
    async with fake_upstream(latency_s=0.25) as up_a, fake_upstream(latency_s=0.25) as up_b:
        text = two_nodes_yaml(cluster, "k", up_a, up_b)
        dep = deployment(text)
        cfg = tmp_path / "iop.yaml"
        cfg.write_text(text)
        async with (
            edge_process(cfg, cluster.url) as (edge_a, url_a),
            edge_process(cfg, cluster.url) as (_, url_b),
            running_node(dep, "kna", cluster.url),
            running_node(dep, "knb", cluster.url),
            httpx.AsyncClient(base_url=url_a, timeout=60) as http_a,
            httpx.AsyncClient(base_url=url_b, timeout=60) as http_b,
        ):

            async def both_see_nodes() -> bool:
                for http in (http_a, http_b):
                    st = (await http.get("/status")).json()
                    if not all(n["connected"] for n in st["nodes"]):
                        return False
                return True

            await eventually(both_see_nodes, timeout_s=15, every_s=0.1)
            load_a, load_b = Load(), Load()
            names_a = [f"a{i}" for i in range(20)]
            names_b = [f"b{i}" for i in range(40)]
            on_a = asyncio.create_task(load_a.run([http_a], names_a, concurrency=6))
            on_b = asyncio.create_task(load_b.run([http_b], names_b, concurrency=6))
            await load_a.wait_done(5)
            edge_a.kill()  # SIGKILL, by PID, a process this test started
            await asyncio.wait_for(asyncio.gather(on_a, on_b), 90)

            # Every request of the surviving edge is answered; the killed edge's clients saw their
            # connection go (or had their answer before), and nothing ran twice or over a cap.
            assert all(s == [200] for s in load_b.statuses.values()), load_b.statuses
            lost = {n: s for n, s in load_a.statuses.items() if s != [200]}
            assert lost and all(isinstance(s[0], str) for s in lost.values()), load_a.statuses
            runs = runs_per_request(up_a, up_b)
            assert all(runs.get(n) == 1 for n in names_b)
            assert max(runs.values()) == 1
            assert up_a.peak <= 2 and up_b.peak <= 3, (up_a.peak, up_b.peak)
    print(f"\nedge SIGKILLed: {len(lost)} of its {len(names_a)} requests lost with it; the other edge served all 40")


async def test_bad_cluster_configs_one_line_each(tmp_path: Path) -> None:
    store = tmp_path / "nats"
    routes = [f"127.0.0.1:{p}" for p in free_ports(3)]

    def cluster_yaml(name: str, replicas: int, members: list[str]) -> str:
        return f"""
edge:
  nats:
    store_dir: "{store}"
    listen: "127.0.0.1:0"
    replicas: {replicas}
    cluster: {{name: {name}, listen: "{routes[0]}", routes: [{", ".join(members)}], start_wait_s: 3}}
models: []
nodes: []
"""

    # replicas > servers: the file says so, before anything starts.
    too_many = tmp_path / "too-many.yaml"
    too_many.write_text(cluster_yaml("c", 3, routes[:2]))
    async with iop_process("edge", "--config", str(too_many), "--listen", "127.0.0.1:0") as p:
        assert await p.exit_code() != 0
    assert any("replicas: 3 replicas need at least 3 JetStream servers" in line for line in p.stderr), p.stderr

    # Unreachable routes: only the running server can tell, within the bounded wait.
    unreachable = tmp_path / "unreachable.yaml"
    unreachable.write_text(cluster_yaml("c", 1, routes))
    async with iop_process("edge", "--config", str(unreachable), "--listen", "127.0.0.1:0") as p:
        assert await p.exit_code(30) != 0
    problem = [line for line in p.stderr if "not available within 3s" in line]
    assert problem and "connect to route" in problem[0] and "refused" in problem[0], p.stderr

    # A member of another cluster name: its routes are rejected, named as such.
    other = await start_cluster(tmp_path / "other", name="other-cluster")
    try:
        shutil.copy(other.servers[0].store_dir / SECRET_FILE, store / SECRET_FILE)
        mismatched = tmp_path / "mismatched.yaml"
        mismatched.write_text(
            cluster_yaml("mine", 1, other.routes).replace(f'listen: "{routes[0]}"', f'listen: "{routes[1]}"')
        )
        async with iop_process("edge", "--config", str(mismatched), "--listen", "127.0.0.1:0") as p:
            assert await p.exit_code(30) != 0
        problem = [line for line in p.stderr if "not available within 3s" in line]
        assert problem and "does not match" in problem[0], p.stderr
    finally:
        for s in other.servers:
            await s.stop()


async def test_with_replicas_3_the_qualification_bucket_is_made_r3(cluster: Cluster) -> None:
    async with fake_upstream() as up_a, fake_upstream() as up_b:
        dep = deployment(two_nodes_yaml(cluster, "q", up_a, up_b))
        async with running_edge(dep, cluster.url) as h:
            # Before: R1 on one server, so losing that one server stopped any other edge's start.
            info = await h.edge.js.stream_info("KV_" + RESULTS_BUCKET)
            assert info.config.num_replicas == 3
            assert info.cluster is not None and len(info.cluster.replicas or []) == 2
            # A deletion's announcement is not ordered across the cluster's servers: no turn cache.
            store = h.edge.responses.store
            assert store is not None and store.fresh is None


async def test_nodes_with_their_own_accounts_serve_from_any_member(cluster: Cluster) -> None:
    # Each node connects to one member with its own user, the edge to another: a node's pulls,
    # acks and catalog read cross into the edges' account on its member and reach the streams'
    # leaders wherever they are (iop/nats/auth.py).
    async with fake_upstream() as up_a, fake_upstream() as up_b:
        dep = deployment(two_nodes_yaml(cluster, "o", up_a, up_b))
        for s in cluster.servers:
            await s.authorize(dep.nodes)
        one, two, three = cluster.servers
        async with (
            running_edge(dep, one.url) as h,
            running_node(dep, "ona", two.address, access=two.node_access("ona")),
            running_node(dep, "onb", three.address, access=three.node_access("onb")),
            h.http() as http,
        ):
            await h.edge.registry.wait_connected(["ona", "onb"], timeout_s=10)
            answers = await asyncio.gather(*(http.post("/v1/chat/completions", json=ask(f"o{i}")) for i in range(10)))
            assert [r.status_code for r in answers] == [200] * 10
            assert up_a.total >= 1 and up_b.total >= 1 and up_a.total + up_b.total == 10


async def test_edges_started_together_on_a_fresh_cluster_all_come_up(tmp_path: Path) -> None:
    fresh = await start_cluster(tmp_path / "fresh")
    try:
        async with fake_upstream() as up_a, fake_upstream() as up_b:
            cfg = tmp_path / "iop.yaml"
            cfg.write_text(two_nodes_yaml(fresh, "t", up_a, up_b))
            args = ("edge", "--config", str(cfg), "--listen", "127.0.0.1:0", "--nats", fresh.url)
            # Started at once, before the cluster has a JetStream leader, as after a power cut.
            async with iop_process(*args, stop_grace_s=0) as e1, iop_process(*args, stop_grace_s=0) as e2:
                started = await asyncio.gather(
                    *(e.wait_line(r"iop edge listening on (http://\S+)", timeout_s=60) for e in (e1, e2)),
                    return_exceptions=True,
                )
                # Before: the second died with NoRespondersError in publish_catalog (a traceback).
                assert all(not isinstance(s, BaseException) for s in started), (started, e1.lines[-8:], e2.lines[-8:])
                password = fresh.servers[0].access.password
                assert password
                for e in (e1, e2):
                    assert not any("Traceback" in line for line in e.lines), e.lines
                    # The URL came with the edge's password: the log shows it without.
                    assert not any(password in line for line in e.lines), "a NATS password reached the log"
                urls = [s.group(1) for s in started if not isinstance(s, BaseException)]
                for url in urls:
                    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
                        assert (await http.get("/v1/models")).status_code == 200
                        assert password not in (await http.get("/status")).text
    finally:
        for s in fresh.servers:
            await s.stop()


async def test_three_embedded_cluster_edges_started_at_once_all_come_up(tmp_path: Path) -> None:
    routes = [f"127.0.0.1:{p}" for p in free_ports(3)]
    configs = []
    for i, listen in enumerate(routes):
        store = tmp_path / f"m{i}"
        store.mkdir()
        # The members share one secret (docs/scale-out.md): copied as an operator does.
        if i == 0:
            Credentials.load(store)
        else:
            shutil.copy(tmp_path / "m0" / SECRET_FILE, store / SECRET_FILE)
        cfg = tmp_path / f"m{i}.yaml"
        cfg.write_text(f"""
edge:
  nats:
    store_dir: "{store}"
    listen: "127.0.0.1:0"
    replicas: 3
    cluster: {{name: power-cut, listen: "{listen}", routes: [{", ".join(routes)}], server_name: m{i}}}
models: [{{alias: m, pool: [p]}}]
nodes:
  - id: n
    adapters: [{{id: sim, type: mock}}]
    providers: [{{id: p, adapter: sim, capacity: 2}}]
""")
        configs.append(cfg)
    async with contextlib.AsyncExitStack() as stack:
        # All three at once, as machines do after a power cut.
        edges = [
            await stack.enter_async_context(
                iop_process("edge", "--config", str(c), "--listen", "127.0.0.1:0", stop_grace_s=5)
            )
            for c in configs
        ]
        started = await asyncio.gather(
            *(e.wait_line(r"iop edge listening on (http://\S+)", timeout_s=90) for e in edges), return_exceptions=True
        )
        # Before: at least one died on its first start (9 of 9 tries), some with a traceback.
        assert all(not isinstance(s, BaseException) for s in started), [e.lines[-4:] for e in edges]
        for e in edges:
            assert not any("Traceback" in line for line in e.lines), e.lines
            assert e.proc.returncode is None

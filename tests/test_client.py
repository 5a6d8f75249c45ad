"""The edge's HTTP client and the /status schema: `iop status`, the address rules, the document's shape."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from iop.cli import main
from iop.client import EdgeAddressError, edge_url, edge_url_of
from iop.contracts.status import CliResourceStatus, PoolProviderStatus, decode_status
from iop.nats.server import EmbeddedNats
from tests.harness import deployment, deployment_running

MIXED = """
models:
  - {alias: m, pool: [prov]}
  - {alias: agent, route: node-c/agent-cli}
nodes:
  - id: node-c
    concurrency: 4
    adapters:
      - {id: agent, type: cli, command: [cat]}
      - {id: fake, type: mock, latency_ms: 0, tokens: 2}
    providers:
      - {id: agent-cli, adapter: agent}
      - {id: prov, adapter: fake, capacity: 2}
"""

# The field names of /status as readers outside iop know them; a rename breaks them.
NODE_FIELDS = {"id", "connected", "last_seen", "last_seen_s_ago", "instance", "version", "legacy_concurrency", "device"}
PROVIDER_FIELDS = {
    "id",
    "kind",
    "adapter",
    "type",
    "model",
    "capacity",
    "unlimited",
    "in_flight",
    "peak_in_flight",
    "served",
    "failed",
}
POOL_PROVIDER_FIELDS = {"pools", "dispatched_in_flight", "queued", "breaker", "consecutive_failures"}
POOL_FIELDS = {
    "alias",
    "candidates",
    "connected_candidates",
    "total_capacity",
    "connected_capacity",
    "usable_capacity",
    "retry_after_s",
    "in_flight",
    "dispatched_in_flight",
    "waiting",
    "running",
    "peak_running",
    "queue_wait_p50_ms",
    "queue_wait_p95_ms",
    "affinity_wait_ms",
    "affinity_hits",
    "affinity_misses",
    "endpoints",
    "tenants",
}


@pytest.mark.parametrize(
    ("address", "url"),
    [
        ("127.0.0.1:8080", "http://127.0.0.1:8080"),
        ("localhost", "http://localhost"),
        (" http://edge:8080/ ", "http://edge:8080"),
        ("https://edge.example/iop/", "https://edge.example/iop"),
        ("[::1]:8080", "http://[::1]:8080"),
    ],
)
def test_edge_url_adds_the_scheme_a_host_port_lacks(address: str, url: str) -> None:
    assert edge_url(address) == url


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("", "empty"),
        ("ftp://edge:21", "not ftp://"),
        ("http://", "no host"),
        ("edge:port", "not a valid address"),
        ("edge:99999", "not a valid address"),
        ("edge:8080/?x=1", "no ?query"),
    ],
)
def test_edge_url_refuses_what_is_not_an_http_address(address: str, why: str) -> None:
    with pytest.raises(EdgeAddressError, match=why.replace("?", r"\?")):
        edge_url(address)


def test_edge_url_of_a_file_reaches_a_wildcard_listen_on_loopback() -> None:
    dep = deployment("edge: {listen: '0.0.0.0:9123', allow_anonymous: true}\nnodes: []\n")
    assert edge_url_of(dep) == "http://127.0.0.1:9123"
    lan = deployment("edge: {listen: 'edge.lan:80', allow_anonymous: true}\n")
    assert edge_url_of(lan) == "http://edge.lan:80"


@pytest.mark.parametrize("command", [["status"], ["refresh", "--config", "{file}"]])
def test_a_bad_edge_address_is_one_line_and_exit_2(command: list[str], tmp_path: Path) -> None:
    f = tmp_path / "iop.yaml"
    f.write_text(MIXED)
    args = [a.replace("{file}", str(f)) for a in command]
    done = CliRunner().invoke(main, [*args, "--edge", "ftp://edge:21"])
    assert done.exit_code == 2
    assert done.output == "iop: --edge 'ftp://edge:21': the edge speaks http:// or https://, not ftp://\n"


def test_an_unreachable_edge_is_one_line_and_exit_1() -> None:
    done = CliRunner().invoke(main, ["status", "--edge", "127.0.0.1:9"])
    assert done.exit_code == 1
    assert done.output.startswith("iop: cannot reach the edge at http://127.0.0.1:9: ConnectError")
    assert done.output.count("\n") == 1


async def iop(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "iop", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_status_keeps_its_field_names_and_decodes_into_the_schema(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    async with deployment_running(deployment(MIXED), nats_server.url) as h, h.http() as http:
        raw = (await http.get("/status")).json()
        assert set(raw) == {"edge", "nodes", "pools", "routes", "tenants"}
        assert raw["tenants"] == []  # no tenant in this deployment has rpm, tpm or a budget
        assert set(raw["edge"]) == {"id", "version", "uptime_s", "nats", "nats_connected", "drift", "storage_error"}
        (node,) = raw["nodes"]
        assert set(node) == NODE_FIELDS | {"providers"}
        cli, pool_provider = node["providers"]
        assert set(cli) == PROVIDER_FIELDS | {"route"}
        assert set(pool_provider) == PROVIDER_FIELDS | POOL_PROVIDER_FIELDS
        assert (cli["kind"], pool_provider["kind"]) == ("cli", "pool")
        assert set(raw["pools"][0]) == POOL_FIELDS
        assert set(raw["routes"][0]) == {"alias", "node", "resource", "connected", "endpoints"}
        assert raw["pools"][0]["endpoints"] and raw["routes"][0]["endpoints"]

        st = await h.status()
        (n,) = st.nodes
        assert n.connected and n.legacy_concurrency == 4
        cli_st, prov_st = n.providers
        assert isinstance(cli_st, CliResourceStatus) and cli_st.route == "agent" and cli_st.unlimited
        assert isinstance(prov_st, PoolProviderStatus) and prov_st.pools == ["m"] and prov_st.breaker == "closed"
        assert st.pool("m") is not None and st.route("agent") is not None

        # `iop status` finds the edge in the file's edge.listen (a wildcard host means this machine).
        port = h.url.rsplit(":", 1)[1]
        f = tmp_path / "iop.yaml"
        f.write_text(MIXED.replace("models:", f"edge: {{listen: '0.0.0.0:{port}', allow_anonymous: true}}\nmodels:", 1))
        code, out, err = await iop("status", "--config", str(f))
        assert code == 0, err
        assert "agent-cli" in out and "legacy-concurrency=4" in out and "2/2" in out
        # --edge without http:// works, and --json is the edge's document.
        code, out, err = await iop("status", "--edge", f"127.0.0.1:{port}", "--json")
        assert code == 0, err
        assert decode_status(out).nodes[0].id == "node-c"
        assert json.loads(out)["nodes"][0]["providers"][1]["kind"] == "pool"

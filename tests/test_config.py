"""The deployment file: every validation rule, the shipped configs, and `iop config` on the command line."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from iop import config, configview
from iop.cli import main
from iop.errors import ConfigError
from iop.yamldoc import render

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
PACKAGED = ROOT / "iop" / "configs"

_BASE: dict[str, Any] = {
    "edge": {"listen": "127.0.0.1:8080", "nats": {"url": "embedded", "listen": "127.0.0.1:4222"}},
    "models": [
        {"alias": "qwen-coder", "pool": ["mac-mlx", "gpu-a-vllm"]},
        {"alias": "codex", "route": "mac/codex-cli"},
    ],
    "nodes": [
        {
            "id": "mac",
            "adapters": [
                {"id": "codex", "type": "cli", "command": ["codex", "exec", "-"]},
                {"id": "mlx", "type": "openai", "base_url": "http://127.0.0.1:8000/v1"},
            ],
            "providers": [
                {"id": "codex-cli", "adapter": "codex"},
                {"id": "mac-mlx", "adapter": "mlx", "capacity": 2},
            ],
        },
        {
            "id": "gpu-a",
            "adapters": [{"id": "vllm", "type": "mock", "tokens": 4}],
            "providers": [{"id": "gpu-a-vllm", "adapter": "vllm", "model": "qwen", "capacity": 4}],
        },
    ],
}


def base() -> dict[str, Any]:
    return copy.deepcopy(_BASE)


def problems(data: object) -> list[str]:
    """The problem lines for `data`; fails the test if it is valid."""
    with pytest.raises(ConfigError) as info:
        config.parse(yaml.safe_dump(data, sort_keys=False))
    return info.value.problems


def only_problem(data: object) -> str:
    found = problems(data)
    assert len(found) == 1, found
    return found[0]


def test_config_base_is_valid() -> None:
    loaded = config.parse(yaml.safe_dump(base(), sort_keys=False))
    assert loaded.warnings == []
    assert [n.id for n in loaded.deployment.nodes] == ["mac", "gpu-a"]


# --- the YAML itself ---------------------------------------------------------------------------


def test_config_yaml_syntax_error_is_one_line_with_its_line_number() -> None:
    with pytest.raises(ConfigError) as info:
        config.parse("edge:\n  listen: [a\nmodels: []\n", "deploy.yaml")
    [line] = info.value.problems
    assert line.startswith("deploy.yaml: line 3, column 7: not valid YAML: ")


def test_config_tab_indentation_is_a_syntax_error() -> None:
    with pytest.raises(ConfigError) as info:
        config.parse("edge: {}\n\tmodels: []\n", "d.yaml")
    assert info.value.problems[0].startswith("d.yaml: line 2")


@pytest.mark.parametrize("text", ["", "   \n", "# only a comment\n", "null\n"])
def test_config_empty_file_is_an_error(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        config.parse(text, "d.yaml")
    assert info.value.problems == ["d.yaml: the file is empty; a deployment needs at least models and nodes"]


@pytest.mark.parametrize(("text", "kind"), [("- a\n- b\n", "a list"), ("hello\n", "str 'hello'")])
def test_config_top_level_must_be_a_mapping(text: str, kind: str) -> None:
    with pytest.raises(ConfigError) as info:
        config.parse(text, "d.yaml")
    assert info.value.problems == [f"d.yaml: the top level must be a mapping (edge, models, nodes), not {kind}"]


def test_config_duplicate_yaml_keys_are_rejected() -> None:
    text = yaml.safe_dump(base(), sort_keys=False) + "models: []\n"
    with pytest.raises(ConfigError) as info:
        config.parse(text)
    [line] = info.value.problems
    assert line.startswith("models: duplicate key (also on line ")


def test_config_python_tags_are_refused() -> None:
    with pytest.raises(ConfigError) as info:
        config.parse("edge: !!python/object/apply:os.system [echo hi]\n", "d.yaml")
    assert "d.yaml: line 1" in info.value.problems[0]


def test_config_recursive_alias_is_refused() -> None:
    with pytest.raises(ConfigError) as info:
        config.parse("models: &m [*m]\n", "d.yaml")
    assert info.value.problems == [
        "d.yaml: line 1, column 9: not valid YAML: an alias refers to a node that contains it"
    ]


def test_config_merge_keys_are_not_duplicate_keys() -> None:
    text = """
models: [{alias: a, pool: [p, q]}]
nodes:
  - id: n
    adapters:
      - &fast {id: m, type: mock, tokens: 3}
      - {<<: *fast, id: m2, tokens: 5}
    providers: [{id: p, adapter: m, capacity: 1}, {id: q, adapter: m2, capacity: 1}]
"""
    adapters = config.parse(text).deployment.nodes[0].adapters
    assert [(a.id, getattr(a, "tokens", None)) for a in adapters] == [("m", 3), ("m2", 5)]


def test_config_load_missing_file_is_one_clear_line(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        config.load(missing)
    assert info.value.problems == [f"{missing}: no such file"]


def test_config_load_non_utf8_file(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"edge:\n  listen: '\xe9:1'\n")
    with pytest.raises(ConfigError) as info:
        config.load(path)
    assert info.value.problems == [f"{path}: line 2: not UTF-8 text"]


# --- types and unknown fields ------------------------------------------------------------------


def test_config_wrong_type_capacity() -> None:
    data = base()
    data["nodes"][0]["providers"][1]["capacity"] = "two"
    assert only_problem(data) == "nodes[0].providers[1].capacity: expected an integer, got 'two'"


def test_config_wrong_type_command_as_string() -> None:
    data = base()
    data["nodes"][0]["adapters"][0]["command"] = "codex"
    assert only_problem(data) == "nodes[0].adapters[0].command: expected a list, got 'codex'"


def test_config_wrong_type_bool_is_not_a_number() -> None:
    data = base()
    data["edge"]["queue"] = {"timeout_s": True}
    assert only_problem(data) == "edge.queue.timeout_s: expected a number, got true"


def test_config_wrong_type_section_not_a_mapping() -> None:
    data = base()
    data["edge"]["nats"] = "nats://h:4222"
    assert only_problem(data) == "edge.nats: expected a mapping, got 'nats://h:4222'"


def test_config_unknown_field_suggests_the_closest_name() -> None:
    data = base()
    provider = data["nodes"][0]["providers"][1]
    provider["capcity"] = provider.pop("capacity")
    found = problems(data)
    assert "nodes[0].providers[1].capcity: unknown field; did you mean 'capacity'?" in found


def test_config_unknown_field_without_a_near_name_lists_the_known_ones() -> None:
    data = base()
    data["edge"]["frobnicate"] = 1
    assert only_problem(data) == (
        "edge.frobnicate: unknown field; known fields: listen, nats, queue, http, api_keys_env, admin_keys_env, "
        "allow_anonymous, allowed_hosts, max_body_mb, ledger, responses, metrics_public, tenants, tenant_defaults"
    )


def test_config_unknown_top_level_field() -> None:
    data = base()
    data["node"] = []
    assert only_problem(data) == "node: unknown field; did you mean 'nodes'?"


def test_config_unknown_adapter_type_lists_the_known_types() -> None:
    data = base()
    data["nodes"][1]["adapters"][0]["type"] = "vllm"
    assert only_problem(data) == "nodes[1].adapters[0].type: unknown type 'vllm' (known types: cli, openai, mock)"


def test_config_misspelt_adapter_type_suggests_one() -> None:
    data = base()
    data["nodes"][1]["adapters"][0]["type"] = "mocks"
    assert only_problem(data).endswith("did you mean 'mock'?")


def test_config_adapter_without_type() -> None:
    data = base()
    del data["nodes"][1]["adapters"][0]["type"]
    assert only_problem(data) == "nodes[1].adapters[0].type: missing (required: one of cli, openai, mock)"


def test_config_missing_required_field() -> None:
    data = base()
    del data["nodes"][0]["adapters"][1]["base_url"]
    assert only_problem(data) == "nodes[0].adapters[1].base_url: missing (required)"


def test_config_api_must_be_a_known_value() -> None:
    data = base()
    data["nodes"][0]["adapters"][1]["api"] = "chats"
    assert only_problem(data) == (
        "nodes[0].adapters[1].api: expected one of both, chat, responses, got 'chats'; did you mean 'chat'?"
    )


# --- ids ---------------------------------------------------------------------------------------


def test_config_duplicate_node_id() -> None:
    data = base()
    data["nodes"][1]["id"] = "mac"
    assert only_problem(data) == "nodes[1].id: duplicate node id 'mac' (also nodes[0])"


def test_config_duplicate_adapter_id_within_a_node() -> None:
    data = base()
    data["nodes"][0]["adapters"][1]["id"] = "codex"
    found = problems(data)
    assert found[0] == "nodes[0].adapters[1].id: duplicate adapter id 'codex' in node 'mac'"


def test_config_same_adapter_id_on_two_nodes_is_fine() -> None:
    data = base()
    data["nodes"][1]["adapters"][0]["id"] = "mlx"
    data["nodes"][1]["providers"][0]["adapter"] = "mlx"
    config.parse(yaml.safe_dump(data))


def test_config_duplicate_provider_id_across_nodes_names_both_places() -> None:
    data = base()
    data["nodes"][1]["providers"][0]["id"] = "mac-mlx"
    data["models"][0]["pool"] = ["mac-mlx"]
    assert only_problem(data) == (
        "nodes[1].providers[0].id: duplicate provider id 'mac-mlx', also nodes[0].providers[1] on node 'mac' "
        "(provider ids are unique across the deployment)"
    )


def test_config_duplicate_alias() -> None:
    data = base()
    data["models"][1]["alias"] = "qwen-coder"
    assert only_problem(data) == "models[1].alias: duplicate alias 'qwen-coder' (also models[0])"


@pytest.mark.parametrize("bad", ["gpu.a", "gpu a", "gpu>", "gpu*"])
def test_config_ids_must_be_nats_subject_tokens(bad: str) -> None:
    data = base()
    data["nodes"][1]["id"] = bad
    line = only_problem(data)
    assert line.startswith(f"nodes[1].id: {bad!r} is not a valid id: use only letters, digits, '_' and '-'")
    assert "NATS subject tokens" in line


def test_config_ids_must_not_be_empty() -> None:
    data = base()
    data["nodes"][0]["adapters"][0]["id"] = ""
    found = problems(data)
    assert "nodes[0].adapters[0].id: must not be empty" in found


def test_config_alias_may_not_contain_spaces() -> None:
    data = base()
    data["models"][1]["alias"] = "my codex"
    assert only_problem(data) == "models[1].alias: 'my codex': an alias may not contain whitespace"


# --- providers, adapters and capacity ----------------------------------------------------------


def test_config_provider_adapter_must_be_on_the_same_node() -> None:
    data = base()
    data["nodes"][1]["providers"][0]["adapter"] = "mlx"  # an adapter of node 'mac', not of 'gpu-a'
    assert only_problem(data) == (
        "nodes[1].providers[0].adapter: 'mlx' is not an adapter of node 'gpu-a' (its adapters: vllm)"
    )


def test_config_provider_on_openai_adapter_needs_capacity() -> None:
    data = base()
    del data["nodes"][0]["providers"][1]["capacity"]
    assert only_problem(data).startswith(
        "nodes[0].providers[1].capacity: missing: a provider on openai adapter 'mlx' needs a capacity"
    )


def test_config_provider_on_mock_adapter_needs_capacity() -> None:
    data = base()
    data["nodes"][1]["providers"][0]["capacity"] = None
    assert only_problem(data).startswith("nodes[1].providers[0].capacity: missing: a provider on mock adapter")


def test_config_capacity_must_be_at_least_one() -> None:
    data = base()
    data["nodes"][1]["providers"][0]["capacity"] = 0
    assert only_problem(data) == "nodes[1].providers[0].capacity: must be at least 1, got 0"


def test_config_provider_on_cli_adapter_must_not_have_capacity() -> None:
    data = base()
    data["nodes"][0]["providers"][0]["capacity"] = 3
    assert only_problem(data) == (
        "nodes[0].providers[0].capacity: not allowed: 'codex' is a cli adapter; CLI resources are unlimited"
    )


# --- aliases -----------------------------------------------------------------------------------


def test_config_pool_member_must_exist() -> None:
    data = base()
    data["models"][0]["pool"] = ["mac-mlx", "gpu-a-vlm"]
    assert only_problem(data) == "models[0].pool[1]: no provider 'gpu-a-vlm'; did you mean 'gpu-a-vllm'?"


def test_config_pool_member_must_not_be_cli() -> None:
    data = base()
    data["models"][0]["pool"].append("codex-cli")
    assert only_problem(data).startswith(
        "models[0].pool[2]: 'codex-cli' is a CLI resource (unlimited, no capacity) and cannot be in a pool"
    )


def test_config_pool_member_listed_twice() -> None:
    data = base()
    data["models"][0]["pool"].append("mac-mlx")
    assert only_problem(data) == "models[0].pool[2]: 'mac-mlx' is listed twice"


def test_config_pool_must_not_be_empty() -> None:
    data = base()
    data["models"][0]["pool"] = []
    found = problems(data)
    assert found[0] == "models[0].pool: must not be empty"


def test_config_route_must_be_node_slash_provider() -> None:
    data = base()
    data["models"][1]["route"] = "codex-cli"
    assert only_problem(data) == "models[1].route: expected node/provider, got 'codex-cli'"


def test_config_route_node_must_exist() -> None:
    data = base()
    data["models"][1]["route"] = "mc/codex-cli"
    assert only_problem(data) == "models[1].route: no node 'mc'; did you mean 'mac'?"


def test_config_route_provider_must_be_on_that_node() -> None:
    data = base()
    data["models"][1]["route"] = "gpu-a/codex-cli"
    assert only_problem(data) == (
        "models[1].route: node 'gpu-a' has no provider 'codex-cli' (its providers: gpu-a-vllm); "
        "'codex-cli' is on node 'mac'"
    )


def test_config_route_suggests_the_nearest_provider_of_that_node() -> None:
    data = base()
    data["models"][1]["route"] = "mac/codex"  # the adapter's id, not the provider's
    assert only_problem(data) == (
        "models[1].route: node 'mac' has no provider 'codex' (its providers: codex-cli, mac-mlx); "
        "did you mean 'codex-cli'?"
    )


def test_config_route_must_name_a_cli_resource() -> None:
    data = base()
    data["models"][1]["route"] = "mac/mac-mlx"
    assert only_problem(data) == (
        "models[1].route: 'mac-mlx' is not a CLI resource (it has a capacity); put it in a pool instead"
    )


def test_config_alias_needs_pool_or_route() -> None:
    data = base()
    del data["models"][1]["route"]
    assert problems(data)[0] == "models[1]: needs a pool (provider ids) or a route (node/provider)"


def test_config_alias_has_not_both_pool_and_route() -> None:
    data = base()
    data["models"][1]["pool"] = ["mac-mlx"]
    assert only_problem(data) == "models[1].route: an alias has a pool or a route, not both"


# --- values ------------------------------------------------------------------------------------


@pytest.mark.parametrize("url", ["127.0.0.1:8000/v1", "ftp://h/v1", "http:///v1", "http://h:99999/v1"])
def test_config_base_url_must_be_http_with_a_host(url: str) -> None:
    data = base()
    data["nodes"][0]["adapters"][1]["base_url"] = url
    assert only_problem(data) == (
        f"nodes[0].adapters[1].base_url: expected an http:// or https:// URL with a host, got {url!r}"
    )


def test_config_command_items_must_not_be_empty() -> None:
    data = base()
    data["nodes"][0]["adapters"][0]["command"] = ["codex", ""]
    assert only_problem(data) == "nodes[0].adapters[0].command[1]: must not be empty"


def test_config_command_must_not_be_empty() -> None:
    data = base()
    data["nodes"][0]["adapters"][0]["command"] = []
    assert only_problem(data) == "nodes[0].adapters[0].command: must not be empty"


def test_config_command_items_must_be_strings() -> None:
    data = base()
    data["nodes"][0]["adapters"][0]["command"] = ["sleep", 5]
    assert only_problem(data) == "nodes[0].adapters[0].command[1]: expected a string, got 5"


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("nodes", 0, "adapters", 0, "timeout_s"), 0, "must be greater than 0, got 0"),
        (("nodes", 0, "adapters", 1, "timeout_s"), -5, "must be greater than 0, got -5"),
        (("nodes", 1, "adapters", 0, "latency_ms"), -1, "must be at least 0, got -1"),
        (("nodes", 1, "adapters", 0, "token_interval_ms"), -0.5, "must be at least 0, got -0.5"),
        (("nodes", 1, "adapters", 0, "tokens"), -1, "must be at least 0, got -1"),
        (("edge", "queue", "max_waiting"), 0, "must be at least 1, got 0"),
        (("edge", "queue", "timeout_s"), 0, "must be greater than 0, got 0"),
    ],
)
def test_config_numbers_in_range(path: tuple[str | int, ...], value: float, message: str) -> None:
    data = base()
    data["edge"].setdefault("queue", {})
    target: Any = data
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = value
    assert only_problem(data) == f"{render(path)}: {message}"


@pytest.mark.parametrize("listen", ["8080", "localhost:65536", ":8080", "host:http", "localhost:-1"])
def test_config_listen_is_host_port(listen: str) -> None:
    data = base()
    data["edge"]["listen"] = listen
    data["edge"]["nats"]["listen"] = listen
    assert problems(data) == [
        f"edge.listen: expected host:port with a port from 0 to 65535, got {listen!r}",
        f"edge.nats.listen: expected host:port with a port from 0 to 65535, got {listen!r}",
    ]


@pytest.mark.parametrize("listen", ["0.0.0.0:1", "[::1]:65535", "gpu-a.lan:8080"])
def test_config_listen_accepts_hosts_and_ipv6(listen: str) -> None:
    data = base()
    data["edge"]["listen"] = listen
    data["edge"]["api_keys_env"] = "IOP_KEYS"  # a listen beyond loopback needs client keys
    assert config.parse(yaml.safe_dump(data)).deployment.edge.listen == listen


def test_config_listen_port_0_lets_the_os_pick() -> None:
    data = base()
    data["edge"]["listen"] = "127.0.0.1:0"
    data["edge"]["nats"]["listen"] = "127.0.0.1:0"
    edge = config.parse(yaml.safe_dump(data)).deployment.edge
    assert (edge.listen, edge.nats.listen) == ("127.0.0.1:0", "127.0.0.1:0")


@pytest.mark.parametrize("url", ["embedded", "nats://h:4222", "nats://a:4222, tls://b:4443", "nats://u:p@h"])
def test_config_nats_url_accepts_embedded_and_nats_urls(url: str) -> None:
    data = base()
    data["edge"]["nats"]["url"] = url
    assert config.parse(yaml.safe_dump(data)).deployment.edge.nats.url == url


@pytest.mark.parametrize(("url", "culprit"), [("http://h:4222", "http://h:4222"), ("nats://a,b:4222", "b:4222")])
def test_config_nats_url_rejects_other_urls(url: str, culprit: str) -> None:
    data = base()
    data["edge"]["nats"]["url"] = url
    assert only_problem(data) == (
        f"edge.nats.url: expected 'embedded' or comma-separated nats:// or tls:// URLs, and {culprit!r} is not one"
    )


def test_config_env_names_are_checked() -> None:
    data = base()
    data["edge"]["api_keys_env"] = "MY-KEYS"
    data["nodes"][0]["adapters"][0]["env"] = ["OPENAI_API_KEY", "2X"]
    assert [line.split(":")[0] for line in problems(data)] == ["edge.api_keys_env", "nodes[0].adapters[0].env[1]"]


# --- all at once, in document order --------------------------------------------------------------


def test_config_reports_every_problem_at_once_in_document_order() -> None:
    data = base()
    data["edge"]["listen"] = "localhost"
    data["models"][0]["pool"].append("ghost")
    data["nodes"][0]["providers"][1]["capcity"] = data["nodes"][0]["providers"][1].pop("capacity")
    data["nodes"][1]["providers"][0]["adapter"] = "vlm"
    data["nodes"][1]["adapters"][0]["tokens"] = "many"
    found = problems(data)
    assert [line.split(": ")[0] for line in found] == [
        "edge.listen",
        "models[0].pool[2]",
        "nodes[0].providers[1].capacity",
        "nodes[0].providers[1].capcity",
        "nodes[1].adapters[0].tokens",
        "nodes[1].providers[0].adapter",
    ]


def test_config_models_after_nodes_still_in_document_order() -> None:
    text = """
nodes:
  - id: n
    adapters: [{id: m, type: mock}]
    providers: [{id: p, adapter: m, capacity: 0}]
models:
  - {alias: a, pool: [q]}
"""
    with pytest.raises(ConfigError) as info:
        config.parse(text)
    assert info.value.problems == [
        "nodes[0].providers[0].capacity: must be at least 1, got 0",
        "models[0].pool[0]: no provider 'q'",
    ]


# --- warnings ----------------------------------------------------------------------------------


def test_config_legacy_concurrency_is_accepted_with_one_warning_each() -> None:
    data = base()
    data["nodes"][0]["concurrency"] = 4
    data["nodes"][1]["runtime"] = {"concurrency": 2}
    loaded = config.parse(yaml.safe_dump(data, sort_keys=False))
    assert len(loaded.warnings) == 2
    assert loaded.warnings[0].startswith("nodes[0].concurrency: legacy setting: it no longer gates admission")
    assert loaded.warnings[1].startswith("nodes[1].runtime.concurrency: legacy setting")
    assert all("kept as metadata for status" in w for w in loaded.warnings)
    assert loaded.deployment.nodes[0].legacy_concurrency() == 4
    assert loaded.deployment.nodes[1].legacy_concurrency() == 2


def test_config_provider_without_alias_is_a_warning() -> None:
    data = base()
    data["models"][0]["pool"] = ["mac-mlx"]
    loaded = config.parse(yaml.safe_dump(data, sort_keys=False))
    assert loaded.warnings == ["nodes[1].providers[0]: 'gpu-a-vllm' gets no work: no pool lists it"]


# --- the walker agrees with msgspec -------------------------------------------------------------


def _leaves(value: object, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    if isinstance(value, dict):
        return [path] + [p for k, v in value.items() for p in _leaves(v, (*path, k))]
    if isinstance(value, list):
        return [path] + [p for i, v in enumerate(value) for p in _leaves(v, (*path, i))]
    return [path]


_PATHS = _leaves(_BASE)[1:]
_JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 70000),
    st.floats(-2, 2, allow_nan=False),
    st.sampled_from(["", "x", "cli", "mock", "codex", "mac/codex-cli", "127.0.0.1:1", "http://h/v1", "a.b"]),
    st.lists(st.sampled_from(["mac-mlx", "codex-cli", ""]), max_size=2),
    st.just({}),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(_PATHS), _JUNK), min_size=1, max_size=3))
def test_config_any_mutation_is_valid_or_a_config_error(edits: list[tuple[tuple[Any, ...], object]]) -> None:
    data = base()
    for path, junk in edits:
        target: Any = data
        try:
            for part in path[:-1]:
                target = target[part]
            target[path[-1]] = junk
        except (KeyError, IndexError, TypeError):
            continue  # an earlier edit replaced the parent
    text = yaml.safe_dump(data)
    try:
        loaded = config.parse(text)
    except ConfigError as exc:
        assert exc.problems and all(p.strip() for p in exc.problems)
        return
    # A file the walker passes must also satisfy msgspec and the catalog built from it.
    assert msgspec.convert(yaml.safe_load(text), config.Deployment) == loaded.deployment
    configview.summary(loaded)


# --- shipped configs ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["dev-runtime.yaml", "smoke.yaml"])
def test_config_shipped_configs_are_valid_without_warnings(name: str) -> None:
    loaded = config.load(CONFIGS / name)
    assert loaded.warnings == []
    catalog = config.Catalog.of(loaded.deployment)
    assert [n.id for n in loaded.deployment.nodes] == ["mac-codex-node", "gpu-a-node", "gpu-b-node"]
    assert catalog.pools == {"qwen-coder": ["mac-mlx-vllm", "gpu-a-vllm", "gpu-b-vllm"]}
    assert catalog.routes == {"codex": ("mac-codex-node", "codex-cli")}
    assert sum(catalog.providers[p].provider.capacity or 0 for p in catalog.pools["qwen-coder"]) == 10
    assert catalog.providers["codex-cli"].is_cli


def test_config_smoke_has_only_mock_and_cli_adapters() -> None:
    dep = config.load(CONFIGS / "smoke.yaml").deployment
    kinds = {type(a) for n in dep.nodes for a in n.adapters}
    assert kinds == {config.CliAdapter, config.MockAdapter}


def test_config_smoke_cli_stand_in_echoes_stdin() -> None:
    adapter = config.load(CONFIGS / "smoke.yaml").deployment.node("mac-codex-node").adapter("codex")
    assert isinstance(adapter, config.CliAdapter)
    done = subprocess.run(adapter.command, input=b"hello", capture_output=True, timeout=10, check=True)
    assert b"hello" in done.stdout


@pytest.mark.parametrize("name", ["dev-runtime.yaml", "smoke.yaml"])
def test_config_packaged_copies_match_configs(name: str) -> None:
    assert (PACKAGED / name).read_bytes() == (CONFIGS / name).read_bytes()


# --- summary and schema ------------------------------------------------------------------------


def test_config_summary_of_dev_runtime() -> None:
    text = configview.summary(config.load(CONFIGS / "dev-runtime.yaml"))
    lines = text.splitlines()
    assert lines[0] == "3 nodes, 4 providers (3 in pools, total capacity 10), 1 pool, 1 direct route"
    assert "  qwen-coder: 3 candidates, total capacity 10 (mac-mlx-vllm 2, gpu-a-vllm 4, gpu-b-vllm 4)" in lines
    assert "  codex -> mac-codex-node/codex-cli" in lines
    codex = next(line for line in lines if line.strip().startswith("codex-cli"))
    assert "unlimited" in codex and "cli" in codex
    mlx = next(line for line in lines if line.strip().startswith("mac-mlx-vllm"))
    assert "capacity 2" in mlx and "openai" in mlx and "Qwen2.5-Coder-7B-Instruct-4bit" in mlx
    assert "warnings" not in lines


def test_config_summary_lists_warnings() -> None:
    data = base()
    data["nodes"][0]["runtime"] = {"concurrency": 8}
    text = configview.summary(config.parse(yaml.safe_dump(data, sort_keys=False)))
    assert "legacy concurrency 8 (metadata only)" in text
    assert text.splitlines()[-2:] == ["warnings", "  " + config.parse(yaml.safe_dump(data)).warnings[0]]


def test_config_json_schema_describes_the_structs() -> None:
    schema = json.loads(configview.json_schema_text())
    assert schema["$schema"].startswith("https://json-schema.org/")
    defs = schema["$defs"]
    assert schema["$ref"] == "#/$defs/Deployment"
    provider = defs["Provider"]
    assert provider["additionalProperties"] is False
    assert provider["properties"]["capacity"]["anyOf"][0] == {"type": "integer", "minimum": 1}
    assert "description" in provider["properties"]["capacity"]
    assert defs["CliAdapter"]["properties"]["type"] == {"enum": ["cli"]}


# --- the command line --------------------------------------------------------------------------


def test_cli_config_check_prints_summary() -> None:
    result = CliRunner().invoke(main, ["config", "check", str(CONFIGS / "dev-runtime.yaml")])
    assert result.exit_code == 0, result.output
    assert "3 nodes, 4 providers (3 in pools, total capacity 10), 1 pool, 1 direct route" in result.output
    assert "qwen-coder: 3 candidates, total capacity 10" in result.output
    assert "codex -> mac-codex-node/codex-cli" in result.output


def test_cli_config_check_prints_every_error_and_exits_2(tmp_path: Path) -> None:
    data = base()
    data["edge"]["listen"] = "nowhere"
    data["nodes"][1]["providers"][0]["adapter"] = "mlxx"
    data["nodes"][0]["providers"][0]["capacity"] = 1
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    result = CliRunner().invoke(main, ["config", "check", str(path)])
    assert result.exit_code == 2
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert [e.split(": ")[1] for e in errors] == [
        "edge.listen",
        "nodes[0].providers[0].capacity",
        "nodes[1].providers[0].adapter",
    ]


def test_cli_config_check_missing_file(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["config", "check", str(tmp_path / "gone.yaml")])
    assert result.exit_code == 2
    assert result.output.strip() == f"error: {tmp_path / 'gone.yaml'}: no such file"


def test_cli_config_schema_prints_json() -> None:
    result = CliRunner().invoke(main, ["config", "schema"])
    assert result.exit_code == 0
    assert json.loads(result.output)["$defs"]["Deployment"]["type"] == "object"


def test_cli_config_check_as_a_real_process() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "iop", "config", "check", "configs/dev-runtime.yaml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("3 nodes, 4 providers (3 in pools, total capacity 10)")
    assert done.stderr == ""


# --- clustering ---------------------------------------------------------------------------------


def test_cluster_settings_what_the_file_can_tell() -> None:
    three = ["10.0.0.1:6222", "10.0.0.2:6222", "10.0.0.3:6222"]
    good = base()
    good["edge"]["nats"] = {"replicas": 3, "cluster": {"name": "iop", "listen": three[0], "routes": three}}
    nats = config.parse(yaml.safe_dump(good)).deployment.edge.nats
    assert nats.replicas == 3 and nats.cluster is not None and nats.cluster.routes == three

    two = base()
    two["edge"]["nats"] = {"replicas": 3, "cluster": {"name": "iop", "listen": three[0], "routes": three[:2]}}
    assert "3 replicas need at least 3 JetStream servers" in only_problem(two)

    alone = base()
    alone["edge"]["nats"] = {"replicas": 3}
    assert "add edge.nats.cluster" in only_problem(alone)

    external = base()
    external["edge"]["nats"] = {"url": "nats://a:4222", "replicas": 3, "cluster": {"name": "iop", "listen": three[0]}}
    assert "applies to the embedded server" in only_problem(external)

    external["edge"]["nats"].pop("cluster")
    assert config.parse(yaml.safe_dump(external)).deployment.edge.nats.replicas == 3  # the cluster is its own

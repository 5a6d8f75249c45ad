"""Least privilege on NATS: one user per role, each node in a NATS account of its own.

The edge holds the deployment's own user (everything: it publishes work, writes the catalog,
answers nodes), in the account that holds JetStream (`EDGE_ACCOUNT`). Each node has its own user,
in an account of its own (`node_account`) that holds nothing but what the edge's account lends it:
its own providers' pulls and acks, its own catalog key, the subjects under its own id. Inside that,
the user's permissions still say the same (a second wall): take its own providers' work, serve its
own CLI subjects, answer on reply subjects carrying its own id, heartbeat as itself.

Why accounts and not permissions alone: nats-server checks what a user may publish *to*, not the
reply subject a request names, and JetStream delivers its answer wherever that says. In the edge's
account such an answer could land in a KV bucket, another provider's queue or another node's
subject; in a node's own account it lands where only that node could publish anyway (docs/security.md).
Passwords are derived from one per-deployment secret (see `access.Credentials`), so nothing but
that secret needs storing, and a node's password reveals nothing of the others.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from iop import config, wire

EDGE_USER = "iop-edge"
EDGE_ACCOUNT = "IOP"
"""The account of the edges, JetStream and everything stored (before it: NATS's global account, `$G`)."""
CATALOG_STREAM = "KV_iop_catalog"
"""The stream behind the catalog KV bucket (streams.CATALOG_BUCKET)."""
PULL_RESPONSE_S = "30s"
"""How long the server routes the answer to a node's pull or request across the accounts (its
`response_threshold`): well above a pull's own wait (iop/node/fetch.py FETCH_TIMEOUT_S)."""
HEARTBEAT_RESPONSE_S = "5s"
"""A heartbeat names a reply subject only an edge that refuses it answers: its route lapses soon."""


def node_user(node_id: str) -> str:
    return f"iop-node-{node_id}"


def node_account(node_id: str) -> str:
    return f"NODE_{node_id}"


def node_inbox_prefix(node_id: str) -> str:
    """A node's own reply inboxes (its requests, its pull subscriptions): only it may subscribe there."""
    return f"_INBOX_{node_id}"


def _pooled(node: config.Node) -> list[str]:
    return [p.id for p in node.providers if not isinstance(node.adapter(p.adapter), config.CliAdapter)]


def node_routes(node: config.Node) -> tuple[list[str], list[str], list[str]]:
    """What crosses between the edge's account and node `node`'s, by direction:

    - `asks`: subjects the node publishes or requests into the edge's account (service imports:
      the edge's answers come back to the node's own inbox);
    - `tells`: subjects the edge publishes to the node (stream imports);
    - `serves`: subjects the edge requests and the node answers (services the node's account exports).
    """
    nid = node.id
    asks = [
        f"{wire.REPLY_ROOT}.*.{nid}.>",
        wire.heartbeat_subject(nid),
        wire.hello_subject(nid),
        f"$JS.API.DIRECT.GET.{CATALOG_STREAM}.$KV.iop_catalog.{nid}",
    ]
    for pid in _pooled(node):
        consumer = wire.consumer_name(pid)
        asks += [
            f"$JS.API.CONSUMER.MSG.NEXT.{wire.WORK_STREAM}.{consumer}",
            f"$JS.ACK.{wire.WORK_STREAM}.{consumer}.>",
        ]
    tells = [
        wire.cancel_subject(nid),
        wire.body_subject(nid),  # the bodies of its requests that stay at an edge (only edges publish)
        wire.credit_subject(nid),
        wire.received_subject(nid),  # an edge saying which answers it has whole
        wire.catalog_subject(nid),
    ]
    serves = [
        f"iop.cli.{nid}.*",
        wire.resend_subject(nid),  # an edge asking for replies NATS lost on the way
        wire.control_subject(nid),  # an administrator's action, through an edge (only edges publish it)
        wire.verdict_subject(nid, "*"),  # an edge's refusal of its heartbeats
    ]
    return asks, tells, serves


def _permissions(node_id: str, routes: tuple[list[str], list[str], list[str]]) -> dict[str, Any]:
    """What node `node_id` may do on NATS inside its account, as a nats-server `permissions` block.

    Pool providers: pull from their own durable consumer (MSG.NEXT) and ack on its ack subjects.
    CLI resources: subscribe their own subjects; the one Accepted answer goes to the edge's inbox
    through `allow_responses`, never by a publish right to inboxes. Everything else the node sends
    carries its id in the subject, so another node cannot speak for it.
    """
    asks, tells, serves = routes
    return {
        "publish": {"allow": asks},
        "subscribe": {"allow": [f"{node_inbox_prefix(node_id)}.>", *tells, *serves]},
        "allow_responses": {"max": 1, "expires": "1m"},
    }


def _threshold(node_id: str, subject: str) -> str:
    return HEARTBEAT_RESPONSE_S if subject == wire.heartbeat_subject(node_id) else PULL_RESPONSE_S


def accounts(edge_password: str, nodes: Iterable[tuple[config.Node, str]]) -> str:
    """The `accounts` block of the embedded server's config: the edge's account, then one per node.

    A node id may come more than once (its sections before and after a refresh): its account then
    gets the union, so a provider being retired can still ack what it runs.
    """
    edge: dict[str, Any] = {
        "jetstream": "enabled",
        "users": [{"user": EDGE_USER, "password": edge_password}],
        "exports": [],
        "imports": [],
    }
    routes: dict[str, tuple[list[str], list[str], list[str]]] = {}
    users: dict[str, dict[str, Any]] = {}
    for node, password in nodes:
        merged = routes.setdefault(node.id, ([], [], []))
        for have, add in zip(merged, node_routes(node), strict=True):
            have += [s for s in add if s not in have]
        users.setdefault(node.id, {"user": node_user(node.id), "password": password})
    result: dict[str, Any] = {EDGE_ACCOUNT: edge}
    for nid, (asks, tells, serves) in routes.items():
        name = node_account(nid)
        edge["exports"] += [{"service": s, "accounts": [name], "response_threshold": _threshold(nid, s)} for s in asks]
        edge["exports"] += [{"stream": s, "accounts": [name]} for s in tells]
        edge["imports"] += [{"service": {"account": name, "subject": s}} for s in serves]
        user = {**users[nid], "permissions": _permissions(nid, (asks, tells, serves))}
        result[name] = {
            "users": [user],
            "imports": [{"service": {"account": EDGE_ACCOUNT, "subject": s}} for s in asks]
            + [{"stream": {"account": EDGE_ACCOUNT, "subject": s}} for s in tells],
            "exports": [{"service": s, "accounts": [EDGE_ACCOUNT]} for s in serves],
        }
    # JSON is valid nats-server config, and its quoting keeps `$JS...` from reading as a variable.
    return f"accounts: {json.dumps(result, indent=1)}\n"

"""Least privilege on NATS: one user per role, and the permissions nats-server enforces for each.

The edge holds the deployment's own user (everything: it publishes work, writes the catalog,
answers nodes). Each node has its own user, which may only take its own providers' work, serve
its own CLI subjects, answer on reply subjects carrying its own id, heartbeat as itself and read
its own catalog key. Passwords are derived from one per-deployment secret (see `access.Credentials`),
so nothing but that secret needs storing, and a node's password reveals nothing of the others.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from iop import config, wire

EDGE_USER = "iop-edge"
CATALOG_STREAM = "KV_iop_catalog"
"""The stream behind the catalog KV bucket (streams.CATALOG_BUCKET)."""


def node_user(node_id: str) -> str:
    return f"iop-node-{node_id}"


def node_inbox_prefix(node_id: str) -> str:
    """A node's own reply inboxes (its requests, its pull subscriptions): only it may subscribe there."""
    return f"_INBOX_{node_id}"


def node_permissions(node: config.Node) -> dict[str, Any]:
    """What node `node` may do on NATS, as a nats-server `permissions` block.

    Pool providers: pull from their own durable consumer (MSG.NEXT) and ack on its ack subjects.
    CLI resources: subscribe their own subjects; the one Accepted answer goes to the edge's inbox
    through `allow_responses`, never by a publish right to inboxes. Everything else the node sends
    carries its id in the subject, so another node cannot speak for it.
    """
    nid = node.id
    pooled = [p.id for p in node.providers if not isinstance(node.adapter(p.adapter), config.CliAdapter)]
    publish = [
        f"{wire.REPLY_ROOT}.*.{nid}.>",
        wire.heartbeat_subject(nid),
        wire.hello_subject(nid),
        f"$JS.API.STREAM.INFO.{wire.WORK_STREAM}",
        f"$JS.API.STREAM.INFO.{CATALOG_STREAM}",
        f"$JS.API.DIRECT.GET.{CATALOG_STREAM}.$KV.iop_catalog.{nid}",
    ]
    for pid in pooled:
        consumer = wire.consumer_name(pid)
        publish += [
            f"$JS.API.CONSUMER.INFO.{wire.WORK_STREAM}.{consumer}",
            f"$JS.API.CONSUMER.MSG.NEXT.{wire.WORK_STREAM}.{consumer}",
            f"$JS.ACK.{wire.WORK_STREAM}.{consumer}.>",
        ]
    subscribe = [
        f"{node_inbox_prefix(nid)}.>",
        f"iop.cli.{nid}.*",
        wire.cancel_subject(nid),
        wire.body_subject(nid),  # the bodies of its requests that stay at an edge (only edges publish)
        wire.credit_subject(nid),
        wire.resend_subject(nid),  # an edge asking for replies NATS lost on the way
        wire.received_subject(nid),  # an edge saying which answers it has whole
        wire.control_subject(nid),  # an administrator's action, through an edge (only edges publish it)
        wire.catalog_subject(nid),
        wire.verdict_subject(nid, "*"),  # an edge's refusal of its heartbeats
    ]
    return {
        "publish": {"allow": publish},
        "subscribe": {"allow": subscribe},
        "allow_responses": {"max": 1, "expires": "1m"},
    }


def authorization(edge_password: str, nodes: Iterable[tuple[config.Node, str]]) -> str:
    """The `authorization` block of the embedded server's config: the edge, then one user per node.

    A node id may come more than once (its sections before and after a refresh): its user then
    gets the union, so a provider being retired can still ack what it runs.
    """
    users: list[dict[str, Any]] = [{"user": EDGE_USER, "password": edge_password}]
    by_user: dict[str, dict[str, Any]] = {}
    for node, password in nodes:
        perms = node_permissions(node)
        user = by_user.get(node_user(node.id))
        if user is None:
            user = by_user[node_user(node.id)] = {
                "user": node_user(node.id),
                "password": password,
                "permissions": perms,
            }
            users.append(user)
            continue
        for kind in ("publish", "subscribe"):
            allow = user["permissions"][kind]["allow"]
            allow += [s for s in perms[kind]["allow"] if s not in allow]
    # JSON is valid nats-server config, and its quoting keeps `$JS...` from reading as a variable.
    return f"authorization {{ users: {json.dumps(users, indent=1)} }}\n"

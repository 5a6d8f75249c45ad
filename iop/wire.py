"""Everything that crosses NATS: subject names and the msgpack-encoded messages (see docs/wire.md)."""

from __future__ import annotations

from typing import Literal

import msgspec

# --- subjects -------------------------------------------------------------------------------------

WORK_STREAM = "IOP_WORK"
"""The JetStream work-queue stream holding dispatched pool work, subjects `iop.work.>`."""
WORK_SUBJECTS = "iop.work.>"

HEARTBEAT_INTERVAL_S = 1.0
"""How often a node publishes its heartbeat; the edge marks it lost after `HEARTBEATS_MISSED`."""
HEARTBEATS_MISSED = 3

ACK_WAIT_S = 10.0
"""JetStream ack wait for work; a running item is kept with `in_progress()` every third of it.

It also bounds how long a message stays lost when it was delivered to a node's pull request just as
the node's NATS server died (a cluster member lost): the broker redelivers it after this, the node
claims it from its edge, and it runs once."""

# Flow control of one answer: the node may have at most WINDOW_CHUNKS chunks and WINDOW_BYTES bytes
# that the edge has not yet handed to its HTTP client. The edge grants credit each time its client
# has taken a quarter of either, so a fast client costs one Credit per 128 chunks or 256 KiB.
WINDOW_CHUNKS = 512
WINDOW_BYTES = 1024 * 1024
CREDIT_EVERY_CHUNKS = WINDOW_CHUNKS // 4
CREDIT_EVERY_BYTES = WINDOW_BYTES // 4

REPLAY_GRACE_S = 30.0
"""How long a node keeps the unconfirmed end of an answer after the request ended (see `Resend`)."""

PROBE_INTERVAL_S = 2.0
"""How often a node asks the edge about each running request (liveness, lost credit)."""

REQUEST_ID_PATTERN = r"^[A-Za-z0-9._:@/+=-]{1,128}$"
"""What an `x-request-id` may be: bounded, and safe in a log line and in an HTTP header."""

BODY_PART_BYTES = 1024 * 1024
"""Largest piece of a request body a node fetches from the edge at once (bodies that stay at the edge)."""


def body_part_size(max_payload: int) -> int:
    return min(BODY_PART_BYTES, max_payload - 1024)  # edge and node on one server agree; 1 KiB for headers


def work_subject(provider: str) -> str:
    return f"iop.work.{provider}"


def consumer_name(provider: str) -> str:
    return f"iop-{provider}"


def cli_subject(node: str, resource: str) -> str:
    return f"iop.cli.{node}.{resource}"


def heartbeat_subject(node: str = "*") -> str:
    return f"iop.node.{node}.hb"


def hello_subject(node: str = "*") -> str:
    return f"iop.node.{node}.hello"


def verdict_subject(node: str, instance: str) -> str:
    """The reply subject of an instance's heartbeats: an edge answers there only to refuse it."""
    return f"iop.node.{node}.verdict.{instance}"


def cancel_subject(node: str) -> str:
    return f"iop.node.{node}.cancel"


def catalog_subject(node: str) -> str:
    """Where the edge tells a node that its catalog changed in the KV bucket (see iop/node/catalog.py)."""
    return f"iop.node.{node}.catalog"


def credit_subject(node: str) -> str:
    return f"iop.node.{node}.credit"


def received_subject(node: str) -> str:
    """Where an edge tells a node which answers it has whole (`Received`): the node forgets them."""
    return f"iop.node.{node}.received"


RECEIVED_EVERY_S = 0.25
"""How long an edge gathers the ends it received before it tells their node (one message per node)."""
RECEIVED_BATCH = 512
"""Or as soon as this many are gathered for one node."""


def control_subject(node: str) -> str:
    """Where an edge passes an administrator's action on one of the node's providers (`Control`, core
    request-reply, answered with a `ControlReply`); only edges may publish there."""
    return f"iop.node.{node}.control"


def body_subject(node: str, request: str = "*", offset: int | str = "*") -> str:
    """A part of a body sent ahead to `node` (iop/node/body.py; edges only); no arguments: all."""
    return f"iop.node.{node}.body.{request}.{offset}"


def resend_subject(node: str) -> str:
    """Where an edge asks a node to send a request's replies again (`Resend`, core request-reply)."""
    return f"iop.node.{node}.resend"


EDGE_SLOTS_SUBJECT = "iop.edges.slots"
"""Where every edge announces the provider slots it holds, as they change (EdgeSlots); edges only."""
EDGE_SLOTS_FULL_S = 1.0
"""How often an edge announces all its counts (repairs a lost announcement; lets a new edge learn)."""
EDGE_SLOTS_SILENT_S = 3.0
"""An edge unheard for this long is gone: the others count its slots from the nodes' heartbeats."""

REPLY_ROOT = "iop.reply"


def reply_prefix(edge: str) -> str:
    """Every reply to an edge goes under this prefix; the edge holds one wildcard subscription."""
    return f"{REPLY_ROOT}.{edge}"


def edge_of(reply_to: str) -> str:
    """The edge id in a reply subject (`reply_subject`)."""
    return reply_to.removeprefix(REPLY_ROOT + ".").split(".", 1)[0]


def reply_subject(edge: str, node: str, request: str) -> str:
    """Where node `node` answers `request`: NATS lets a node publish only under its own id here,
    and the edge takes a reply only from the node it sent the request to."""
    return f"{REPLY_ROOT}.{edge}.{node}.{request}"


# --- messages -------------------------------------------------------------------------------------

Api = Literal["chat", "responses", "messages", "embeddings", "completions", "count_tokens", "compact"]
"""The endpoint the client called; a node older than messages/embeddings/completions refuses their items.
`compact`: `/v1/responses/compact`, sent only to providers whose upstream serves Responses itself."""


class WorkItem(msgspec.Struct, kw_only=True, array_like=True):
    """One client request, sent to a provider's work subject (pool) or a CLI resource (direct)."""

    id: str
    api: Api
    stream: bool
    alias: str
    body: bytes
    """The client's JSON body, untouched; the node sets the upstream model name."""
    reply_to: str
    deadline: float
    """Unix time after which the item must not start (it has waited past the queue timeout)."""
    edge: str = ""
    body_size: int = 0
    """Non-zero: the body stays at the edge, `body` is empty (iop/node/body.py: sent ahead, or fetched)."""
    request_id: str = ""
    """The client's `x-request-id` (or the edge's own): the node logs it and sends it upstream."""
    lead: int = 0
    """Non-zero: the body begins with its only top-level `model` (a string without escapes) and that
    beginning is `lead` bytes long; a chat body has no top-level `stream_options`. The edge counted
    both as it read the head, so the node sets the model without reading the rest (iop/edge/heads.py)."""


class Usage(msgspec.Struct, array_like=True):
    """Tokens read and written by one answer; iop.openai.usage gives it each API's shape.

    The details are None where the upstream did not report them. An older peer's two-element
    array decodes with both None; an older decoder ignores the trailing two.
    """

    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int | None = None
    """Of `input_tokens`, how many came from the upstream's prompt cache."""
    reasoning_tokens: int | None = None
    """Of `output_tokens`, how many were reasoning."""


class Started(msgspec.Struct, tag="s", array_like=True):
    """The node began running the item (the end of its queue wait)."""

    id: str
    node: str
    instance: str
    ack: str = ""
    """The work message's JetStream ack subject: lets the edge free the slot if the node dies."""
    held_ms: float = 0.0
    """How long the node held this message back to send it with the answer's first bytes (see
    `Replies`): the node began that much earlier than the edge hears of it."""
    cold_start_ms: float = 0.0
    """How long the node waited for its model server to start before running the item (0: it was ready)."""


class Chunk(msgspec.Struct, tag="c", array_like=True):
    """Bytes of the answer, already in the client's API and framing (SSE events or JSON)."""

    id: str
    seq: int
    data: bytes
    headers: dict[str, str] | None = None
    """HTTP headers for the client's answer (e.g. `x-iop-dropped-tools`); only on the first chunk."""


class Done(msgspec.Struct, tag="d", array_like=True):
    """The answer is complete: `chunks` chunks were sent (lets the edge detect a lost one)."""

    id: str
    chunks: int
    usage: Usage | None = None
    upstream_status: int = 0
    """The upstream's HTTP status (openai adapter); 0 when there was none."""
    exit_code: int | None = None
    """The CLI command's exit status."""
    run_ms: float = 0.0
    """How long the node ran the item."""
    ttfb_ms: float = 0.0
    """From the node's start to its first answer byte."""


class Failure(msgspec.Struct, tag="f", array_like=True):
    """The item failed; `status` and `code` are what the HTTP client is told."""

    id: str
    chunks: int
    status: int
    code: str
    message: str
    ended: bool = False
    """The node already ended the stream with an error event in the client's API (translated streams)."""
    param: str | None = None
    """The request field the failure is about (a refused parameter), as OpenAI errors name it."""
    kind: str = ""
    """The `iop.errors` class the node raised (e.g. `Cancelled`), so the edge raises the same one and
    knows whether to fail over; empty from a node older than this field (the edge goes by `status`)."""
    usage: Usage | None = None
    upstream_status: int = 0
    exit_code: int | None = None
    run_ms: float = 0.0
    ttfb_ms: float = 0.0


class Replies(msgspec.Struct, tag="m", array_like=True):
    """Several replies about one request in one NATS message, in order.

    A node sends Started together with the answer's first bytes when they follow within
    `STARTED_HOLD_S`, and a non-streamed answer's last chunk together with its Done: one message
    instead of three for a short answer, one fewer for every answer.
    """

    items: list[Started | Chunk | Done | Failure]


STARTED_HOLD_S = 0.002
"""How long a node holds Started back waiting for the first answer bytes to travel with."""


class Accepted(msgspec.Struct, tag="a", array_like=True):
    """A CLI resource took a direct request (the reply to the core NATS request)."""

    id: str


class Claim(msgspec.Struct, tag="k", array_like=True):
    """Asked (core request) before running a redelivered item: does the edge still want it?"""

    id: str


class Verdict(msgspec.Struct, array_like=True):
    """The edge's answer to a Claim: run it, or drop it (done, failed over, or the client left)."""

    go: bool


class Probe(msgspec.Struct, tag="p", array_like=True):
    """Asked (core request) about a running item: is the edge still there, how far did its client read?

    The answer is a `Credit`; no responder means the edge is gone.
    """

    id: str


class BodyPart(msgspec.Struct, tag="b", array_like=True):
    """Asked (core request) for the request body from `offset`; the answer is raw bytes, empty if unknown."""

    id: str
    offset: int


Reply = Started | Chunk | Done | Failure | Replies | Accepted | Claim | Probe | BodyPart


class Credit(msgspec.Struct, array_like=True):
    """The edge's client has taken `chunks` chunks and `nbytes` bytes of the answer (cumulative).

    Sent to `iop.node.<node>.credit`, and as the answer to a `Probe`. `known` is False when the edge
    no longer has the request (its client left or it failed there): the node stops it.
    """

    id: str
    chunks: int
    nbytes: int
    known: bool = True


class Resend(msgspec.Struct, array_like=True):
    """Asked (core request, `resend_subject`) by an edge that lost replies of a request on the way.

    The node publishes again, on the request's reply subject, what it kept of the answer: `Started`
    if `started`, the chunks from `from_seq` on, and the `Done` or `Failure` if it ended. What the
    edge's client already took (its credit) is not kept; an ended request's tail is kept
    `REPLAY_GRACE_S`. The answer is a `Resent`.
    """

    id: str
    from_seq: int
    started: bool = False


class Received(msgspec.Struct, array_like=True):
    """An edge has every reply of these requests, their end included (sent to `received_subject`).

    The node forgets what it kept of them to send again (iop/node/replay.py) at once, instead of
    keeping each answer `REPLAY_GRACE_S` after its end: under load that grace held tens of thousands
    of answers. An edge gathers them for `RECEIVED_EVERY_S` (or `RECEIVED_BATCH` ids): one message per
    node however many requests end.
    """

    ids: list[str]


class Resent(msgspec.Struct, array_like=True):
    """The node's answer to a `Resend`: whether it still knew the request, how many replies it sent again.

    `known` False: the node never ran it, or forgot it (ended longer than `REPLAY_GRACE_S` ago,
    dropped from a full store, or the node restarted): what was lost cannot come back.
    """

    known: bool
    sent: int = 0


class Cancel(msgspec.Struct, array_like=True):
    """The client went away: stop the item (close the upstream call, kill the process group)."""

    id: str


class Control(msgspec.Struct, kw_only=True):
    """An administrator's action on one provider of the node (`iop provider restart`), from an edge."""

    provider: str
    action: Literal["restart"]


class ControlReply(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The node's answer to a Control: done (`ok`), or why not."""

    ok: bool
    message: str = ""


class ProviderLive(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Live counts of one provider or CLI resource on a node."""

    id: str
    kind: Literal["pool", "cli"]
    capacity: int | None = None
    in_flight: int = 0
    peak_in_flight: int = 0
    served: int = 0
    failed: int = 0
    by_edge: dict[str, int] = msgspec.field(default_factory=dict)
    """Of `in_flight`, how many each edge sent (edge id → count): lets every edge see the slots the
    others hold, so it dispatches to a provider with a slot free whichever edge holds the rest."""
    refused: str = ""
    """Not served: the node's own policy refused it (`command not allowed`, ...)."""
    server: ServerLive | None = None
    """The model server the node runs for it (an adapter's `server:` block), else None."""


class ServerLive(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A model server a node runs itself (iop/node/servers.py): its state since when, and its counts."""

    state: Literal["stopped", "starting", "ready", "draining", "failed"] = "stopped"
    since: float = 0.0
    """Wall clock of the last change of state."""
    pid: int = 0
    group: str = ""
    """Its exclusive group on the node ("" for none)."""
    cold_starts: int = 0
    swaps: int = 0
    """Starts that stopped another server of the group first."""
    crashes: int = 0
    """Deaths and failed starts."""
    last_cold_start_ms: float = 0.0
    """From the start of its process to ready, the last time."""


class Accelerator(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A GPU (or Apple silicon chip) a node can see."""

    name: str
    memory_mb: int = 0
    unified: bool = False
    """Apple silicon: the memory is the machine's, shared with the CPU."""


class Device(msgspec.Struct, kw_only=True):
    """The machine a node runs on, gathered once at its start (iop/node/device.py)."""

    os: str = ""
    arch: str = ""
    cpu_model: str = ""
    cpu_cores: int = 0
    memory_mb: int = 0
    accelerators: list[Accelerator] = msgspec.field(default_factory=list)
    """Empty: none seen (no nvidia-smi, not Apple silicon)."""
    python: str = ""
    iop: str = ""


class NodeHeartbeat(msgspec.Struct, kw_only=True):
    """A node's periodic announcement of itself and its catalog with live counts."""

    node: str
    instance: str
    """Random per process start: tells a restarted node apart from a second process with the same id."""
    started_at: float
    seq: int
    providers: list[ProviderLive]
    legacy_concurrency: int | None = None
    version: str = ""
    leaving: bool = False
    """Sent once by a node that stops: the edge marks it disconnected at once."""
    device: Device | None = None
    """As in `Hello`: repeated so that an edge started after the node knows the machine too."""


class Hello(msgspec.Struct, kw_only=True):
    node: str
    instance: str
    providers: list[str]
    device: Device | None = None
    """The machine the node runs on; None from a node older than device facts."""


Refusal = Literal["", "unknown_node", "other_instance"]
"""Why an edge refused a node: its id is not (or no longer) in the deployment, or another live
process holds the id (this one was replaced)."""


class Welcome(msgspec.Struct, kw_only=True):
    """The answer to a `Hello`, and to a refused `NodeHeartbeat` (on the heartbeat's reply subject)."""

    accepted: bool
    edge: str
    reason: str = ""
    refusal: Refusal = ""


class EdgeSlots(msgspec.Struct, array_like=True):
    """An edge's requests dispatched to providers and not yet ended, per provider (EDGE_SLOTS_SUBJECT).

    Sent in the loop turn after the counts changed, with the changed providers only; every
    EDGE_SLOTS_FULL_S with all of them (`full`: providers not named hold none)."""

    edge: str
    full: bool
    held: dict[str, int]
    waiting: dict[str, list[tuple[str, int, float, int, int]]] = {}
    """Per pool alias this edge has requests waiting for (an empty list: no more): each tenant's (name,
    class, weight, requests waiting that it may run, running) — fair shares across edges, iop/edge/fairshare.py."""


# Encoders and decoders are built once (msgspec's guidance) and shared.
encode = msgspec.msgpack.Encoder().encode
decode_work = msgspec.msgpack.Decoder(WorkItem).decode
decode_reply = msgspec.msgpack.Decoder(Reply).decode
decode_cancel = msgspec.msgpack.Decoder(Cancel).decode
decode_credit = msgspec.msgpack.Decoder(Credit).decode
decode_resend = msgspec.msgpack.Decoder(Resend).decode
decode_resent = msgspec.msgpack.Decoder(Resent).decode
decode_received = msgspec.msgpack.Decoder(Received).decode
decode_heartbeat = msgspec.msgpack.Decoder(NodeHeartbeat).decode
decode_hello = msgspec.msgpack.Decoder(Hello).decode
decode_welcome = msgspec.msgpack.Decoder(Welcome).decode
decode_verdict = msgspec.msgpack.Decoder(Verdict).decode
decode_edge_slots = msgspec.msgpack.Decoder(EdgeSlots).decode
decode_control = msgspec.msgpack.Decoder(Control).decode
decode_control_reply = msgspec.msgpack.Decoder(ControlReply).decode

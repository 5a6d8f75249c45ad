"""Managed client keys: created, listed, rotated and revoked by an administrator, shared by every edge.

A key is 32 random bytes (`iop-sk-` and 43 base64url characters), shown once when made. The
JetStream KV bucket `iop_keys` holds, per key id, its name, tenant, times and a SHA-256 digest of
the secret (domain-separated), never the secret. A fast hash is the right one here: slow hashes
(scrypt, argon2) protect low-entropy passwords from guessing, and nobody can guess 256 random
bits, so a digest someone reads from the bucket gives them nothing, while a request costs one
SHA-256 (about a microsecond) and one dict lookup, not tens of milliseconds of key stretching.

Every edge watches the bucket and keeps the digests in memory: a key made, rotated or revoked on
one edge is known to all within the watch's delivery (milliseconds). Managed keys are checked
beside the environment's keys, only while client auth is on (`edge.api_keys_env` set).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import re
import secrets
import time
from typing import Any

import msgspec
from nats.js import api as js_api
from nats.js.client import JetStreamContext
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from iop.edge.keys import EdgeKeys, Key
from iop.errors import BadRequest, NotFound
from iop.nats import streams
from iop.tenancy import TENANT_PATTERN

log = logging.getLogger("iop.edge")

KEYS_BUCKET = "iop_keys"
PREFIX = b"iop-sk-"
_NAME = re.compile(TENANT_PATTERN)
_ID = re.compile(r"^key_[0-9a-f]{16}$")


class StoredKey(msgspec.Struct, kw_only=True):
    """What the bucket holds of one managed key (and what `GET /admin/keys` shows, without `digest`)."""

    id: str
    name: str
    tenant: str
    created: float
    expires: float | None = None
    rotated: float | None = None
    digest: str = ""

    def shown(self) -> dict[str, object]:
        return {
            "id": self.id,
            "name": self.name,
            "tenant": self.tenant,
            "created": self.created,
            "expires": self.expires,
            "rotated": self.rotated,
        }


_decode = msgspec.json.Decoder(StoredKey).decode
_encode = msgspec.json.Encoder().encode


def digest(secret: bytes) -> str:
    return hashlib.sha256(b"iop managed key\0" + secret).hexdigest()


def new_secret() -> bytes:
    return PREFIX + base64.urlsafe_b64encode(secrets.token_bytes(32)).rstrip(b"=")


class CreateKey(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    tenant: str | None = None
    expires_in_days: float | None = None


class ManagedKeys:
    """This edge's copy of the bucket (kept by a watch) and the admin operations on it."""

    def __init__(self) -> None:
        self.kv: Any = None
        self.by_digest: dict[str, StoredKey] = {}
        self.by_id: dict[str, StoredKey] = {}
        self._watch: asyncio.Task[None] | None = None
        self.ready = asyncio.Event()

    async def open(self, js: JetStreamContext, replicas: int) -> None:
        cfg = js_api.KeyValueConfig(bucket=KEYS_BUCKET, history=1)
        self.kv = await streams.ensure_bucket(js, cfg, replicas=replicas)
        watcher = await self.kv.watchall()
        self._watch = asyncio.create_task(self._follow(watcher))
        await asyncio.wait_for(self.ready.wait(), 10)

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()

    async def _follow(self, watcher: Any) -> None:
        while True:
            entry = await watcher.updates(timeout=None)
            if entry is None:  # the end of the values present when the watch began
                self.ready.set()
                continue
            key_id = entry.key.removeprefix("k.")
            if entry.operation in ("DEL", "PURGE") or not entry.value:
                self._forget(key_id)
                continue
            try:
                self._learn(_decode(entry.value))
            except msgspec.DecodeError:
                log.warning("managed keys: entry %s is not a key; ignored", entry.key)

    def _learn(self, key: StoredKey) -> None:
        self._forget(key.id)
        self.by_id[key.id] = key
        self.by_digest[key.digest] = key

    def holds(self, key_id: str) -> bool:
        """Key `key_id` is one this edge accepts now (not revoked, not expired)."""
        found = self.by_id.get(key_id)
        return found is not None and (found.expires is None or found.expires > time.time())

    def _forget(self, key_id: str) -> None:
        old = self.by_id.pop(key_id, None)
        if old is not None:
            self.by_digest.pop(old.digest, None)

    def lookup(self, given: bytes) -> Key | None:
        """The managed key `given` is, if it is one and has not expired."""
        if not given.startswith(PREFIX):
            return None
        found = self.by_digest.get(digest(given))
        if found is None or (found.expires is not None and found.expires <= time.time()):
            return None
        return Key(found.name, given, tenant=found.tenant, id=found.id)

    async def create(self, ask: CreateKey) -> tuple[StoredKey, bytes]:
        for field, value in (("name", ask.name), ("tenant", ask.tenant)):
            if value is not None and not _NAME.match(value):
                raise BadRequest(f"{field} must be 1 to 64 of A-Z a-z 0-9 _ . @ -", param=field, code="invalid_key")
        if ask.expires_in_days is not None and ask.expires_in_days <= 0:
            raise BadRequest("expires_in_days must be more than 0", param="expires_in_days", code="invalid_key")
        now = time.time()
        secret = new_secret()
        key = StoredKey(
            id="key_" + secrets.token_hex(8),
            name=ask.name,
            tenant=ask.tenant or ask.name,
            created=now,
            expires=now + ask.expires_in_days * 86400 if ask.expires_in_days is not None else None,
            digest=digest(secret),
        )
        await self.kv.create("k." + key.id, _encode(key))
        self._learn(key)
        return key, secret

    async def rotate(self, key_id: str) -> tuple[StoredKey, bytes]:
        old = self._known(key_id)
        secret = new_secret()
        key = msgspec.structs.replace(old, digest=digest(secret), rotated=time.time())
        await self.kv.put("k." + key.id, _encode(key))
        self._learn(key)  # the old secret stops here at once, and on the others at the watch's news
        return key, secret

    async def revoke(self, key_id: str) -> StoredKey:
        old = self._known(key_id)
        await self.kv.delete("k." + key_id)
        self._forget(key_id)
        return old

    def _known(self, key_id: str) -> StoredKey:
        key = self.by_id.get(key_id) if _ID.match(key_id) else None
        if key is None:
            raise NotFound(f"no managed key {key_id!r}", code="key_not_found", param="id")
        return key


def key_routes(keys: EdgeKeys, managed: ManagedKeys) -> list[Route]:
    """`/admin/keys`: create (POST), list (GET); `/admin/keys/{id}/rotate` (POST); `/admin/keys/{id}` (DELETE)."""

    def answer(body: object) -> Response:
        return Response(_encode(body), media_type="application/json", headers={"cache-control": "no-store"})

    async def collection(request: Request) -> Response:
        admin = keys.admin(request.scope)
        if request.method == "GET":
            listed = sorted(managed.by_id.values(), key=lambda k: k.created)
            return answer({"keys": [k.shown() for k in listed]})
        if not keys.clients:
            raise BadRequest(
                "client auth is off (edge.api_keys_env is not set): a managed key would open nothing",
                code="client_auth_off",
            )
        try:
            ask = msgspec.json.decode(await request.body(), type=CreateKey)
        except msgspec.DecodeError as exc:
            raise BadRequest(f"invalid request body: {exc}", code="invalid_key") from None
        key, secret = await managed.create(ask)
        log.warning("admin %s: created key %s (%s) of tenant %s", admin, key.id, key.name, key.tenant)
        return answer({**key.shown(), "key": secret.decode()})

    async def rotate(request: Request) -> Response:
        admin = keys.admin(request.scope)
        key, secret = await managed.rotate(request.path_params["id"])
        log.warning("admin %s: rotated key %s (%s)", admin, key.id, key.name)
        return answer({**key.shown(), "key": secret.decode()})

    async def revoke(request: Request) -> Response:
        admin = keys.admin(request.scope)
        key = await managed.revoke(request.path_params["id"])
        log.warning("admin %s: revoked key %s (%s)", admin, key.id, key.name)
        return answer({**key.shown(), "revoked": True})

    return [
        Route("/admin/keys", collection, methods=["GET", "POST"]),
        Route("/admin/keys/{id}/rotate", rotate, methods=["POST"]),
        Route("/admin/keys/{id}", revoke, methods=["DELETE"]),
    ]

"""Who a NATS client is: the credentials it presents and the certificates it trusts."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import ssl
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from iop import config
from iop.errors import BusError
from iop.nats import auth


@dataclass(frozen=True)
class NatsAccess:
    """How a client proves itself to NATS and which server certificates it trusts.

    Secrets are read from environment variables named in the deployment file and never logged
    (`repr` leaves them out). `where` names those variables, for error messages.
    """

    user: str | None = None
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    where: str = "edge.nats"

    @classmethod
    def from_settings(cls, nats: config.NatsSettings, environ: Mapping[str, str] | None = None) -> NatsAccess:
        """Read the secrets the settings name; BusError naming the field when a variable is unset."""
        env = os.environ if environ is None else environ

        def secret(field_name: str, var: str | None) -> str | None:
            if var is None:
                return None
            value = env.get(var, "")
            if not value:
                raise BusError(f"edge.nats.{field_name}: environment variable {var} is not set (or empty)")
            if any(ord(c) < 32 or ord(c) == 127 for c in value):
                raise BusError(f"edge.nats.{field_name}: the value of {var} contains control characters")
            return value

        where = "edge.nats"
        if nats.token_env:
            where = f"the token in ${nats.token_env}"
        elif nats.user_env:
            where = f"the user in ${nats.user_env} and the password in ${nats.password_env}"
        return cls(
            user=secret("user_env", nats.user_env),
            password=secret("password_env", nats.password_env),
            token=secret("token_env", nats.token_env),
            tls_ca=nats.tls_ca,
            tls_cert=nats.tls_cert,
            tls_key=nats.tls_key,
            where=where,
        )

    @property
    def has_credentials(self) -> bool:
        return bool(self.token or (self.user and self.password))

    def ssl_context(self) -> ssl.SSLContext | None:
        """A client TLS context trusting `tls_ca` (and presenting `tls_cert`); None: nats-py's default."""
        if not (self.tls_ca or self.tls_cert):
            return None
        try:
            ctx = ssl.create_default_context(cafile=self.tls_ca)
        except (OSError, ssl.SSLError) as exc:
            raise BusError(f"edge.nats.tls_ca: cannot load {self.tls_ca}: {reason(exc)}") from exc
        if self.tls_cert:
            try:
                ctx.load_cert_chain(self.tls_cert, self.tls_key)
            except (OSError, ssl.SSLError) as exc:
                raise BusError(
                    f"edge.nats.tls_cert: cannot load {self.tls_cert} with key {self.tls_key}: {reason(exc)}"
                ) from exc
        return ctx


def reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLCertVerificationError):
        return str(exc.verify_message or exc.reason or exc)
    if isinstance(exc, ssl.SSLError):
        return str(exc.reason or exc)
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


SECRET_FILE = "iop-nats-secret"
"""In the embedded server's store_dir: the per-deployment secret every NATS password derives from."""


class Credentials:
    """The embedded server's users: the edge and one per node, passwords derived from one secret.

    The secret is made at first start (by the edge, or a node started with the same file on the
    same machine) and kept in `store_dir` with mode 0600. Deriving (HMAC) rather than storing each
    password means a node added by a refresh has its credential at once, and `iop nats-creds`
    can print any node's without a registry of them.
    """

    def __init__(self, secret: bytes, path: Path) -> None:
        self._secret = secret
        self.path = path

    def __repr__(self) -> str:
        return f"Credentials({self.path})"

    @classmethod
    def load(cls, store_dir: str | Path, *, create: bool = True) -> Credentials:
        path = Path(store_dir) / SECRET_FILE
        try:
            return cls(_read_secret(path), path)
        except FileNotFoundError:
            if not create:
                raise BusError(f"no NATS credentials at {path}: start the edge once (it makes them)") from None
        path.parent.mkdir(parents=True, exist_ok=True)
        # Written whole under a temporary name, then linked into place: two processes starting at
        # once (edge and node) both end up with the one secret that got there first.
        tmp = path.with_name(f".{SECRET_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_hex(32) + "\n")
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
        return cls(_read_secret(path), path)

    def password(self, user: str) -> str:
        return hmac.new(self._secret, user.encode(), hashlib.sha256).hexdigest()

    def edge(self) -> NatsAccess:
        user = auth.EDGE_USER
        return NatsAccess(user=user, password=self.password(user), where=f"the edge's credential from {self.path}")

    def node(self, node_id: str) -> NatsAccess:
        user = auth.node_user(node_id)
        return NatsAccess(
            user=user, password=self.password(user), where=f"node {node_id}'s credential from {self.path}"
        )

    def accounts(self, nodes: Iterable[config.Node]) -> str:
        """The server's `accounts` block: the edge's account, and each node's with its user."""
        return auth.accounts(self.password(auth.EDGE_USER), [(n, self.password(auth.node_user(n.id))) for n in nodes])


def _read_secret(path: Path) -> bytes:
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise BusError(f"{path} is readable by others (mode {mode:o}): chmod 600 it")
    secret = path.read_text().strip()
    if len(secret) < 32:
        raise BusError(f"{path} does not hold a secret (delete it to make a new one)")
    return secret.encode()

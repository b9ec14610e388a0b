"""Bearer-token authentication and per-namespace authorisation, one module for every transport.

The tokens file (``ADV_AUTH_TOKENS_FILE``, typically a Kubernetes Secret mounted as a file) maps
each token to the namespaces it may read and write::

    {"tokens": {"<token>": ["team-a", "team-b"], "<admin token>": ["*"]}}

or to an object that also names the tenant the token counts as (tokens of one name are one
tenant: a rotated token and its successor share its limits) and its own limits on what it may
hold at once (``serving/tenancy.py``; by default ``ADV_TENANT_SHARE`` of the replica's)::

    {"tokens": {"<token>": {"namespaces": ["team-a"], "name": "team-a",
                            "limits": {"bodies": 16, "requests": 64, "bytes": 268435456,
                                       "streams": 8}}}}

Only SHA-256 digests of the tokens are kept in memory, and a presented token is compared with
every stored digest by :func:`hmac.compare_digest` (no early exit), so neither the tokens nor
the comparison's timing leak. Tokens never appear in a log line or an error message.

The file is polled (``ADV_AUTH_RELOAD_SECONDS``): when the resolved file's inode, mtime or size
changes it is read again. A Secret update swaps a symlink (``..data``) rather than writing the
file, so the poll stats the path through its symlinks each time. A file that does not parse on
reload keeps the previous tokens (logged and counted); one that does not parse at start is a
startup error. Without a tokens file the service is open: every request may use every namespace.

One rule for every transport: :meth:`Authenticator.authenticate` takes every credential a call
carries (all its ``Authorization`` headers, the API's and the viewer's routes alike, or all its
``authorization`` metadata entries), and more than one is a 401 whichever they are. A call that
outlives a reload (a gRPC stream) asks :meth:`Authenticator.current` what its token allows now,
woken by :meth:`Authenticator.reloaded`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import RequestError

log = logging.getLogger("advantage_service.auth")

ALL_NAMESPACES = "*"
SCHEME = "bearer"
# What a 401 answer's WWW-Authenticate header says (RFC 6750).
CHALLENGE = 'Bearer realm="advantage-service"'


class AuthError(RequestError):
    """401 (``unauthenticated``: no or unknown token) or 403 (``permission_denied``: the
    token does not allow the namespace). gRPC: UNAUTHENTICATED / PERMISSION_DENIED."""

    def __init__(self, code: str, message: str, *, status: int, field: str | None = None) -> None:
        super().__init__(code, message, field=field, status=status)


def unauthenticated(message: str) -> AuthError:
    return AuthError("unauthenticated", message, status=401, field="authorization")


class TokensFileError(ValueError):
    """The tokens file is missing, unreadable or not in the documented format."""


@dataclass(frozen=True)
class Principal:
    """Who a request authenticated as: the namespaces it may use (``None``: all of them)."""

    namespaces: frozenset[str] | None
    # A short name for logs: "anonymous" (open service) or "token-<n>" (its position in the
    # file), never the token itself.
    name: str
    # The token's SHA-256 digest (None: anonymous), so that a call that outlives a reload can
    # ask what the token allows now (Authenticator.current). Never printed.
    digest: bytes | None = field(default=None, repr=False, compare=False)
    # The token's own limits on what it may hold at once (tenancy.py), over the default share.
    limits: Mapping[str, int] | None = field(default=None, compare=False)

    def allows(self, namespace: str) -> bool:
        return self.namespaces is None or namespace in self.namespaces

    def authorize(self, namespace: str) -> None:
        """Raise a 403 :class:`AuthError` unless the namespace is allowed."""
        if not self.allows(namespace):
            raise AuthError(
                "permission_denied",
                f"the token does not allow namespace {namespace!r}",
                status=403,
                field="namespace",
            )


ANONYMOUS = Principal(None, "anonymous")


def digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


@dataclass(frozen=True)
class TokenTable:
    """Token digests and what each allows, in file order."""

    entries: tuple[tuple[bytes, Principal], ...]

    @classmethod
    def parse(cls, document: Any) -> TokenTable:
        """The table from the file's JSON object; raises :class:`TokensFileError` naming the
        entry by position (never by its token)."""
        if not isinstance(document, Mapping) or not isinstance(document.get("tokens"), Mapping):
            raise TokensFileError('the tokens file must be a JSON object {"tokens": {...}}')
        unknown = set(document) - {"tokens"}
        if unknown:
            raise TokensFileError(f"tokens file: unknown keys {sorted(unknown)}")
        entries = []
        for n, (token, value) in enumerate(document["tokens"].items(), start=1):
            if not isinstance(token, str) or not token.strip() or token != token.strip():
                raise TokensFileError(
                    f"tokens file: token #{n} must be a non-empty string without surrounding spaces"
                )
            name, limits, namespaces = _entry(n, value)
            if (
                not isinstance(namespaces, list)
                or not namespaces
                or not all(isinstance(ns, str) and 0 < len(ns) <= 128 for ns in namespaces)
            ):
                raise TokensFileError(
                    f"tokens file: token #{n}: its namespaces must be a non-empty list of "
                    f'namespace names (1 to 128 characters) or ["{ALL_NAMESPACES}"]'
                )
            allowed = None if ALL_NAMESPACES in namespaces else frozenset(namespaces)
            key = digest(token)
            entries.append((key, Principal(allowed, name or f"token-{n}", key, limits)))
        return cls(tuple(entries))

    @classmethod
    def load(cls, path: Path) -> TokenTable:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise TokensFileError(f"cannot read the tokens file {path}: {exc}") from None
        try:
            document = json.loads(text)
        except ValueError as exc:
            # The decoder's message says where, not what: no token text can end up in a log.
            raise TokensFileError(f"the tokens file {path} is not valid JSON: {exc}") from None
        return cls.parse(document)

    def lookup(self, token: str) -> Principal | None:
        """The principal of ``token``: every digest is compared, in constant time each."""
        return self.lookup_digest(digest(token))

    def lookup_digest(self, presented: bytes) -> Principal | None:
        """The principal of the token whose digest is ``presented`` (as :meth:`lookup`)."""
        found: Principal | None = None
        for stored, principal in self.entries:
            if hmac.compare_digest(stored, presented) and found is None:
                found = principal
        return found


# What a token's ``limits`` may set (tenancy.Limits' fields).
LIMIT_KEYS = ("bodies", "requests", "bytes", "streams")
NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


def _entry(n: int, value: Any) -> tuple[str | None, dict[str, int] | None, Any]:
    """A token's value: its namespaces (a list), or an object with ``namespaces``, an
    optional ``name`` (the tenant it counts as, in metrics and logs; tokens of one name are one
    tenant) and optional ``limits``."""
    if not isinstance(value, Mapping):
        return None, None, value
    unknown = set(value) - {"namespaces", "name", "limits"}
    if unknown:
        raise TokensFileError(f"tokens file: token #{n}: unknown keys {sorted(unknown)}")
    name = value.get("name")
    if name is not None and (
        not isinstance(name, str) or not 0 < len(name) <= 64 or not set(name) <= NAME_CHARS
    ):
        raise TokensFileError(
            f"tokens file: token #{n}: its name must be 1 to 64 letters, digits, '-', '_' or '.'"
        )
    limits = value.get("limits")
    if limits is not None:
        if not isinstance(limits, Mapping) or not all(
            key in LIMIT_KEYS and type(limit) is int and limit >= 1 for key, limit in limits.items()
        ):
            raise TokensFileError(
                f"tokens file: token #{n}: its limits must map some of {list(LIMIT_KEYS)} to "
                "integers >= 1"
            )
        limits = dict(limits)
    return name, limits, value.get("namespaces")


def bearer_token(authorization: str | None) -> str:
    """The token of an ``Authorization: Bearer <token>`` value; 401 when absent or another
    scheme."""
    if not authorization:
        raise unauthenticated("this service needs a bearer token (Authorization: Bearer ...)")
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != SCHEME or not token.strip():
        raise unauthenticated("the Authorization header must be 'Bearer <token>'")
    return token.strip()


def _file_signature(path: Path) -> tuple[str, int, int, int] | None:
    """What identifies the file's current content: the resolved path, its inode, mtime and
    size (a Secret update swaps the ``..data`` symlink: the resolved path and inode change)."""
    try:
        resolved = os.path.realpath(path)
        st = os.stat(resolved)
    except OSError:
        return None
    return resolved, st.st_ino, st.st_mtime_ns, st.st_size


class Authenticator:
    """Checks the bearer token of every request against the tokens file (open without one).

    ``on_reload(outcome)`` is called with ``"ok"`` or ``"error"`` after each reload attempt
    (the metric ``advantage_auth_reloads_total``).
    """

    def __init__(
        self,
        path: str | Path | None,
        *,
        reload_seconds: float = 10.0,
        on_reload: Callable[[str], None] | None = None,
        on_tokens: Callable[[int], None] | None = None,
    ) -> None:
        self.path = Path(path) if path else None
        self.reload_seconds = reload_seconds
        self._on_reload = on_reload or (lambda outcome: None)
        self._on_tokens = on_tokens or (lambda count: None)
        self._table: TokenTable | None = None
        self._signature: tuple[str, int, int, int] | None = None
        self._task: asyncio.Task[None] | None = None
        # Counts the reloads that put new tokens in force (bumped after the table is swapped,
        # on the poll's thread): a call that saw another value asks current() again.
        self.generation = 0
        # Set (and replaced) on the event loop after each such reload: reloaded() waits on it.
        self._reload_event: asyncio.Event | None = None
        if self.path is not None:
            # At start a bad file is fatal: the service must not come up open by mistake.
            self._signature = _file_signature(self.path)
            self._table = TokenTable.load(self.path)
            self._on_tokens(len(self._table.entries))

    @property
    def enabled(self) -> bool:
        return self.path is not None

    @property
    def token_count(self) -> int:
        return len(self._table.entries) if self._table is not None else 0

    def authenticate(self, credentials: Sequence[str]) -> Principal:
        """The principal of a call's credentials: every value of its ``Authorization`` headers
        (HTTP: the API and the viewer) or its ``authorization`` metadata entries (gRPC), as
        received. Raises a 401 :class:`AuthError` for more than one, open service or not (a
        team token and a wildcard one: which is meant is not ours to pick, and their order is
        the client's or a proxy's), and, with a tokens file, for none, another scheme or a
        token not in the file."""
        if isinstance(credentials, str | bytes):  # one value, not the list of them: a bug
            raise TypeError("authenticate() takes every credential of the call, as a sequence")
        if len(credentials) > 1:
            raise unauthenticated(
                f"the call carries more than one credential ({len(credentials)} Authorization "
                "headers or authorization metadata entries); send exactly one"
            )
        table = self._table
        if table is None:
            return ANONYMOUS
        principal = table.lookup(bearer_token(credentials[0] if credentials else None))
        if principal is None:
            raise unauthenticated("the bearer token is not valid")
        return principal

    def current(self, principal: Principal) -> Principal | None:
        """What ``principal``'s token allows under the tokens in force now (its namespaces may
        have changed); None once the token is no longer in the file. Open service: unchanged."""
        table = self._table
        if table is None:
            return principal
        return table.lookup_digest(principal.digest) if principal.digest is not None else None

    async def reloaded(self) -> None:
        """Return after the next reload that puts new tokens in force (on the event loop).

        No reload is missed by a caller that checks :meth:`current` and then awaits this without
        an ``await`` in between: the tokens are swapped before the event is set, on the loop."""
        if self._reload_event is None:
            self._reload_event = asyncio.Event()
        await self._reload_event.wait()

    def _announce(self) -> None:
        event, self._reload_event = self._reload_event, None
        if event is not None:
            event.set()

    def describe(self) -> str:
        if self.path is None:
            return "OPEN: no ADV_AUTH_TOKENS_FILE, every client may use every namespace"
        return f"bearer tokens from {self.path} ({self.token_count} tokens)"

    # ---- reloading ------------------------------------------------------------------------------

    def reload_if_changed(self) -> bool:
        """Read the file again when it changed since the last read. True when new tokens are
        in force; a file that does not parse keeps the previous ones."""
        if self.path is None:
            return False
        signature = _file_signature(self.path)
        if signature == self._signature:
            return False
        self._signature = signature
        try:
            table = TokenTable.load(self.path)
        except TokensFileError as exc:
            log.error("tokens file not reloaded, the previous tokens stay in force: %s", exc)
            self._on_reload("error")
            return False
        self._table = table
        self.generation += 1
        self._on_reload("ok")
        self._on_tokens(len(table.entries))
        log.info("tokens file reloaded: %d tokens", len(table.entries))
        return True

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.reload_seconds)
            # A stat and, rarely, a small read: cheap enough for the event loop, but a slow
            # volume must not stall it.
            if await asyncio.to_thread(self.reload_if_changed):
                self._announce()

    def start(self) -> None:
        """Start polling the file on the running event loop (no-op without a file)."""
        if self.path is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._poll())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

"""The token-credit viewer: a page at ``/viewer`` and the few JSON routes it reads beside the API.

The page (``viewer_static/``: HTML, CSS and JavaScript of the package, nothing from a CDN) shows
a request's tokens shaded by their advantage or any returned diagnostic, and per token why it got
its credit. It computes pasted requests through ``POST /v1/advantages`` with the caller's bearer
token; the routes here add what the API does not have:

- ``GET /viewer/api/config``: what this server offers the page (kept requests, token text).
- ``POST /viewer/api/diagnostics``: the diagnostics an estimator produces (so that the page asks
  for all of them).
- ``GET /viewer/api/recent`` and ``GET /viewer/api/requests/{id}``: the requests kept by
  ``ADV_VIEWER_KEEP`` (:class:`RecentRequests`), per namespace, with the namespace authorised as
  for the API (401, 403).
- ``POST /viewer/api/token-text``: token ids as text through ``ADV_TOKENIZER``.

Every route answers at once: the page holds no connection open after it has loaded.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import orjson
from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles

from .. import jsonio
from ..config import Settings
from ..engine import Computed, Engine
from ..errors import RequestError
from ..estimators import resolve_estimator
from ..estimators.pipeline import estimator_diagnostics
from ..response import build_response

STATIC = Path(__file__).with_name("viewer_static")
# The page's own policy: its scripts and styles only, its API on the same origin.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'none'; frame-ancestors 'none'; base-uri 'none'"
)
MAX_TEXT_IDS = 100_000
VIEWER_TRANSPORT = "http_viewer"


# ---- recent requests ----------------------------------------------------------------------------


@dataclass(frozen=True)
class KeptRequest:
    """A computed request as the viewer reopens it: its rollouts' tokens and rewards and the
    JSON response it got (as sent, or as JSON would have sent it for an Arrow answer)."""

    request_id: str
    namespace: str
    kept_at: float
    group_ids: list[str]
    group_sizes: list[int]
    tokens: np.ndarray  # int (N,)
    offsets: np.ndarray  # int64 (B + 1,)
    rewards: np.ndarray  # float32 (B,)
    response: bytes
    estimator: str

    @property
    def nbytes(self) -> int:
        ids = sum(len(g) for g in self.group_ids)
        return (
            self.tokens.nbytes
            + self.offsets.nbytes
            + self.rewards.nbytes
            + len(self.response)
            + ids
        )

    def summary(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "namespace": self.namespace,
            "kept_at": self.kept_at,
            "estimator": self.estimator,
            "groups": len(self.group_ids),
            "rollouts": int(self.rewards.size),
            "tokens": int(self.tokens.size),
        }

    def to_json(self) -> bytes:
        """``{"request": {"groups": [{"id", "rollouts": [{"tokens", "reward"}]}]}, "response":
        ...}``: the response's bytes as they were."""
        rollouts = [
            {"tokens": self.tokens[lo:hi], "reward": self.rewards[i]}
            for i, (lo, hi) in enumerate(zip(self.offsets[:-1], self.offsets[1:], strict=True))
        ]
        groups, start = [], 0
        for gid, size in zip(self.group_ids, self.group_sizes, strict=True):
            groups.append({"id": gid, "rollouts": rollouts[start : start + size]})
            start += size
        head = {**self.summary(), "request": {"groups": groups}}
        body = jsonio.dumps_bytes(head)
        return body[:-1] + b',"response":' + self.response + b"}"


def kept_request(computed: Computed[Any], response: bytes, now: float) -> KeptRequest:
    req = computed.request
    batch = req.batch
    return KeptRequest(
        request_id=req.request_id,
        namespace=req.namespace,
        kept_at=now,
        group_ids=list(batch.group_ids),
        group_sizes=batch.group_sizes.cpu().tolist(),
        tokens=batch.tokens.cpu().numpy(),
        offsets=batch.offsets.cpu().numpy().astype(np.int64),
        rewards=batch.rewards.cpu().numpy().astype(np.float32),
        response=response,
        estimator=req.estimator.label,
    )


class RecentRequests:
    """The last ``per_namespace`` requests of each namespace, at most ``max_bytes`` in all (the
    oldest of any namespace leave first; a request larger than the bound is not kept). In this
    process's memory: a replica shows the requests it computed. Thread-safe."""

    def __init__(self, per_namespace: int, max_bytes: int) -> None:
        self.per_namespace = per_namespace
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._lock = threading.Lock()
        self._by_namespace: dict[str, deque[KeptRequest]] = {}
        # (namespace, request_id) -> kept, oldest first
        self._all: OrderedDict[tuple[str, str], KeptRequest] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.per_namespace > 0

    def add(self, kept: KeptRequest) -> bool:
        """Keep ``kept``; False when it is over the byte bound alone (or keeping is off)."""
        size = kept.nbytes
        if not self.enabled or size > self.max_bytes:
            return False
        key = (kept.namespace, kept.request_id)
        with self._lock:
            if key in self._all:  # the same request id again: the newer one
                self._remove(self._all[key])
            ring = self._by_namespace.setdefault(kept.namespace, deque())
            ring.append(kept)
            self._all[key] = kept
            self.nbytes += size
            if len(ring) > self.per_namespace:
                self._remove(ring[0])
            while self.nbytes > self.max_bytes:
                self._remove(next(iter(self._all.values())))
        return True

    def _remove(self, kept: KeptRequest) -> None:
        del self._all[(kept.namespace, kept.request_id)]
        ring = self._by_namespace[kept.namespace]
        ring.remove(kept)
        if not ring:
            del self._by_namespace[kept.namespace]
        self.nbytes -= kept.nbytes

    def recent(self, namespace: str) -> list[KeptRequest]:
        """The namespace's kept requests, newest first."""
        with self._lock:
            return list(reversed(self._by_namespace.get(namespace, ())))

    def get(self, namespace: str, request_id: str) -> KeptRequest | None:
        with self._lock:
            return self._all.get((namespace, request_id))


# ---- token text ---------------------------------------------------------------------------------


class TokenText:
    """Token ids as text through a local ``tokenizer.json`` (the ``tokenizers`` library; the
    file is read once, nothing is downloaded)."""

    def __init__(self, path: str) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise RuntimeError(
                "ADV_TOKENIZER needs the tokenizers package: pip install tokenizers"
            ) from exc
        if not Path(path).is_file():
            raise RuntimeError(f"ADV_TOKENIZER: {path!r} is not a file (a local tokenizer.json)")
        self.path = path
        self._tokenizer = Tokenizer.from_file(path)
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return Path(self.path).parent.name or Path(self.path).name

    def texts(self, ids: list[int]) -> dict[str, str]:
        """id -> the text it decodes to alone (a byte-level piece of a character: U+FFFD)."""
        size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        with self._lock:  # (a Tokenizer is not documented as thread-safe)
            return {
                str(i): self._tokenizer.decode([i], skip_special_tokens=False)
                if 0 <= i < size
                else ""
                for i in ids
            }


# ---- the routes ---------------------------------------------------------------------------------


class Viewer:
    """What the page needs from the service: kept requests and token text."""

    def __init__(self, settings: Settings, engine: Engine) -> None:
        self.engine = engine
        self.recent = RecentRequests(settings.viewer_keep, settings.viewer_keep_bytes)
        self.token_text = TokenText(settings.tokenizer) if settings.tokenizer else None

    async def keep(self, computed: Computed[Any], json_response: bool) -> None:
        """Keep a request computed over HTTP (when ``ADV_VIEWER_KEEP`` asks for it). An Arrow
        answer is written as JSON for the page, off the event loop."""
        if not self.recent.enabled:
            return
        if json_response and isinstance(computed.encoded, bytes):
            response = computed.encoded
        else:
            req, result, summary = computed.request, computed.result, computed.summary
            response = await asyncio.to_thread(
                lambda: jsonio.dumps_bytes(build_response(req, result, summary))
            )
        self.recent.add(kept_request(computed, response, time.time()))


def mount_viewer(app: FastAPI, settings: Settings, engine: Engine) -> Viewer:
    """Serve the page at ``/viewer`` (its files at ``/viewer/static``) and its routes."""
    viewer = Viewer(settings, engine)
    router = APIRouter(include_in_schema=False)
    app.mount("/viewer/static", StaticFiles(directory=str(STATIC)), name="viewer-static")

    def authorize(request: Request, namespace: str | None = None) -> None:
        with engine.call(VIEWER_TRANSPORT, count=False) as call:
            call.principal = principal = engine.auth.authenticate(
                request.headers.get("authorization")
            )
            if namespace is not None:
                call.namespace = namespace
                principal.authorize(namespace)

    @router.get("/viewer")
    async def page() -> Response:
        return FileResponse(
            STATIC / "viewer.html",
            media_type="text/html",
            headers={"Content-Security-Policy": CSP, "Cache-Control": "no-cache"},
        )

    @router.get("/viewer/api/config")
    async def config() -> dict[str, Any]:
        token_text = viewer.token_text
        return {
            "auth": engine.auth.enabled,
            "keep": viewer.recent.per_namespace,
            "tokenizer": token_text.name if token_text is not None else None,
        }

    @router.post("/viewer/api/diagnostics")
    async def diagnostics(request: Request) -> dict[str, Any]:
        authorize(request)
        try:
            body = orjson.loads(await request.body() or b"{}")
        except orjson.JSONDecodeError as exc:
            raise RequestError("invalid_json", f"the body is not JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise RequestError("invalid_type", "the body must be a JSON object")
        spec = resolve_estimator(body.get("estimator"))
        return {"estimator": spec.to_dict(), "diagnostics": list(estimator_diagnostics(spec))}

    @router.get("/viewer/api/recent")
    async def recent(
        request: Request, namespace: Annotated[str, Query(min_length=1, max_length=128)]
    ) -> dict[str, Any]:
        authorize(request, namespace)
        return {
            "namespace": namespace,
            "keep": viewer.recent.per_namespace,
            "requests": [k.summary() for k in viewer.recent.recent(namespace)],
        }

    @router.get("/viewer/api/requests/{request_id}")
    async def kept(
        request: Request,
        request_id: str,
        namespace: Annotated[str, Query(min_length=1, max_length=128)],
    ) -> Response:
        authorize(request, namespace)
        found = viewer.recent.get(namespace, request_id)
        if found is None:
            why = (
                "this server keeps no requests (ADV_VIEWER_KEEP=0)"
                if not viewer.recent.enabled
                else f"it is not among the last {viewer.recent.per_namespace} kept"
            )
            raise RequestError(
                "not_found",
                f"request {request_id!r} of namespace {namespace!r} is not kept: {why}",
                field="request_id",
                status=404,
            )
        return Response(await asyncio.to_thread(found.to_json), media_type="application/json")

    @router.post("/viewer/api/token-text")
    async def token_text(request: Request) -> JSONResponse:
        authorize(request)
        try:
            body = orjson.loads(await request.body() or b"{}")
        except orjson.JSONDecodeError as exc:
            raise RequestError("invalid_json", f"the body is not JSON: {exc}") from exc
        ids = body.get("ids") if isinstance(body, dict) else None
        if not isinstance(ids, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in ids
        ):
            raise RequestError("invalid_type", "ids must be a list of integers", field="ids")
        if len(ids) > MAX_TEXT_IDS:
            raise RequestError(
                "limit_exceeded", f"at most {MAX_TEXT_IDS} ids", field="ids", status=413
            )
        if viewer.token_text is None:
            return JSONResponse({"texts": None})
        texts = await asyncio.to_thread(viewer.token_text.texts, ids)
        return JSONResponse({"texts": texts})

    app.include_router(router)
    return viewer


__all__ = ["KeptRequest", "RecentRequests", "TokenText", "Viewer", "mount_viewer"]

"""The token-credit viewer: a page at ``/viewer`` and the few JSON routes it reads beside the API.

The page (``static/``: HTML, CSS and JavaScript of the package, nothing from a CDN) shows
a request's tokens shaded by their advantage or any returned diagnostic, and per token why it got
its credit. It computes pasted requests through ``POST /v1/advantages`` with the caller's bearer
token; the routes here add what the API does not have:

- ``GET /viewer/api/config``: what this server offers the page (kept requests, token text).
- ``POST /viewer/api/diagnostics``: the diagnostics an estimator produces (so that the page asks
  for all of them).
- ``GET /viewer/api/recent`` and ``GET /viewer/api/requests/{id}``: the requests kept by
  ``ADV_VIEWER_KEEP`` (:mod:`.viewer_keep`: in memory, or in Redis with ``ADV_REDIS_URL``),
  per namespace, with the namespace authorised as for the API (401, 403; 503 while Redis is
  unreachable).
- ``POST /viewer/api/token-text``: token ids as text through ``ADV_TOKENIZER``.

Every route answers at once: the page holds no connection open after it has loaded.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles

from ..config import Settings
from ..errors import RequestError
from ..estimators import resolve_estimator
from ..estimators.pipeline import estimator_diagnostics
from ..serving.engine import Computed, Engine
from ..wire import jsonio
from ..wire.response import build_response
from .keep import (
    KeepStore,
    KeepUnavailable,
    KeptRequest,
    RecentRequests,
    kept_request,
    make_keep_store,
)

log = logging.getLogger("advantage_service.viewer")

STATIC = Path(__file__).with_name("static")
# The page's own policy: its scripts and styles only, its API on the same origin.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'none'; frame-ancestors 'none'; base-uri 'none'"
)
MAX_TEXT_IDS = 100_000
VIEWER_TRANSPORT = "http_viewer"
# Keeping writes to Redis waiting at once, at most; past that a request is not kept (counted).
MAX_PENDING_KEEPS = 64


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
        metrics = engine.metrics
        self.store: KeepStore = make_keep_store(
            settings.redis_url,
            settings.viewer_keep,
            settings.viewer_keep_bytes,
            settings.viewer_keep_ttl_seconds,
            on_error=lambda op: metrics.stats_store_errors_total.labels(op).inc(),
            cluster=settings.redis_cluster,
        )
        self.token_text = TokenText(settings.tokenizer) if settings.tokenizer else None
        self._pending: set[asyncio.Task[None]] = set()

    async def keep(self, computed: Computed[Any], json_response: bool) -> None:
        """Keep a request computed over HTTP (when ``ADV_VIEWER_KEEP`` asks for it). An Arrow
        answer is written as JSON for the page, off the event loop. In memory before the
        answer; to Redis after it (a task of its own: the answer never waits for Redis, and an
        outage never fails it)."""
        if not self.store.enabled:
            return
        if not self.store.background:
            await self._keep(computed, json_response)
            return
        if len(self._pending) >= MAX_PENDING_KEEPS:
            self.engine.metrics.stats_store_errors_total.labels("viewer_keep").inc()
            return
        task = asyncio.create_task(self._keep(computed, json_response))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _keep(self, computed: Computed[Any], json_response: bool) -> None:
        try:
            if json_response and isinstance(computed.encoded, bytes):
                response = computed.encoded
            else:
                req, result, summary = computed.request, computed.result, computed.summary
                response = await asyncio.to_thread(
                    lambda: jsonio.dumps_bytes(build_response(req, result, summary))
                )
            await self.store.add(kept_request(computed, response, time.time()))
        except Exception:  # best effort: never the request's failure
            log.exception("viewer: keeping request %r failed", computed.request.request_id)

    async def settle(self) -> None:
        """Wait for the keeping writes scheduled so far."""
        while self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)

    async def close(self) -> None:
        await self.settle()
        await self.store.close()


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

    def unavailable() -> RequestError:
        return RequestError(
            "keep_unavailable",
            "kept requests live in Redis, which is unreachable now; retry later (requests are "
            "still computed, but not kept meanwhile)",
            status=503,
        )

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
            "keep": viewer.store.per_namespace,
            "keep_store": viewer.store.kind,
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
        try:
            requests = await viewer.store.recent(namespace)
        except KeepUnavailable as exc:
            raise unavailable() from exc
        return {"namespace": namespace, "keep": viewer.store.per_namespace, "requests": requests}

    @router.get("/viewer/api/requests/{request_id}")
    async def kept(
        request: Request,
        request_id: str,
        namespace: Annotated[str, Query(min_length=1, max_length=128)],
    ) -> Response:
        authorize(request, namespace)
        try:
            found = await viewer.store.get(namespace, request_id)
        except KeepUnavailable as exc:
            raise unavailable() from exc
        if found is None:
            why = (
                "this server keeps no requests (ADV_VIEWER_KEEP=0)"
                if not viewer.store.enabled
                else f"it is not among the last {viewer.store.per_namespace} kept"
            )
            if viewer.store.kind == "redis":
                why += ", or it is older than ADV_VIEWER_KEEP_TTL_SECONDS"
            raise RequestError(
                "not_found",
                f"request {request_id!r} of namespace {namespace!r} is not kept: {why}",
                field="request_id",
                status=404,
            )
        return Response(found, media_type="application/json")

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

"""The token-credit viewer: a page at ``/viewer`` and the few JSON routes it reads beside the API.

The page (``static/``: HTML, CSS and JavaScript of the package, nothing from a CDN) shows
a request's tokens shaded by their advantage or any returned diagnostic, and per token why it got
its credit. It computes pasted requests through ``POST /v1/advantages`` with the caller's bearer
token; the routes here add what the API does not have:

- ``GET /viewer/api/config``: what this server offers the page (kept requests, token text).
- ``POST /viewer/api/diagnostics``: the diagnostics an estimator produces (so that the page asks
  for all of them).
- ``GET /viewer/api/recent`` and ``GET /viewer/api/requests/{id}``: the requests kept by
  ``ADV_VIEWER_KEEP`` (:mod:`.keep`: in memory, or in Redis with ``ADV_REDIS_URL``), whichever
  transport computed them (the engine hands each to :meth:`Viewer.keep`), per namespace, with
  the namespace authorised as for the API (401, 403; 503 while Redis is unreachable).
- ``POST /viewer/api/token-text``: token ids as text through ``ADV_TOKENIZER``.

Every route answers at once: the page holds no connection open after it has loaded. Every
route authenticates as the API does (the same call: two ``Authorization`` headers are a 401),
and the two POST routes are admitted and read their body as the API does (the transport's
``receive_body``: a place in the queue before the body, 503 when it is full; 413 over the
body limit, from Content-Length before a byte is read), within ``MAX_VIEWER_BODY_BYTES``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles

from ..config import Settings
from ..errors import LimitExceeded, RequestError
from ..estimators import resolve_estimator
from ..estimators.pipeline import estimator_diagnostics
from ..serving.engine import Computed, Engine
from ..serving.scheduler import Ticket
from ..serving.token_text import TokenText
from ..wire import jsonio
from ..wire.response import build_response
from ..wire.text import check_path_segment, check_query
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
# The most a body of the page's POST routes may hold (ADV_MAX_BODY_BYTES when that is lower):
# MAX_TEXT_IDS ids of 19 digits fit (the page sends 50,000 at a time), an estimator much less.
# Small, so that parsing any body accepted costs a few MiB, not the API's body limit many times.
MAX_VIEWER_BODY_BYTES = 2 * 2**20
VIEWER_BODY_SETTING = "the viewer's routes take at most 2 MiB, or ADV_MAX_BODY_BYTES if lower"
# Parsing costs up to ~70 bytes a value (an empty list, a short string, and its slot: 2 MiB of
# "[],[]..." would take 64 MiB), so the values a body may hold are bounded by its commas before
# it is parsed (nesting without commas is bounded by the parser's depth limit, 1024).
MAX_DIAGNOSTICS_COMMAS = 4096  # an estimator object: dozens
MAX_TOKEN_TEXT_COMMAS = MAX_TEXT_IDS + 64
VIEWER_TRANSPORT = "http_viewer"
# Keeping writes to Redis waiting at once, at most; past that a request is not kept (counted).
MAX_PENDING_KEEPS = 64


# ---- the routes ---------------------------------------------------------------------------------

# The transport's admission and body reader (transports/http.py), the one the API uses:
# (request, limit, the limit's name for the 413) -> (the place in the queue, the body).
ReceiveBody = Callable[[Request, int, str], Awaitable[tuple[Ticket, bytes]]]


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
        self.token_text: TokenText | None = engine.token_text
        self._pending: set[asyncio.Task[None]] = set()
        # Every transport's computed requests come through the engine: one hook keeps them all.
        engine.add_computed_hook(self.keep)

    async def keep(self, computed: Computed[Any]) -> None:
        """Keep a computed request, whatever its transport (the engine's hook: HTTP JSON or
        Arrow, gRPC unary, each group of a gRPC stream), when ``ADV_VIEWER_KEEP`` asks for it.
        A JSON answer is kept as sent; any other (Arrow, protobuf) is written as the JSON that
        HTTP would have sent, off the event loop. In memory before the answer; to Redis after
        it (a task of its own: the answer never waits for Redis, and an outage never fails
        it)."""
        if not self.store.enabled:
            return
        if not self.store.background:
            await self._keep(computed)
            return
        if len(self._pending) >= MAX_PENDING_KEEPS:
            self.engine.metrics.stats_store_errors_total.labels("viewer_keep").inc()
            return
        task = asyncio.create_task(self._keep(computed))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _keep(self, computed: Computed[Any]) -> None:
        try:
            if computed.encoded_json and isinstance(computed.encoded, bytes):
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
        """Keep no more requests (those still computing, a gRPC stream's groups among them, are
        not kept), wait for the writes scheduled, close the store."""
        self.engine.remove_computed_hook(self.keep)
        await self.settle()
        await self.store.close()


def mount_viewer(
    app: FastAPI, settings: Settings, engine: Engine, receive_body: ReceiveBody
) -> Viewer:
    """Serve the page at ``/viewer`` (its files at ``/viewer/static``) and its routes; the POST
    routes are admitted and read their body through ``receive_body``, as the API's route."""
    viewer = Viewer(settings, engine)
    body_limit = min(settings.max_body_bytes, MAX_VIEWER_BODY_BYTES)
    router = APIRouter(include_in_schema=False)
    app.mount("/viewer/static", StaticFiles(directory=str(STATIC)), name="viewer-static")

    def authorize(request: Request, namespace: str | None = None) -> None:
        """The API's authentication, the same call (every Authorization header: more than one
        is a 401), then the namespace's authorisation (403)."""
        with engine.call(VIEWER_TRANSPORT, count=False) as call:
            # (raw bytes: the framework reads bytes that are not UTF-8 as U+FFFD, another name)
            check_query(request.scope.get("query_string", b""))
            if "request_id" in request.path_params:
                check_path_segment(request.scope.get("raw_path") or b"", "request_id")
            call.principal = principal = engine.auth.authenticate(
                request.headers.getlist("authorization")
            )
            if namespace is not None:
                call.namespace = namespace
                principal.authorize(namespace)

    @contextlib.asynccontextmanager
    async def admitted_json(request: Request, max_commas: int) -> AsyncIterator[Any]:
        """The body of a POST route, parsed, inside its place in the API's queue: authenticated
        first (without a valid token no place is taken and no body read), then admitted, then
        read, its commas counted (at most ``max_commas``: a 413 before parsing); the place is
        held until the route has answered."""
        authorize(request)
        ticket, body = await receive_body(request, body_limit, VIEWER_BODY_SETTING)
        with ticket:
            if body.count(b",") > max_commas:
                raise LimitExceeded(
                    f"the body holds more than {max_commas + 1} values; this route of the "
                    "viewer takes no more",
                    field="body",
                )
            try:
                parsed = orjson.loads(body or b"{}")
            except orjson.JSONDecodeError as exc:
                raise RequestError("invalid_json", f"the body is not JSON: {exc}") from exc
            del body  # parsed: the bytes are not needed while the route answers
            yield parsed

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
        async with admitted_json(request, MAX_DIAGNOSTICS_COMMAS) as body:
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
        async with admitted_json(request, MAX_TOKEN_TEXT_COMMAS) as body:
            ids = body.get("ids") if isinstance(body, dict) else None
            if isinstance(ids, list) and len(ids) > MAX_TEXT_IDS:
                raise RequestError(
                    "limit_exceeded", f"at most {MAX_TEXT_IDS} ids", field="ids", status=413
                )
            if not isinstance(ids, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in ids
            ):
                raise RequestError("invalid_type", "ids must be a list of integers", field="ids")
            if viewer.token_text is None:
                return JSONResponse({"texts": None})
            texts = await asyncio.to_thread(viewer.token_text.texts, ids)
            return JSONResponse({"texts": texts})

    app.include_router(router)
    return viewer


__all__ = ["KeptRequest", "RecentRequests", "TokenText", "Viewer", "mount_viewer"]

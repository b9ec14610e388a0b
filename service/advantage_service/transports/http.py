"""The HTTP transport (FastAPI): wire formats in and out, errors to statuses; no math, no policy.

``POST /v1/advantages`` reads the body as raw bytes and decodes it with the same code as the
in-process API (JSON) or the Arrow codec; the pydantic models below exist for the OpenAPI
document only, because validating megabytes of token lists through pydantic would cost more
than computing their advantages.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from functools import partial
from typing import Annotated, Any, Literal

from advantage_contract import arrow as contract_arrow
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from swagger_ui_bundle import swagger_ui_path

from ..config import Settings
from ..errors import Overloaded, RequestError
from ..estimators import AdvantageResult
from ..serving.accounting import Call
from ..serving.auth import CHALLENGE, Principal
from ..serving.engine import Engine
from ..serving.scheduler import Ticket
from ..version import __version__
from ..viewer.routes import mount_viewer
from ..wire import jsonio
from ..wire.listing import estimator_listing
from ..wire.request import ComputeRequest, parse_request
from ..wire.response import build_response
from ..wire.text import check_query
from . import arrow
from .connections import HeaderLimit, RequestLimit
from .http_body import UnreadBodies, closing, declared_length, read_body
from .openapi import (
    ADVANTAGE_RESPONSES,
    AUTH_RESPONSES,
    EstimatorListing,
    Health,
    Readiness,
    TokenStats,
    document_request_body,
    error_content,
)

log = logging.getLogger("advantage_service.http")

JSON = "application/json"
ARROW = contract_arrow.MEDIA_TYPE
# How much of a refused request's body is read and dropped before the connection closes.
DISCARD_MAX_BYTES = 8 * 2**30
DISCARD_MAX_SECONDS = 30.0
# Where the packaged Swagger UI assets are served.
DOCS_ASSETS = "/docs/assets"
# The transport label of GET /v1/stats/tokens in access lines and rejection counts.
STATS_TRANSPORT = "http_stats"

# ---- content negotiation ------------------------------------------------------------------------


def _media_type(header: str | None) -> str:
    return (header or "").split(";", 1)[0].strip().lower()


def request_format(content_type: str | None) -> Literal["json", "arrow"]:
    """The body's format by Content-Type (absent: JSON); anything else is a 415."""
    media = _media_type(content_type)
    if media in ("", JSON) or (media.startswith("application/") and media.endswith("+json")):
        return "json"
    if media == ARROW:
        return "arrow"
    raise RequestError(
        "unsupported_media_type",
        f"Content-Type {content_type!r} is not supported; send {JSON} or {ARROW}",
        field="Content-Type",
        status=415,
    )


def wants_arrow(accept: str | None) -> bool:
    """True when Accept ranks Arrow above JSON (JSON wins ties and by default). A media type
    named takes its own q over a wildcard's, q=0 included (RFC 9110 12.4.2: not acceptable);
    a q outside [0, 1] or not a number counts as 0."""
    if not accept:
        return False
    quality: dict[str, float] = {}
    wildcard = 0.0
    for part in accept.split(","):
        media, *params = (x.strip() for x in part.split(";"))
        q = 1.0
        for param in params:
            key, _, value = param.partition("=")
            if key.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
                q = q if 0.0 <= q <= 1.0 else 0.0
        media = media.lower()
        if media in (JSON, ARROW):
            quality[media] = max(quality.get(media, 0.0), q)
        elif media in ("*/*", "application/*"):
            wildcard = max(wildcard, q)
    return quality.get(ARROW, wildcard) > quality.get(JSON, wildcard)


# ---- codecs (run on the engine's workers) -------------------------------------------------------


def decode_json(body: bytes, limits: jsonio.BodyLimits | None = None) -> ComputeRequest:
    """A JSON body as a validated request (request.parse_request, as in-process), its counts
    checked against ``limits`` before its numbers are parsed (jsonio.loads_request)."""
    try:
        obj = jsonio.loads_request(body, limits)
    except RequestError:
        raise
    except (ValueError, RecursionError) as exc:  # too-deep nesting, integers of 4300+ digits
        raise RequestError("invalid_json", f"request body is not usable JSON: {exc}") from exc
    return parse_request(obj)


def releasing(
    decode: Callable[[bytes], ComputeRequest], body: bytes
) -> Callable[[], ComputeRequest]:
    """``decode(body)`` as the engine's decoder, letting the body go once it is decoded: the
    engine holds its decoder until the answer, and a JSON body is not needed after decoding,
    so the computation does not run with the body still resident. (A decoded Arrow batch
    views the body's buffers, which then stay as long as the batch: no copy, no extra.)"""
    held = [body]

    def decoder() -> ComputeRequest:
        return decode(held.pop())

    return decoder


def encode_json(req: ComputeRequest, result: AdvantageResult, summary: dict[str, Any]) -> bytes:
    """The JSON response of :func:`response.build_response`, serialised by orjson.

    orjson writes numpy float32 arrays natively, each value in its shortest float32 repr: 20x
    faster than listing them for the json module, a third smaller, and the same float32 values
    after parsing. (It would write NaN as null; the engine refuses non-finite results first.)
    """
    return jsonio.dumps_bytes(build_response(req, result, summary))


# ---- the application ----------------------------------------------------------------------------


def _error_response(
    status: int, detail: dict[str, Any], headers: Mapping[str, str] | None = None
) -> JSONResponse:
    return JSONResponse({"error": detail}, status_code=status, headers=headers)


def _detail(code: str, message: str, field: str | None = None) -> dict[str, Any]:
    return {
        "code": code,
        "message": message,
        "group_id": None,
        "rollout_index": None,
        "field": field,
    }


class CloseWhenDraining:
    """ASGI middleware: once the service drains for shutdown, every HTTP answer carries
    ``Connection: close``, so that clients open new connections (refused once the listener
    closes) instead of reusing one the server is about to close under them."""

    def __init__(self, app: Any, engine: Engine) -> None:
        self.app = app
        self.engine = engine

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_closing(message: Any) -> None:
            if message["type"] == "http.response.start" and self.engine.draining:
                message = closing(message)
            await send(message)

        await self.app(scope, receive, send_closing)


def create_app(
    settings: Settings | None = None,
    engine: Engine | None = None,
    on_ready: Callable[[], None] | None = None,
) -> FastAPI:
    """The FastAPI application. Without ``engine``, the app makes one and closes it at shutdown.
    ``on_ready`` runs once the engine is warm, before the service reports ready."""
    settings = settings if settings is not None else Settings()
    owned = engine is None
    engine = engine if engine is not None else Engine(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not engine.warm:
            await asyncio.to_thread(engine.warm_up)
            await engine.start()
        await asyncio.to_thread(jsonio.compile_readers)  # (not at the first JSON request)
        if on_ready is not None:
            on_ready()
        log.info("ready on %s (max_inflight=%d)", engine.device, settings.max_inflight)
        try:
            yield
        finally:
            engine.draining = True
            await app.state.viewer.close()
            if owned:
                await engine.flush(timeout=settings.shutdown_timeout_seconds)
                await asyncio.to_thread(engine.close)

    app = FastAPI(
        title="advantage-service",
        version=__version__,
        summary="Model-free per-token advantage estimation for RL post-training of LLMs",
        description=(
            "Send groups of rollouts (token ids, a verifier reward, optional student and teacher "
            "log-probs); get a per-token advantage array for every rollout. JSON or Arrow IPC "
            "(`Content-Type`/`Accept: " + ARROW + "`). Estimators: `GET /v1/estimators`."
        ),
        lifespan=lifespan,
        # Swagger UI is served from the package (below), never from a CDN: the page must work
        # on an air-gapped cluster. (ReDoc would load from a CDN: not offered.)
        docs_url=None,
        redoc_url=None,
    )
    app.state.engine = engine
    app.state.settings = settings
    arrow_limits = arrow.ArrowLimits.from_settings(settings)
    # An answer before its request's body is whole drops the rest (bounded) and closes; what
    # the service cannot frame or decode is refused on every route (http_body.py).
    app.add_middleware(
        UnreadBodies,
        max_bytes=DISCARD_MAX_BYTES,
        max_seconds=DISCARD_MAX_SECONDS,
        min_rate=settings.body_min_rate,
        grace=settings.body_rate_grace_seconds,
    )
    app.add_middleware(CloseWhenDraining, engine=engine)
    # HTTP requests handled at once (ADV_MAX_CONNECTIONS): requests, not connections, so that
    # connections still sending headers never refuse one (connections.py).
    app.add_middleware(RequestLimit, limit=settings.max_connections)
    app.add_middleware(HeaderLimit, limit=settings.max_header_bytes)
    app.mount(DOCS_ASSETS, StaticFiles(directory=str(swagger_ui_path)), name="docs-assets")

    async def receive_body(
        request: Request,
        limit: int,
        setting: str = "ADV_MAX_BODY_BYTES",
        principal: Principal | None = None,
    ) -> tuple[Ticket, bytes]:
        """A place among the bodies being received, then the body (:func:`read_body`, at most
        ``limit`` bytes, at the minimum rate), then a place among the requests admitted: the
        admission of every route that reads a body (the API's and the viewer's), counted
        against the caller's tenant (``principal``'s; authenticated here when not given). A
        body over ``limit`` by its Content-Length is a 413 before it takes a place; the place
        is taken before the body is read, for the bytes Content-Length declares, and refused
        at once when the requests admitted are full too, so an overloaded service answers 503
        without buffering what it refuses; a body still arriving holds no place a ready
        request needs. The caller releases the ticket (``with ticket:``) once it has
        answered."""
        if principal is None:
            principal = engine.auth.authenticate(request.headers.getlist("authorization"))
        tenant = engine.tenant(principal, request.client.host if request.client else None)
        return await engine.receive(
            tenant,
            lambda ticket: read_body(
                request,
                limit,
                settings.body_timeout,
                ticket.hold,
                setting=setting,
                min_rate=settings.body_min_rate,
                grace=settings.body_rate_grace_seconds,
            ),
            declared_length(request, limit, setting) or 0,
        )

    app.state.viewer = mount_viewer(app, settings, engine, receive_body)

    @app.get("/docs", include_in_schema=False)
    async def docs() -> Response:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title="advantage-service API",
            swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{DOCS_ASSETS}/favicon-32x32.png",
        )

    @app.get("/", include_in_schema=False)
    async def root() -> Response:
        """The start page a person opens: the token-credit viewer (it links the API docs)."""
        return RedirectResponse("/viewer")

    def authenticate(request: Request, call: Call) -> Principal:
        """The caller's principal from ``Authorization: Bearer`` (a 401 otherwise, and for more
        than one such header: the viewer's routes make the same call), kept on ``call`` for its
        accounting."""
        call.principal = engine.auth.authenticate(request.headers.getlist("authorization"))
        return call.principal

    @app.exception_handler(RequestError)
    async def request_error(request: Request, exc: RequestError) -> Response:
        headers = {"WWW-Authenticate": CHALLENGE} if exc.status == 401 else {}
        if isinstance(exc, Overloaded):
            headers = {"Retry-After": str(exc.retry_after_seconds)}
        # (Refused before its body was whole: UnreadBodies drops the rest and closes.)
        return _error_response(exc.status, exc.to_dict(), headers)

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, exc: ClientDisconnect) -> Response:
        # The client went away mid-body (on the viewer's POST routes; the API's route accounts
        # for it as 499 itself): no one reads an answer, and it is no fault of the service.
        return Response(status_code=400)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        return _error_response(
            422, _detail("invalid_parameter", str(first.get("msg", "invalid request")), where)
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return _error_response(exc.status_code, _detail(code, str(exc.detail)), exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        log.exception("internal error on %s %s", request.method, request.url.path)
        return _error_response(500, _detail("internal", "internal error; see the service log"))

    @app.post(
        "/v1/advantages",
        summary="Per-token advantages for groups of rollouts",
        response_model=None,
        responses=ADVANTAGE_RESPONSES,
        tags=["advantages"],
    )
    async def advantages(request: Request) -> Response:
        with engine.call("http") as call:
            # Before admission: a client without a valid token takes no place and sends no body.
            principal = authenticate(request, call)
            fmt = request_format(request.headers.get("content-type"))
            call.transport = transport = f"http_{fmt}"
            arrow_out = wants_arrow(request.headers.get("accept"))
            try:
                ticket, body = await receive_body(
                    request, settings.max_body_bytes, principal=principal
                )
            except ClientDisconnect:
                if engine.draining:
                    # Past the shutdown deadline the server closes the connections whose bodies
                    # it is still reading: a refusal (retry on another replica), not a client
                    # that went away.
                    call.finish(503, "shutting_down")
                else:
                    call.finish(499, "client_disconnected")
                return Response(status_code=400)
            with ticket:
                decode = releasing(
                    partial(arrow.decode_request, limits=arrow_limits)
                    if fmt == "arrow"
                    else partial(decode_json, limits=engine.body_limits),
                    body,
                )
                del body  # (the decoder holds it until it has decoded, then lets it go)
                encode = arrow.encode_response if arrow_out else encode_json
                # (The engine hands the computed request to the viewer's keeping hook.)
                computed = await engine.compute(
                    decode,
                    transport,
                    encode=encode,
                    ticket=ticket,
                    principal=principal,
                    call=call,
                    encodes_json=not arrow_out,
                )
        if arrow_out:
            assert computed.encoded is not None
            return Response(memoryview(computed.encoded), media_type=ARROW)
        return Response(computed.encoded, media_type=JSON)

    @app.get(
        "/v1/estimators",
        summary="Every estimator, term and preset with parameters, defaults and ranges",
        response_model=EstimatorListing,
        responses={401: AUTH_RESPONSES[401]},
        tags=["advantages"],
    )
    async def estimators(request: Request) -> dict[str, Any]:
        with engine.call("http_estimators", count=False) as call:
            authenticate(request, call)
            return listing

    @app.get(
        "/v1/stats/tokens",
        summary="Vocabulary statistics of a namespace, counted over every request",
        response_model=TokenStats,
        responses={
            **AUTH_RESPONSES,
            422: error_content("an unknown order or an out-of-range limit"),
            503: error_content("the stats store (Redis) is unreachable; retry later"),
        },
        tags=["statistics"],
    )
    async def token_stats(
        request: Request,
        namespace: Annotated[str, Query(min_length=1, max_length=128)] = "default",
        order: Annotated[
            Literal["key", "sensitivity", "occurrences"],
            Query(description="key: |mean KTAE score| descending; sensitivity; occurrences"),
        ] = "key",
        limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
    ) -> Response:
        with engine.call(STATS_TRANSPORT, count=False) as call:
            # (raw bytes: the framework reads bytes that are not UTF-8 as U+FFFD, another name)
            check_query(request.scope.get("query_string", b""))
            call.namespace = namespace
            principal = authenticate(request, call)
            stats = await engine.token_stats(namespace, order, limit, principal)
            if stats is None:
                call.finish(503, "stats_unavailable")
                return _error_response(
                    503, _detail("stats_unavailable", "the stats store is unreachable; retry later")
                )
            return JSONResponse(stats)

    @app.get("/healthz", summary="The process is alive", response_model=Health, tags=["ops"])
    async def healthz() -> dict[str, Any]:
        return {"status": "ok"}

    @app.get(
        "/readyz",
        summary="Ready to serve (503 while warming up or draining)",
        response_model=Readiness,
        responses={503: {"model": Readiness, "description": "not ready"}},
        tags=["ops"],
    )
    async def readyz() -> Response:
        store = await engine.refresh_stats_store()
        # A store that is down degrades history; the service still serves: readiness stays true.
        body: dict[str, Any] = {"ready": engine.ready, "stats_store": store}
        if not engine.ready:
            body["reason"] = "draining" if engine.draining else "warming up"
        return JSONResponse(body, status_code=200 if engine.ready else 503)

    @app.get(
        "/metrics",
        summary="Prometheus metrics",
        response_class=Response,
        responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
        tags=["ops"],
    )
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    listing = estimator_listing()
    document_request_body(app)
    return app

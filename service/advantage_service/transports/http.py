"""The HTTP transport (FastAPI): wire formats in and out, errors to statuses; no math, no policy.

``POST /v1/advantages`` reads the body as raw bytes and decodes it with the same code as the
in-process API (JSON) or the Arrow codec; the pydantic models below exist for the OpenAPI
document only, because validating megabytes of token lists through pydantic would cost more
than computing their advantages.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from functools import partial
from typing import Annotated, Any, Literal

import orjson
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, create_model
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from .. import __version__, jsonio
from ..api import compute as compute_in_process
from ..auth import CHALLENGE, AuthError, Principal
from ..config import Settings
from ..engine import Engine, Saturated
from ..errors import LimitExceeded, RequestError
from ..estimators import OUTCOMES, TERMS, AdvantageResult, Param, presets, resolve_estimator
from ..estimators.pipeline import all_diagnostics
from ..estimators.spec import DEFAULT_PRESET, TOP_LEVEL_PARAMS
from ..request import ComputeRequest, parse_request
from ..response import build_response
from . import arrow

log = logging.getLogger("advantage_service.http")

JSON = "application/json"
ARROW = arrow.MEDIA_TYPE
# The transport label of GET /v1/stats/tokens in access lines and rejection counts.
STATS_TRANSPORT = "http_stats"
REF = "#/components/schemas/{model}"

# ---- OpenAPI models (documentation and schema; the hot path never builds them) ----------------


class ErrorDetail(BaseModel):
    code: str = Field(description="stable machine-readable word, e.g. invalid_type")
    message: str = Field(description="what is wrong, naming the value")
    group_id: str | None = Field(None, description="the group of the offending value")
    rollout_index: int | None = Field(None, description="the rollout's index within its group")
    field: str | None = Field(None, description="the offending field, e.g. reward, logprobs")


class ErrorResponse(BaseModel):
    error: ErrorDetail

    model_config = ConfigDict(
        json_schema_extra={
            "example": {
                "error": {
                    "code": "length_mismatch",
                    "message": "logprobs has 2 values for 3 tokens",
                    "group_id": "prompt-17",
                    "rollout_index": 0,
                    "field": "logprobs",
                }
            }
        }
    )


TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
LogProb = Annotated[float, Field(le=0.0)]


class RolloutIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tokens: list[TokenId] = Field(description="token ids of the completion")
    reward: Annotated[float, Field(allow_inf_nan=False)] = Field(
        description="verifier reward; correct means reward > 0"
    )
    logprobs: list[LogProb] | None = Field(
        None, description="the policy's log-probability of each token (one per token)"
    )
    teacher_logprobs: dict[str, list[LogProb]] | None = Field(
        None, description="condition name (e.g. pos, neg) -> log-probabilities, one per token"
    )


class GroupIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str = Field(description="the group's (prompt's) id, unique in the request")
    rollouts: list[RolloutIn] = Field(min_length=1)


class AdvantageRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    request_id: str | None = Field(None, description="echoed back; generated when absent")
    namespace: str = Field("default", min_length=1, max_length=128)
    estimator: Any = Field(None, description="a preset name or an estimator object")
    ignore_token_ids: list[int] | None = Field(
        None, description="token ids KTAE ignores (end of text, padding)"
    )
    vocab_size: int | None = Field(None, ge=1, description="token ids must be below it")
    return_: list[str] | None = Field(
        None, alias="return", description="diagnostics to return beside advantages"
    )
    groups: list[GroupIn]


class Summary(BaseModel):
    tokens: int
    rollouts: int
    groups: int
    zero_signal_groups: int = Field(description="groups whose rollouts all had the same reward")
    device: str
    compute_ms: float
    history: Literal["none", "applied", "unavailable"]


RolloutOut = create_model(  # type: ignore[call-overload]
    "RolloutOut",
    advantages=(list[float], Field(description="per-token advantages, float32")),
    **{
        name: (
            float | None if name == "scalar" else list[float] | None,
            Field(None, description="returned when asked for in `return`"),
        )
        for name in all_diagnostics()
    },
)


class GroupOut(BaseModel):
    id: str
    rollouts: list[RolloutOut]  # type: ignore[valid-type]


class AdvantageResponse(BaseModel):
    request_id: str
    namespace: str
    estimator: dict[str, Any] = Field(description="the resolved estimator object")
    groups: list[GroupOut]
    summary: Summary


class ParamInfo(BaseModel):
    name: str
    type: Literal["boolean", "number", "string"]
    default: Any
    description: str
    nullable: bool
    minimum: float | None = None
    exclusive_minimum: float | None = None
    maximum: float | None = None
    choices: list[str] | None = None


class OutcomeInfo(BaseModel):
    name: str
    description: str
    formula: str
    paper: str
    parameters: list[ParamInfo]
    whiten_default: bool
    min_group_size: int


class TermInfo(BaseModel):
    name: str
    description: str
    formula: str
    paper: str
    parameters: list[ParamInfo]
    diagnostics: list[str]


class EstimatorListing(BaseModel):
    default: str
    presets: dict[str, dict[str, Any]] = Field(description="preset name -> resolved estimator")
    outcomes: list[OutcomeInfo]
    terms: list[TermInfo]
    options: list[ParamInfo] = Field(description="estimator-level parameters (whiten, clip)")
    diagnostics: list[str] = Field(description="names a request may list in `return`")


class TokenStat(BaseModel):
    token_id: int
    correct_rollouts: int = Field(description="rollouts with reward > 0 containing the token")
    wrong_rollouts: int = Field(description="rollouts with reward <= 0 containing the token")
    occurrences: int
    key_score: float | None = Field(description="mean KTAE score where KTAE scored the token")
    mean_sensitivity: float | None = Field(description="mean CSCR sensitivity where CSCR ran")


class TokenStats(BaseModel):
    namespace: str
    rollouts_counted: int
    tokens: list[TokenStat]


class Health(BaseModel):
    status: Literal["ok"]


class Readiness(BaseModel):
    ready: bool
    stats_store: Literal["memory", "up", "down"]
    reason: str | None = None


EXAMPLE_REQUEST: dict[str, Any] = {
    "request_id": "3f6c2a",
    "namespace": "default",
    "estimator": "ktae",
    "ignore_token_ids": [151643],
    "vocab_size": 151936,
    "return": ["scalar", "ktae_score"],
    "groups": [
        {
            "id": "prompt-17",
            "rollouts": [
                {"tokens": [9707, 11, 1879], "reward": 1.0, "logprobs": [-0.1, -2.3, -0.7]},
                {"tokens": [9707, 30], "reward": 0.0, "logprobs": [-0.2, -1.6]},
            ],
        }
    ],
}


def param_json_schema(p: Param) -> dict[str, Any]:
    """JSON Schema of one estimator parameter, from its registry declaration."""
    kind = {bool: "boolean", float: "number", str: "string"}[p.kind]
    schema: dict[str, Any] = {"type": kind, "description": p.doc}
    if p.minimum is not None:
        schema["exclusiveMinimum" if p.exclusive_minimum else "minimum"] = p.minimum
    if p.maximum is not None:
        schema["maximum"] = p.maximum
    if p.choices is not None:
        schema["enum"] = list(p.choices)
    if p.nullable:
        schema = {"anyOf": [schema, {"type": "null"}], "description": p.doc}
    if p.default is not None or p.nullable:
        schema["default"] = p.default
    return schema


def estimator_json_schema() -> dict[str, Any]:
    """JSON Schema of the request's ``estimator`` field, generated from the registry."""
    outcome_objects = [
        {
            "type": "object",
            "title": f"outcome {name}",
            "properties": {
                "name": {"const": name},
                **{p.name: param_json_schema(p) for p in outcome.params},
            },
            "required": ["name"],
            "additionalProperties": False,
        }
        for name, outcome in OUTCOMES.items()
    ]
    outcome_schema = {"anyOf": [{"type": "string", "enum": list(OUTCOMES)}, *outcome_objects]}
    properties: dict[str, Any] = {"outcome": outcome_schema}
    for name, term in TERMS.items():
        properties[name] = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {p.name: param_json_schema(p) for p in term.params},
                    "additionalProperties": False,
                },
                {"type": "boolean"},
                {"type": "null"},
            ],
            "description": f"{term.doc} ({term.paper}); true or {{}}: on with defaults",
        }
    properties.update({p.name: param_json_schema(p) for p in TOP_LEVEL_PARAMS})
    return {
        "anyOf": [
            {"type": "string", "enum": sorted(presets()), "description": "a preset"},
            {"type": "object", "properties": properties, "additionalProperties": False},
            {"type": "null"},
        ],
        "description": f"a preset name or an estimator object (default: {DEFAULT_PRESET!r})",
        "default": DEFAULT_PRESET,
    }


def request_json_schema() -> tuple[dict[str, Any], dict[str, Any]]:
    """(the request schema, the component schemas it refers to)."""
    schema = AdvantageRequest.model_json_schema(ref_template=REF, by_alias=True)
    defs = schema.pop("$defs", {})
    schema["properties"]["estimator"] = estimator_json_schema()
    schema["properties"]["return"] = {
        "anyOf": [
            {"type": "array", "items": {"type": "string", "enum": list(all_diagnostics())}},
            {"type": "null"},
        ],
        "description": "diagnostics to return beside advantages",
    }
    return schema, defs


def estimator_listing() -> dict[str, Any]:
    """Every outcome, term, preset and parameter, from the registry."""
    return {
        "default": DEFAULT_PRESET,
        "presets": {name: resolve_estimator(name).to_dict() for name in presets()},
        "outcomes": [
            {
                "name": o.name,
                "description": o.doc,
                "formula": o.formula,
                "paper": o.paper,
                "parameters": [p.describe() for p in o.params],
                "whiten_default": o.whiten_default,
                "min_group_size": o.min_group_size,
            }
            for o in OUTCOMES.values()
        ],
        "terms": [
            {
                "name": t.name,
                "description": t.doc,
                "formula": t.formula,
                "paper": t.paper,
                "parameters": [p.describe() for p in t.params],
                "diagnostics": list(t.diagnostics),
            }
            for t in TERMS.values()
        ],
        "options": [p.describe() for p in TOP_LEVEL_PARAMS],
        "diagnostics": list(all_diagnostics()),
    }


def _error_content(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


ADVANTAGE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "model": AdvantageResponse,
        "description": "per-token advantages; Arrow when Accept prefers " + ARROW,
        "content": {ARROW: {"schema": {"type": "string", "format": "binary"}}},
    },
    401: _error_content("no bearer token, or one the service does not know"),
    403: _error_content("the token does not allow the request's namespace"),
    408: _error_content("the body did not arrive within ADV_BODY_TIMEOUT_SECONDS"),
    413: _error_content("over ADV_MAX_BODY_BYTES, ADV_MAX_REQUEST_TOKENS or ADV_MAX_GROUP_SIZE"),
    415: _error_content("Content-Type is neither application/json nor " + ARROW),
    422: _error_content("a request the service will not compute; names group, rollout, field"),
    429: {
        **_error_content("ADV_MAX_INFLIGHT requests are computing; retry after Retry-After"),
        "headers": {
            "Retry-After": {"description": "seconds to wait", "schema": {"type": "integer"}}
        },
    },
    504: _error_content("the computation took longer than ADV_REQUEST_TIMEOUT_SECONDS"),
}
# Routes behind the bearer token (the others: health, readiness, metrics, documentation).
AUTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: ADVANTAGE_RESPONSES[401],
    403: ADVANTAGE_RESPONSES[403],
}


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
    """True when Accept ranks Arrow above JSON (JSON wins ties and by default)."""
    if not accept:
        return False
    quality = {JSON: 0.0, ARROW: 0.0}
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
        media = media.lower()
        if media in quality:
            quality[media] = max(quality[media], q)
        elif media in ("*/*", "application/*"):
            wildcard = max(wildcard, q)
    arrow_q = quality[ARROW] or wildcard
    json_q = quality[JSON] or wildcard
    return arrow_q > json_q


# ---- codecs (run on the engine's workers) -------------------------------------------------------


def decode_json(body: bytes) -> ComputeRequest:
    """A JSON body as a validated request: jsonio + request.parse_request, as in-process."""
    try:
        obj = jsonio.loads(body)
    except RequestError:
        raise
    except (ValueError, RecursionError) as exc:  # too-deep nesting, integers of 4300+ digits
        raise RequestError(
            "invalid_json", f"request body is not usable JSON: {exc}", field=""
        ) from exc
    return parse_request(obj)


def encode_json(req: ComputeRequest, result: AdvantageResult, summary: dict[str, Any]) -> bytes:
    """The JSON response of :func:`response.build_response`, serialised by orjson.

    orjson writes numpy float32 arrays natively, each value in its shortest float32 repr: 20x
    faster than listing them for the json module, a third smaller, and the same float32 values
    after parsing. (It would write NaN as null; the engine refuses non-finite results first.)
    """
    return orjson.dumps(build_response(req, result, summary), option=orjson.OPT_SERIALIZE_NUMPY)


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The request body, refusing more than ``limit`` bytes (413) and slow senders (408)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise LimitExceeded(
            f"the body has {int(declared)} bytes; the limit is {limit} (ADV_MAX_BODY_BYTES)",
            field="body",
        )
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                chunks.append(chunk)
                size += len(chunk)
                if size > limit:
                    raise LimitExceeded(
                        f"the body is over the limit of {limit} bytes (ADV_MAX_BODY_BYTES)",
                        field="body",
                    )
    except TimeoutError as exc:
        raise RequestError(
            "body_timeout",
            f"the body did not arrive within {timeout:g} s (ADV_REQUEST_TIMEOUT_SECONDS)",
            field="body",
            status=408,
        ) from exc
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


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
                headers = [(k, v) for k, v in message.get("headers", []) if k != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        await self.app(scope, receive, send_closing)


def create_app(settings: Settings | None = None, engine: Engine | None = None) -> FastAPI:
    """The FastAPI application. Without ``engine``, the app makes one and closes it at shutdown."""
    settings = settings if settings is not None else Settings()
    owned = engine is None
    engine = engine if engine is not None else Engine(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not engine.warm:
            await asyncio.to_thread(engine.warm_up)
            await engine.start()
        log.info("ready on %s (max_inflight=%d)", engine.device, settings.max_inflight)
        try:
            yield
        finally:
            engine.draining = True
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
    )
    app.state.engine = engine
    app.state.settings = settings
    app.add_middleware(CloseWhenDraining, engine=engine)

    def authenticate(request: Request, transport: str, *, count: bool = True) -> Principal:
        """The caller's principal from ``Authorization: Bearer``; a 401 otherwise (counted in
        the request metrics when ``count``, logged always)."""
        try:
            return engine.auth.authenticate(request.headers.get("authorization"))
        except AuthError as exc:
            if count:
                engine.record_rejection(transport, exc.status, exc.code)
            else:
                engine.log_access(transport, exc.status, exc.code)
            raise

    @app.exception_handler(RequestError)
    async def request_error(request: Request, exc: RequestError) -> Response:
        headers = {"WWW-Authenticate": CHALLENGE} if exc.status == 401 else None
        return _error_response(exc.status, exc.to_dict(), headers)

    @app.exception_handler(Saturated)
    async def saturated(request: Request, exc: Saturated) -> Response:
        return _error_response(429, exc.to_dict(), {"Retry-After": str(exc.retry_after)})

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
        started = time.perf_counter()
        # Before admission: a client without a valid token takes no slot and sends no body.
        principal = authenticate(request, "http")
        try:
            fmt = request_format(request.headers.get("content-type"))
        except RequestError as exc:
            engine.record_rejection("http", exc.status, exc.code)
            raise
        transport = f"http_{fmt}"
        arrow_out = wants_arrow(request.headers.get("accept"))
        # Admission before the body: a saturated service does not buffer what it will refuse.
        with engine.admit(transport) as slot:
            try:
                body = await read_body(request, settings.max_body_bytes, settings.body_timeout)
            except RequestError as exc:
                engine.record_rejection(
                    transport, exc.status, exc.code, started=started, principal=principal
                )
                raise
            except ClientDisconnect:
                engine.record_rejection(
                    transport, 499, "client_disconnected", started=started, principal=principal
                )
                return Response(status_code=400)
            decode: Callable[[], ComputeRequest] = partial(
                arrow.decode_request if fmt == "arrow" else decode_json, body
            )
            encode = arrow.encode_response if arrow_out else encode_json
            computed = await engine.compute(
                decode, transport, encode=encode, slot=slot, started=started, principal=principal
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
        authenticate(request, "http_estimators", count=False)
        return listing

    @app.get(
        "/v1/stats/tokens",
        summary="Vocabulary statistics of a namespace, counted over every request",
        response_model=TokenStats,
        responses={
            **AUTH_RESPONSES,
            422: _error_content("an unknown order or an out-of-range limit"),
            503: _error_content("the stats store (Redis) is unreachable; retry later"),
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
        started = time.perf_counter()
        principal = authenticate(request, STATS_TRANSPORT, count=False)
        try:
            stats = await engine.token_stats(namespace, order, limit, principal)
        except AuthError as exc:
            engine.log_access(STATS_TRANSPORT, exc.status, exc.code, started, principal, namespace)
            raise
        if stats is None:
            engine.log_access(
                STATS_TRANSPORT, 503, "stats_unavailable", started, principal, namespace
            )
            return _error_response(
                503, _detail("stats_unavailable", "the stats store is unreachable; retry later")
            )
        engine.log_access(STATS_TRANSPORT, 200, None, started, principal, namespace)
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
    _document_request_body(app)
    return app


def _document_request_body(app: FastAPI) -> None:
    """Put the request schemas (JSON and Arrow) and real examples into /openapi.json."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = generate()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        request_schema, defs = request_json_schema()
        components.update(defs)
        components["AdvantageRequest"] = request_schema
        operation = schema["paths"]["/v1/advantages"]["post"]
        operation["requestBody"] = {
            "required": True,
            "content": {
                JSON: {
                    "schema": {"$ref": REF.format(model="AdvantageRequest")},
                    "example": EXAMPLE_REQUEST,
                },
                ARROW: {
                    "schema": {"type": "string", "format": "binary"},
                    "description": (
                        "one row per rollout: group_id utf8, reward float, tokens "
                        "list<int32>, optional logprobs and teacher.<name> list<float32>; "
                        "the other request fields as JSON in schema metadata advantage.request"
                    ),
                },
            },
        }
        example = jsonio.loads(jsonio.dumps(compute_in_process(EXAMPLE_REQUEST, device="cpu")))
        operation["responses"]["200"]["content"][JSON]["example"] = example
        # The statistics an answer fed: a client (or a stateful test) can follow the link.
        operation["responses"]["200"]["links"] = {
            "TokenStatistics": {
                "operationRef": "#/paths/~1v1~1stats~1tokens/get",
                "parameters": {"namespace": "$response.body#/namespace"},
                "description": "the vocabulary statistics of the request's namespace",
            }
        }
        return schema

    app.openapi = openapi  # type: ignore[method-assign]

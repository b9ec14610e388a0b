"""The one settings object: ``ADV_*`` environment variables, overridden by CLI flags."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from .errors import SPLIT_HINT, LimitExceeded
from .estimators.state import Compression

MIB = 1024 * 1024


class Settings(BaseSettings):
    """Service settings. Every field is also the environment variable ``ADV_<NAME>``."""

    model_config = SettingsConfigDict(env_prefix="ADV_", extra="ignore", frozen=True)

    host: str = Field(
        default="127.0.0.1", description="interface to listen on; 0.0.0.0 in a container"
    )
    http_port: int = Field(default=8000, ge=0, le=65535, description="HTTP port (0: any free port)")
    grpc_port: int = Field(default=50051, ge=0, le=65535, description="gRPC port")
    device: str = Field(
        default="auto", description="auto (CUDA when available), cpu, cuda or cuda:N"
    )
    redis_url: str | None = Field(
        default=None, description="Redis for the stats store; unset: the embedded in-memory store"
    )
    redis_cluster: bool | None = Field(
        default=None,
        description="the Redis of ADV_REDIS_URL is a Redis Cluster (true: use the cluster "
        "client, even while that node is down at start; false: one Redis); unset: ask the node "
        "(INFO cluster) once it answers",
    )
    redis_cluster_buckets: int = Field(
        default=16,
        ge=1,
        le=16384,
        description="on a Redis Cluster, the keys each namespace's vocabulary statistics are "
        "spread over (a request writes one of them; reading the statistics reads them all); "
        "part of the stored layout: keep it for a namespace's life",
    )
    stats_compression: Compression = Field(
        default="none",
        description="zstd: KTAE history records in Redis about 8-11x smaller, for CPU per request",
    )
    stats_max_backlog: int = Field(
        default=32,
        ge=1,
        description="requests whose statistics are accepted and not yet written; at it no "
        "computation starts until the writes catch up (requests wait in the queue, then 503)",
    )
    stats_retry_seconds: float = Field(
        default=30.0,
        ge=0,
        description="how long answered requests' statistics that did not reach the stats store "
        "are written again before they count as lost (0: never again)",
    )
    stats_ttl_seconds: int = Field(
        default=7 * 24 * 3600, gt=0, description="how long per-prompt history and statistics live"
    )
    max_inflight: int = Field(
        default=4,
        ge=1,
        description="compute workers: computations at once (each may hold several merged "
        "requests); further requests wait in the queue",
    )
    max_queue: int = Field(
        default=256,
        ge=1,
        description="requests admitted at once (body whole: decoding, waiting or computing); "
        "beyond it the answer is 503 overloaded with a retry hint",
    )
    max_receiving: int = Field(
        default=256,
        ge=1,
        description="HTTP request bodies being received at once (they hold no place among "
        "ADV_MAX_QUEUE until whole); beyond it the answer is 503 overloaded",
    )
    max_queue_bytes: int = Field(
        default=1024 * MIB,
        ge=1,
        description="bytes held at once: request bodies (being received or admitted) and the "
        "rollouts gRPC streams hold for incomplete groups; beyond it the answer is 503 "
        "overloaded (a lone request is always admitted up to ADV_MAX_BODY_BYTES)",
    )
    tenant_share: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="the most one tenant (a token's principal; with auth off, a client "
        "address) may hold of each of ADV_MAX_RECEIVING, ADV_MAX_QUEUE, ADV_MAX_QUEUE_BYTES and "
        "ADV_STREAM_MAX_OPEN, as a fraction (at least 1 of each); a token's limits in the "
        "tokens file override it",
    )
    queue_timeout_seconds: float = Field(
        default=30.0,
        gt=0,
        description="the longest a request may wait from admission to the start of its "
        "computation; then the answer is 503 overloaded",
    )
    max_batch_tokens: int = Field(
        default=524_288,
        ge=0,
        description="dynamic batching: compatible waiting requests are computed as one batch "
        "of at most this many tokens; 0: never merge",
    )
    max_batch_delay_ms: float = Field(
        default=0.0,
        ge=0,
        description="dynamic batching: how long a mergeable request may wait for company when "
        "it would run alone (0: never waits)",
    )
    max_request_tokens: int = Field(
        default=8_388_608, ge=1, description="tokens in one request; above it the answer is 413"
    )
    max_body_bytes: int = Field(
        default=256 * MIB, ge=1, description="request body size; above it the answer is 413"
    )
    max_request_rollouts: int = Field(
        default=131_072,
        ge=1,
        description="rollouts in one request (counted before the body's numbers are parsed); "
        "above it the answer is 413",
    )
    max_arrow_batches: int = Field(
        default=1024,
        ge=1,
        description="record and dictionary batches in one Arrow request body; above it the "
        "answer is 413 (each batch costs the decoder a few KB of objects however few rows it "
        "holds: send few, large batches)",
    )
    max_group_size: int = Field(
        default=1024, ge=1, description="rollouts in one group; above it the answer is 413"
    )
    request_timeout_seconds: float = Field(
        default=60.0,
        gt=0,
        description="per-request compute deadline (504 / DEADLINE_EXCEEDED after it); also the "
        "time to receive a body unless ADV_BODY_TIMEOUT_SECONDS is set",
    )
    body_timeout_seconds: float | None = Field(
        default=None,
        gt=0,
        description="the longest a client may take to send a request body (408); unset: "
        "ADV_REQUEST_TIMEOUT_SECONDS",
    )
    body_min_rate: int = Field(
        default=64 * 1024,
        ge=0,
        description="bytes per second a request body must average after its first "
        "ADV_BODY_RATE_GRACE_SECONDS (408 below it: a slow sender holds nothing for long); 0: "
        "no minimum",
    )
    body_rate_grace_seconds: float = Field(
        default=5.0,
        ge=0,
        description="how long a request body may take before ADV_BODY_MIN_RATE applies",
    )
    header_timeout_seconds: float = Field(
        default=10.0,
        gt=0,
        description="the longest an HTTP connection may take to send a request's headers "
        "(from its opening, or from the previous answer on a kept-alive connection); then it "
        "is closed",
    )
    max_pending_connections: int = Field(
        default=1024,
        ge=1,
        description="HTTP connections still sending request headers at once; a new one beyond "
        "it closes the oldest of them (they hold no place a request needs)",
    )
    max_header_bytes: int = Field(
        default=16 * 1024,
        ge=1024,
        description="the request line and headers of an HTTP request; beyond it the answer is "
        "431 and the connection is closed",
    )
    stream_max_pending_groups: int = Field(
        default=4096, ge=1, description="gRPC StreamCompute: incomplete groups held per stream"
    )
    stream_max_pending_tokens: int = Field(
        default=8_388_608, ge=1, description="gRPC StreamCompute: tokens held per stream"
    )
    stream_max_open: int = Field(
        default=64,
        ge=1,
        description="gRPC StreamCompute calls open at once (UNAVAILABLE beyond, with a retry "
        "hint); a tenant opens at most its share (ADV_TENANT_SHARE)",
    )
    stream_idle_timeout_seconds: float = Field(
        default=60.0,
        gt=0,
        description="a gRPC stream that sends no message for this long is ended "
        "(DEADLINE_EXCEEDED) and its incomplete groups failed, so an idle stream holds no place",
    )
    max_connections: int = Field(
        default=1024,
        ge=1,
        description="HTTP requests whose headers are whole and gRPC calls handled at once "
        "(HTTP 503 / gRPC RESOURCE_EXHAUSTED beyond): bounds what the service holds for "
        "clients it has not admitted",
    )
    shutdown_timeout_seconds: float = Field(
        default=30.0, ge=0, description="on SIGTERM, how long in-flight requests may take to finish"
    )
    shutdown_delay_seconds: float = Field(
        default=0.0,
        ge=0,
        description="on SIGTERM, how long readiness is false before the listeners close (time "
        "for load balancers to stop sending)",
    )
    auth_tokens_file: str | None = Field(
        default=None,
        description='bearer tokens: a JSON file {"tokens": {"<token>": ["ns", ...] | ["*"]}}; '
        "unset: no authentication",
    )
    auth_reload_seconds: float = Field(
        default=10.0, gt=0, description="how often the tokens file is checked for changes"
    )
    tls_cert: str | None = Field(
        default=None, description="PEM certificate chain (HTTPS, gRPC TLS)"
    )
    tls_key: str | None = Field(default=None, description="PEM private key of tls_cert")
    tls_client_ca: str | None = Field(
        default=None, description="PEM CA bundle: clients must present a certificate it signed"
    )
    ignore_token_ids: Annotated[tuple[int, ...], NoDecode] = Field(
        default=(),
        description="token ids KTAE ignores in every request that gives no ignore_token_ids of "
        "its own (e.g. 151643, Qwen's end of text); comma-separated",
    )
    viewer_keep: int = Field(
        default=0,
        ge=0,
        le=10_000,
        description="the viewer's recent requests: the last N computed (any transport) kept per "
        "namespace, in Redis with ADV_REDIS_URL (any replica shows them), else in memory "
        "(0: none kept; tokens are user data, so keeping is opt-in)",
    )
    viewer_keep_bytes: int = Field(
        default=256 * MIB,
        ge=1,
        description="the most bytes kept requests may hold (the oldest go first): all together "
        "in memory; each namespace's, as stored JSON, in Redis",
    )
    viewer_keep_ttl_seconds: int = Field(
        default=24 * 3600,
        gt=0,
        description="with Redis, how long a kept request stays openable (in memory: until it "
        "is pushed out or the process ends)",
    )
    tokenizer: str | None = Field(
        default=None,
        description="a local tokenizer.json: the viewer shows tokens as text, and hicra finds "
        "planning tokens by strategic phrases in a request without planning_mask (needs the "
        "tokenizers package; nothing is downloaded); unset: ids only",
    )
    event_loop: Literal["auto", "asyncio", "uvloop"] = Field(
        default="auto",
        description="the event loop that carries HTTP and gRPC: auto (uvloop where installed: "
        "the service's install has it on Linux and macOS), asyncio, or uvloop",
    )
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    log_format: Literal["json", "text"] = Field(
        default="json", description="json: one JSON object per line; text: for a terminal"
    )

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, value: str | None) -> str | None:
        if value and not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(
                f"{value!r} is not a Redis URL: use redis://host:port/db, rediss:// (TLS) or "
                "unix:///path/to/socket"
            )
        return value

    @field_validator("ignore_token_ids", mode="before")
    @classmethod
    def _token_list(cls, value: object) -> object:
        # "151643,151645" or "[151643]" from the environment or a flag; a list from code
        if isinstance(value, str):
            text = value.strip().strip("[]")
            return tuple(int(part) for part in text.split(",") if part.strip())
        return value

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        if value in ("auto", "cpu", "cuda") or value.startswith("cuda:"):
            return value
        raise ValueError("device must be auto, cpu, cuda or cuda:N")

    @model_validator(mode="after")
    def _tls_pair(self) -> Settings:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together: give both or neither")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("tls_client_ca (mutual TLS) needs tls_cert and tls_key")
        return self

    @property
    def body_timeout(self) -> float:
        """Seconds to receive a request body (ADV_BODY_TIMEOUT_SECONDS, else the deadline)."""
        return self.body_timeout_seconds or self.request_timeout_seconds

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    @property
    def request_limits(self) -> RequestLimits:
        """What one request may hold, whatever carries it (transports/guards.py)."""
        return RequestLimits.from_settings(self)

    @field_validator("log_level", "log_format", "event_loop", mode="before")
    @classmethod
    def _lower(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value


_DEFAULTS = Settings.model_fields


@dataclass(frozen=True)
class RequestLimits:
    """The bounds of the settings every pre-parser checks a request body against before a
    decoder reads it (transports/guards.py), the same on every transport:
    ``ADV_MAX_REQUEST_TOKENS``, ``ADV_MAX_REQUEST_ROLLOUTS``, ``ADV_MAX_GROUP_SIZE``, and
    ``ADV_MAX_ARROW_BATCHES`` (the one an Arrow stream alone has). The bounds no setting
    changes (string lengths, teacher conditions, names, ids to ignore) are the contract's:
    advantage_contract.fields and wire/request.py. The ``check_*`` methods are the refusals of
    these bounds, in the words every transport and the engine give."""

    max_tokens: int = _DEFAULTS["max_request_tokens"].default
    max_rollouts: int = _DEFAULTS["max_request_rollouts"].default
    max_group_size: int = _DEFAULTS["max_group_size"].default
    max_arrow_batches: int = _DEFAULTS["max_arrow_batches"].default

    @classmethod
    def from_settings(cls, settings: Settings) -> RequestLimits:
        return cls(
            max_tokens=settings.max_request_tokens,
            max_rollouts=settings.max_request_rollouts,
            max_group_size=settings.max_group_size,
            max_arrow_batches=settings.max_arrow_batches,
        )

    def check_rollouts(self, rollouts: int) -> None:
        if rollouts > self.max_rollouts:
            raise LimitExceeded(
                f"the request has {rollouts} rollouts; the limit is {self.max_rollouts} "
                f"(ADV_MAX_REQUEST_ROLLOUTS): {SPLIT_HINT}",
                field="rollouts",
            )

    def check_tokens(self, tokens: int) -> None:
        if tokens > self.max_tokens:
            raise LimitExceeded(
                f"the request has {tokens} tokens; the limit is {self.max_tokens} "
                f"(ADV_MAX_REQUEST_TOKENS): {SPLIT_HINT}",
                field="tokens",
            )

    def check_group_size(self, group_id: str, size: int) -> None:
        if size > self.max_group_size:
            raise LimitExceeded(
                f"group {group_id!r} has {size} rollouts; the limit is {self.max_group_size} "
                "(ADV_MAX_GROUP_SIZE)",
                group_id=group_id,
                field="rollouts",
            )

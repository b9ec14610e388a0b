"""The one settings object: ``ADV_*`` environment variables, overridden by CLI flags."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

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
    stats_ttl_seconds: int = Field(
        default=7 * 24 * 3600, gt=0, description="how long per-prompt history and statistics live"
    )
    max_inflight: int = Field(
        default=4, ge=1, description="requests computed at once; beyond it the answer is 429"
    )
    max_request_tokens: int = Field(
        default=8_388_608, ge=1, description="tokens in one request; above it the answer is 413"
    )
    max_body_bytes: int = Field(
        default=256 * MIB, ge=1, description="request body size; above it the answer is 413"
    )
    max_group_size: int = Field(
        default=1024, ge=1, description="rollouts in one group; above it the answer is 413"
    )
    request_timeout_seconds: float = Field(
        default=60.0, gt=0, description="the longest a client may take to send a request body (408)"
    )
    stream_max_pending_groups: int = Field(
        default=4096, ge=1, description="gRPC StreamCompute: incomplete groups held per stream"
    )
    stream_max_pending_tokens: int = Field(
        default=8_388_608, ge=1, description="gRPC StreamCompute: tokens held per stream"
    )
    shutdown_timeout_seconds: float = Field(
        default=30.0, ge=0, description="on SIGTERM, how long in-flight requests may take to finish"
    )
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        if value in ("auto", "cpu", "cuda") or value.startswith("cuda:"):
            return value
        raise ValueError("device must be auto, cpu, cuda or cuda:N")

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

"""Tinker's test environment: the ``tinker`` SDK with its dependencies (its types are what the
integration fills; no Tinker server is reached), and the service's own requirements (torch
pinned to the CPU build) for the in-process path."""

from __future__ import annotations

from trainer_envs import EnvSpec, service_requirements

TINKER_VERSION = "0.38.0"
TINKER_ENV = EnvSpec(
    name="tinker",
    packages=(f"tinker=={TINKER_VERSION}", *service_requirements()),
)

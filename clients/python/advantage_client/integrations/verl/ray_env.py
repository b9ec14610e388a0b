"""The Ray workers, where verl trains: :func:`setup`, the worker setup hook that registers the
estimators and patches verl in every worker process (the TaskRunner that runs ``fit`` included),
its settings from ``ADVANTAGE_VERL_*`` variables (:func:`settings_from_env`), and
:func:`runtime_env`, a Ray ``runtime_env`` that runs it with given settings."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from .common import HOOK, VerlConfigError
from .estimator import register
from .patching import patch

ENV_TRANSPORT = "ADVANTAGE_VERL_TRANSPORT"
ENV_URL = "ADVANTAGE_VERL_URL"
ENV_PRESETS = "ADVANTAGE_VERL_PRESETS"
ENV_OPTIONS = "ADVANTAGE_VERL_OPTIONS"


def settings_from_env(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """:func:`register`'s arguments from ``ADVANTAGE_VERL_TRANSPORT`` (default inprocess),
    ``ADVANTAGE_VERL_URL``, ``ADVANTAGE_VERL_PRESETS`` (comma-separated names; default all) and
    ``ADVANTAGE_VERL_OPTIONS`` (a JSON object: the keyword options, and ``estimators``, a
    ``{name: estimator object}`` registered beside the presets: those named, or every preset
    when none is named)."""
    env = os.environ if env is None else env
    options = json.loads(env.get(ENV_OPTIONS) or "{}")
    if not isinstance(options, dict):
        raise VerlConfigError(f"{ENV_OPTIONS} must be a JSON object, got {options!r}")
    presets: Any = None
    names = [n.strip() for n in (env.get(ENV_PRESETS) or "").split(",") if n.strip()]
    objects = options.pop("estimators", None)
    if objects is not None and not isinstance(objects, dict):
        raise VerlConfigError(
            f"{ENV_OPTIONS}: estimators must be a JSON object {{name: estimator}}, got {objects!r}"
        )
    if names:
        presets = {**{n: n for n in names}, **(objects or {})}
    elif objects:  # (every preset, and these beside them)
        options["estimators"] = objects
    return {
        "transport": env.get(ENV_TRANSPORT) or "inprocess",
        "url": env.get(ENV_URL) or None,
        "presets": presets,
        **options,
    }


def setup() -> None:
    """The Ray worker setup hook: :func:`register` (settings from ``ADVANTAGE_VERL_*``) and
    :func:`patch` in every worker process, so the TaskRunner that runs ``fit`` has them.

    ``ray.init(runtime_env={"worker_process_setup_hook":
    "advantage_client.integrations.verl.setup"})``, or from verl's config:
    ``+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=advantage_client.integrations.verl.setup``.
    A bad setting fails the worker at start with this error."""
    settings = settings_from_env()
    register(settings.pop("transport"), settings.pop("url"), settings.pop("presets"), **settings)
    patch()


def runtime_env(
    transport: str = "inprocess",
    url: str | None = None,
    presets: Sequence[str] | None = None,
    estimators: Mapping[str, Any] | None = None,
    base: Mapping[str, Any] | None = None,
    **options: Any,
) -> dict[str, Any]:
    """A Ray ``runtime_env`` (``base`` plus) that runs :func:`setup` in every worker with these
    settings: ``ray.init(runtime_env=runtime_env("http", "http://advantage:8000"))``."""
    env = dict(base or {})
    env_vars = dict(env.get("env_vars") or {})
    env_vars[ENV_TRANSPORT] = transport
    if url is not None:
        env_vars[ENV_URL] = url
    if presets is not None:
        env_vars[ENV_PRESETS] = ",".join(presets)
    if estimators is not None:
        options = {**options, "estimators": dict(estimators)}
    if options:
        env_vars[ENV_OPTIONS] = json.dumps(options)
    env["env_vars"] = env_vars
    env["worker_process_setup_hook"] = HOOK
    return env

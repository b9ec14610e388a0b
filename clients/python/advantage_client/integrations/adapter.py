"""The pieces every trainer adapter has: the estimators chosen and checked against the service's
listing, the options sent with every call, the settings read from ``ADVANTAGE_<TRAINER>_*``
variables, a trainer class's methods replaced and restored, and the keyed, timed call of a
trainer's whole batch (AReaL, OpenRLHF)."""

from __future__ import annotations

import itertools
import json
import os
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict, Unpack

import numpy as np

from advantage_contract.prompt_keys import prompt_key

from . import backend
from .checks import EstimatorCheckError, inputs_read, required_inputs, resolve, uses_history


class CallOptions(TypedDict, total=False):
    """Options sent with every call (the rest configure the client: timeout, token, retry_for,
    ...)."""

    ignore_token_ids: Sequence[int] | None
    namespace: str | None


CALL_OPTIONS = tuple(CallOptions.__annotations__)


def call_options(client_options: dict[str, Any]) -> CallOptions:
    """The options sent with every call, taken out of ``client_options`` (None when absent)."""
    return CallOptions(
        ignore_token_ids=client_options.pop("ignore_token_ids", None),
        namespace=client_options.pop("namespace", None),
    )


def chosen_estimators(
    listing: Mapping[str, Any], presets: Sequence[str] | Mapping[str, Any] | None
) -> dict[str, Any]:
    """``{name: estimator}`` of a ``register`` call's ``presets``: every preset of the listing
    when None, each name as its own preset, or the mapping as given."""
    if presets is None:
        return {name: name for name in listing.get("presets", {})}
    if isinstance(presets, Mapping):
        return dict(presets)
    return {name: name for name in presets}


@dataclass(frozen=True)
class Checked:
    """One chosen estimator checked against the service's listing: the trainer's name for it,
    the estimator as given (what is sent), as resolved, the inputs it cannot do without, and
    every input it reads (by ``compute_padded`` keyword)."""

    name: str
    given: Any
    full: dict[str, Any]
    needs: set[str]
    reads: set[str]


def checked_each(
    chosen: Mapping[str, Any],
    listing: Mapping[str, Any],
    prefix: str,
    error: type[ValueError],
) -> Iterator[Checked]:
    """Each chosen estimator under the trainer's name ``<prefix><name>``, checked against
    ``listing``; what the service would refuse raises ``error`` naming the estimator."""
    for name, estimator in chosen.items():
        trainer_name = name if name.startswith(prefix) else prefix + name
        try:
            full = resolve(listing, estimator)
        except EstimatorCheckError as exc:
            raise error(f"{trainer_name}: {exc}") from None
        yield Checked(
            trainer_name,
            estimator,
            full,
            required_inputs(listing, full),
            inputs_read(listing, full),
        )


def settings_from_env(
    env: Mapping[str, str] | None, prefix: str, error: type[ValueError]
) -> dict[str, Any]:
    """A ``patch``'s arguments from ``<prefix>_ESTIMATOR`` (a preset name or a JSON estimator
    object; default ``grpo``), ``<prefix>_TRANSPORT``, ``<prefix>_URL`` and ``<prefix>_OPTIONS``
    (a JSON object of the other arguments); a variable that is not what it should be raises
    ``error`` naming it."""
    env = os.environ if env is None else env
    names = {k: f"{prefix}_{k.upper()}" for k in ("estimator", "transport", "url", "options")}
    raw = (env.get(names["estimator"]) or "grpo").strip()
    estimator: Any = raw
    if raw.startswith("{"):
        try:
            estimator = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise error(f"{names['estimator']} is not valid JSON: {exc}") from exc
    try:
        options = json.loads(env.get(names["options"]) or "{}")
    except json.JSONDecodeError as exc:
        raise error(f"{names['options']} is not valid JSON: {exc}") from exc
    if not isinstance(options, dict):
        raise error(f"{names['options']} must be a JSON object, got {options!r}")
    return {
        "estimator": estimator,
        "transport": env.get(names["transport"]) or None,
        "url": env.get(names["url"]) or None,
        **options,
    }


class Patched:
    """A trainer class whose methods the integration replaced, with the trainer's own: kept at
    the first replacement only, so that patching twice never keeps our own as the original."""

    def __init__(self) -> None:
        self.cls: Any = None
        self.originals: dict[str, Callable[..., Any]] = {}

    def keep(self, cls: Any, names: Sequence[str]) -> dict[str, Callable[..., Any]]:
        """The trainer's own ``names`` of ``cls``, kept to restore."""
        if not self.originals:
            self.cls = cls
            for name in names:
                self.originals[name] = getattr(cls, name)
        return self.originals

    def restore(self) -> None:
        """Put the trainer's own methods back and forget them (nothing when none were
        replaced)."""
        for name, original in self.originals.items():
            setattr(self.cls, name, original)
        self.originals.clear()
        self.cls = None


def step_inputs(
    listing: Mapping[str, Any],
    resolved: Mapping[str, Any],
    given: Any,
    available: frozenset[str],
    trainer: str,
    error: type[ValueError],
) -> set[str]:
    """The inputs the resolved estimator (``given``, as resolved against ``listing``) reads; one
    it cannot do without that ``trainer`` does not compute before its advantage step (it has
    ``available``) raises ``error``."""
    missing = required_inputs(listing, resolved) - available
    if missing:
        raise error(
            f"estimator {given!r} needs {sorted(missing)}, which {trainer} does not compute "
            f"before its advantage step (it has {sorted(available)})"
        )
    return inputs_read(listing, resolved)


def group_keys(prompts: list[np.ndarray], groups: np.ndarray) -> np.ndarray:
    """Per row, the contract's key of its group's prompt (its first row's prompt token ids), the
    key every integration sends, so history carries across trainers in a namespace."""
    first: dict[int, str] = {}
    for row, group in enumerate(groups.tolist()):
        if group not in first:
            first[group] = prompt_key(prompts[row])
    return np.asarray([first[g] for g in groups.tolist()], dtype=object)


class BatchCalls:
    """A trainer's backend, the options sent with every call, and one keyed, timed call per
    batch: each call's request id (this process's random prefix and a count) lets the service
    count a retried call once; ``calls`` keeps each call's time and history mode."""

    def __init__(self, transport: str | None, url: str | None, options: dict[str, Any]) -> None:
        self.call_options = call_options(options)
        self.backend = backend(transport or ("http" if url else "inprocess"), url, options)
        self._request_prefix = uuid.uuid4().hex
        self._calls = itertools.count()
        self.calls: list[dict[str, Any]] = []

    def compute_batch(
        self,
        tokens: Any,
        mask: Any,
        rewards: Any,
        groups: np.ndarray,
        prompts: list[np.ndarray],
        estimator: Any,
        per_token: Mapping[str, Any],
    ) -> Any:
        """The backend's ``compute_padded`` of the batch, each group keyed by its prompt."""
        start = time.perf_counter()
        result = self.backend.compute_padded(
            tokens,
            mask,
            rewards,
            groups,
            estimator=estimator,
            prompt_keys=group_keys(prompts, groups),
            request_id=f"{self._request_prefix}:{next(self._calls)}",
            **per_token,
            **self.call_options,
        )
        self.calls.append(
            {
                "ms": (time.perf_counter() - start) * 1000.0,
                "history": str(result.summary.get("history", "none")),
            }
        )
        return result


class RegisteredEstimator:
    """What each estimator a trainer's registry holds knows of itself: its registered name, the
    estimator as given (what is sent), as resolved against the service's listing, the inputs
    it cannot do without and those it reads, whether it keeps history, and the options of each
    call."""

    def __init__(self, checked: Checked, **call: Unpack[CallOptions]) -> None:
        self.name = checked.name
        self.given = checked.given
        self.full = dict(checked.full)
        self.needs = checked.needs
        self.reads = checked.reads
        self.history = uses_history(checked.full)
        self.ignore_token_ids = call.get("ignore_token_ids")
        self.namespace = call.get("namespace")

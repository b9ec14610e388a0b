"""What :func:`patch` replaces in verl (and :func:`unpatch` puts back): ``compute_advantage``
where each trainer looks it up, the v1 trainer's advantage step and fetch, and both trainers'
constructors, which check the config of an estimator registered here."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from .common import _estimator_name, _setting
from .compute_advantage import patched_compute_advantage
from .estimator import REGISTERED
from .v1 import _TransferQueueFetch, _v1_compute_advantage

# (module or class, attribute) -> what patch() replaced there.
_ORIGINALS: dict[tuple[Any, str], Any] = {}


def _checked_init(original: Callable[..., Any]) -> Callable[..., Any]:
    """A trainer's ``__init__`` that checks the config of an estimator registered here before
    anything loads (settings verl would ignore, inputs it will not compute)."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        config = getattr(self, "config", None)
        algorithm = _setting(config, "algorithm", None)
        fn = REGISTERED.get(_estimator_name(_setting(algorithm, "adv_estimator", "")))
        if fn is not None:
            fn.check_config(config)

    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    return __init__


def _replace(owner: Any, attribute: str, wrap: Callable[[Any], Any]) -> None:
    if (owner, attribute) not in _ORIGINALS:
        current = getattr(owner, attribute)
        _ORIGINALS[(owner, attribute)] = current
        setattr(owner, attribute, wrap(current))


def patch() -> list[str]:
    """Make verl pass the estimators registered here what they need; returns what it patched.
    Idempotent; :func:`unpatch` undoes it.

    - ``verl.trainer.ppo.ray_trainer.compute_advantage`` (the legacy trainer's ``fit`` looks it
      up there) and the name ``verl.trainer.ppo.v1.utils`` imported (the v1 trainer);
    - the v1 trainer's advantage step fetches the fields the estimator reads (``responses``,
      the prompts, ...) from its transfer queue (when ``verl.trainer.ppo.v1`` imports: it
      needs the ``transfer_queue`` package);
    - both trainers' constructors check the config of an estimator registered here.
    """
    patched = []
    ray_trainer = importlib.import_module("verl.trainer.ppo.ray_trainer")
    _replace(ray_trainer, "compute_advantage", patched_compute_advantage)
    _replace(ray_trainer.RayPPOTrainer, "__init__", _checked_init)
    patched.append("verl.trainer.ppo.ray_trainer")
    try:
        v1_utils = importlib.import_module("verl.trainer.ppo.v1.utils")
        trainer_base = importlib.import_module("verl.trainer.ppo.v1.trainer_base")
    except ImportError:  # the v1 trainer needs transfer_queue
        return patched
    _replace(v1_utils, "compute_advantage", patched_compute_advantage)
    _replace(trainer_base, "tq", _TransferQueueFetch)
    _replace(trainer_base.PPOTrainer, "_compute_advantage", _v1_compute_advantage)
    _replace(trainer_base.PPOTrainer, "__init__", _checked_init)
    patched += ["verl.trainer.ppo.v1.utils", "verl.trainer.ppo.v1.trainer_base"]
    return patched


def unpatch() -> None:
    """Put back what :func:`patch` replaced."""
    for (owner, attribute), original in list(_ORIGINALS.items()):
        setattr(owner, attribute, original)
        del _ORIGINALS[(owner, attribute)]

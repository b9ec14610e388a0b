"""What :func:`patch` replaces in verl (and :func:`unpatch` puts back): ``compute_advantage``
where each trainer looks it up, the v1 trainer's advantage step and fetch, both trainers'
constructors, which check the estimator the config selects, and the step's metrics, which get
the service call's (``advantage_service/retries``, ``advantage_service/fallback``)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from .common import HOOK, VerlConfigError, _estimator_name, _setting
from .compute_advantage import patched_compute_advantage
from .estimator import LAST_CALL, PREFIX, REGISTERED
from .v1 import _TransferQueueFetch, _v1_compute_advantage

# (module or class, attribute) -> what patch() replaced there.
_ORIGINALS: dict[tuple[Any, str], Any] = {}


def check_trainer_config(config: Any) -> None:
    """The estimator a verl config selects (``algorithm.adv_estimator``), checked when the
    trainer is built, before any model loads: an ``adv_*`` name not registered in this process
    (verl would say "Unknown advantage estimator" only at the first advantage step), and, for
    one registered here, the settings verl would ignore and the inputs it will not compute."""
    algorithm = _setting(config, "algorithm", None)
    name = _estimator_name(_setting(algorithm, "adv_estimator", ""))
    fn = REGISTERED.get(name)
    if fn is not None:
        fn.check_config(config)
        return
    if not name.startswith(PREFIX):
        return  # (one of verl's own)
    from verl.trainer.ppo import core_algos

    if name in core_algos.ADV_ESTIMATOR_REGISTRY:
        return  # (registered with verl by other code)
    if REGISTERED:
        why = (
            f"the estimators registered here are {sorted(REGISTERED)}: "
            f"{name!r} is 'adv_' + a preset of the service, or a name given in the setup "
            "hook's ADVANTAGE_VERL_PRESETS or ADVANTAGE_VERL_OPTIONS' estimators"
        )
    else:
        why = (
            "no estimator is registered in this process: run the setup hook in every Ray "
            f"worker (worker_process_setup_hook={HOOK!r}), or register() where the trainer "
            "is built"
        )
    raise VerlConfigError(f"algorithm.adv_estimator={name!r} is not registered: {why}")


def _checked_init(original: Callable[..., Any]) -> Callable[..., Any]:
    """A trainer's ``__init__`` that checks the estimator its config selects before anything
    loads (:func:`check_trainer_config`)."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        check_trainer_config(getattr(self, "config", None))

    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    return __init__


def call_metrics() -> dict[str, float]:
    """The last advantage call's metrics (then forgotten, so a step without one reports none):
    ``advantage_service/retries`` (the client's retries in the call) and
    ``advantage_service/fallback`` (1 when verl's own estimator answered)."""
    metrics = {f"advantage_service/{name}": value for name, value in LAST_CALL.items()}
    LAST_CALL.clear()
    return metrics


def _with_call_metrics(original: Callable[..., Any]) -> Callable[..., Any]:
    """verl's ``compute_data_metrics`` (the legacy trainer's step metrics) with the call's."""

    def compute_data_metrics(*args: Any, **kwargs: Any) -> Any:
        metrics = original(*args, **kwargs)
        metrics.update(call_metrics())
        return metrics

    compute_data_metrics.__wrapped__ = original  # type: ignore[attr-defined]
    return compute_data_metrics


def _v1_step_with_call_metrics(original: Callable[..., Any]) -> Callable[..., Any]:
    """The v1 trainer's advantage step (made to fetch what the estimator reads) adding the
    call's metrics to the step's ``metrics``."""
    step = _v1_compute_advantage(original)

    def _compute_advantage(self: Any, batch: Any, metrics: dict[str, Any]) -> Any:
        out = step(self, batch, metrics)
        metrics.update(call_metrics())
        return out

    _compute_advantage.__wrapped__ = original  # type: ignore[attr-defined]
    return _compute_advantage


def patched_here() -> bool:
    """Whether :func:`patch` has patched verl's ``compute_advantage`` in this process."""
    return any(attribute == "compute_advantage" for _, attribute in _ORIGINALS)


def responses_missing(name: str) -> VerlConfigError:
    """The error of a token-level estimator called without the response token ids, naming the
    cause: patch() not run in this process, or a batch without ``responses``."""
    if patched_here():
        return VerlConfigError(
            f"{name} needs the response token ids, and the batch at the advantage step has no "
            "data.batch['responses'] (patch() ran in this process: compute_advantage passes "
            "them whenever the batch holds them): keep 'responses' in the batch up to the "
            "advantage step (on the v1 trainer, in its transfer queue)"
        )
    return VerlConfigError(
        f"{name} needs the response token ids: patch() has not run in this process, the one "
        "that trains (the TaskRunner): use the Ray setup hook "
        f"(worker_process_setup_hook={HOOK!r}) so that compute_advantage passes "
        "data.batch['responses']"
    )


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
    - both trainers' constructors check the estimator their config selects;
    - the step's metrics get the advantage call's (legacy trainer: ``compute_data_metrics``;
      v1: its advantage step's ``metrics``).
    """
    patched = []
    ray_trainer = importlib.import_module("verl.trainer.ppo.ray_trainer")
    _replace(ray_trainer, "compute_advantage", patched_compute_advantage)
    _replace(ray_trainer.RayPPOTrainer, "__init__", _checked_init)
    _replace(ray_trainer, "compute_data_metrics", _with_call_metrics)
    patched.append("verl.trainer.ppo.ray_trainer")
    try:
        v1_utils = importlib.import_module("verl.trainer.ppo.v1.utils")
        trainer_base = importlib.import_module("verl.trainer.ppo.v1.trainer_base")
    except ImportError:  # the v1 trainer needs transfer_queue
        return patched
    _replace(v1_utils, "compute_advantage", patched_compute_advantage)
    _replace(trainer_base, "tq", _TransferQueueFetch)
    _replace(trainer_base.PPOTrainer, "_compute_advantage", _v1_step_with_call_metrics)
    _replace(trainer_base.PPOTrainer, "__init__", _checked_init)
    patched += ["verl.trainer.ppo.v1.utils", "verl.trainer.ppo.v1.trainer_base"]
    return patched


def unpatch() -> None:
    """Put back what :func:`patch` replaced."""
    for (owner, attribute), original in list(_ORIGINALS.items()):
        setattr(owner, attribute, original)
        del _ORIGINALS[(owner, attribute)]

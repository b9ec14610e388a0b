"""SkyRL (skyrl-train 0.3.1): the service's estimators in SkyRL's ``AdvantageEstimatorRegistry``
as ``adv_<name>``, as in verl.

::

    from advantage_client.integrations import skyrl

    skyrl.register("http", "http://advantage:8000")      # before SkyRL validates its config
    # trainer.algorithm.advantage_estimator=adv_grpo (or adv_rloo, adv_ktae, ...)

SkyRL's trainer calls a registered estimator with the per-token rewards (the reward on a
response's last token, or spread over tokens), the response mask, the uids and its settings
(``grpo_norm_by_std``, ``gamma``, ``lambd``). Each row's reward is its sum, as SkyRL's own GRPO
and RLOO take it; ``grpo_norm_by_std`` sets the outcome's ``norm_by_std``; the estimators are
group baselines that do not discount, so ``gamma`` and ``lambd`` other than 1.0 are refused.

Estimators that read the response's tokens (KTAE, ...), its log-probs or keep history per
prompt need the batch, which SkyRL's trainer does not pass to an estimator: wrap the trainer's
``compute_advantages_and_returns`` with :func:`patch_trainer` (the token ids are the
``sequences``' last ``response_length`` columns, the log-probs ``action_log_probs``, the prompt
key the contract's hash of the prompt's tokens), or pass ``responses=``, ``logprobs=`` and
``prompt_keys=`` through ``ppo_utils.compute_advantages_and_returns``, which forwards them.

Each estimator is checked against the service's listing when registered (an unknown name,
parameter or value, an input SkyRL cannot give). The registered objects are pickled by SkyRL's
registry actor into the trainer's process: the client is built there, at the first call.
"""

from __future__ import annotations

import contextvars
import functools
import itertools
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Unpack

import numpy as np

from advantage_contract.prompt_keys import prompt_key

from . import adapter, backend

PREFIX = "adv_"
DEFAULT_RETRY_FOR = 60.0
# The inputs this integration takes from SkyRL's batch (compute_padded keyword -> batch key).
BATCH_INPUTS = {"logprobs": "action_log_probs"}
# The batch of the trainer's compute_advantages_and_returns running now (patch_trainer).
_BATCH: contextvars.ContextVar[Any] = contextvars.ContextVar("skyrl_batch", default=None)


class SkyRLConfigError(ValueError):
    """A SkyRL setting or batch the service's estimator cannot take, named before training or
    at the step that has it."""


class SkyRLEstimator(adapter.RegisteredEstimator):
    """One service estimator behind SkyRL's estimator signature
    (``token_level_rewards, response_mask, index, **settings -> (advantages, returns)``)."""

    def __init__(
        self,
        checked: adapter.Checked,
        transport: str,
        url: str | None,
        client_options: Mapping[str, Any],
        **call: Unpack[adapter.CallOptions],
    ) -> None:
        from advantage_contract.padded import needs_token_ids

        super().__init__(checked, **call)
        self.transport, self.url, self.client_options = transport, url, dict(client_options)
        self.token_ids = needs_token_ids(self.full)
        self._request_prefix = uuid.uuid4().hex
        self._calls = itertools.count()
        self._backend: Any = None
        self.__name__ = f"compute_{self.name}_advantage"

    def __getstate__(self) -> dict[str, Any]:
        # (a client holds connections: each process builds its own at its first call)
        state = dict(self.__dict__)
        state["_backend"] = None
        state["_calls"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._calls = itertools.count()
        self._request_prefix = uuid.uuid4().hex

    def estimator_for(self, grpo_norm_by_std: bool, gamma: float, lambd: float) -> Any:
        """The estimator object under SkyRL's settings, or the setting it cannot honour."""
        if float(gamma) != 1.0 or float(lambd) != 1.0:
            raise SkyRLConfigError(
                f"{self.name}: trainer.algorithm.gamma={gamma} and lambd={lambd} discount "
                "returns (SkyRL's gae, reinforce++); the service's estimators are group "
                "baselines that do not: set trainer.algorithm.gamma=1.0 and lambd=1.0"
            )
        outcome = dict(self.full["outcome"])
        if "norm_by_std" not in outcome or bool(outcome["norm_by_std"]) == bool(grpo_norm_by_std):
            return self.full
        given = self.given.get("outcome") if isinstance(self.given, Mapping) else None
        if isinstance(given, Mapping) and "norm_by_std" in given:
            raise SkyRLConfigError(
                f"{self.name}: its estimator sets norm_by_std={outcome['norm_by_std']} but "
                f"trainer.algorithm.grpo_norm_by_std={grpo_norm_by_std}: make them agree"
            )
        return {**self.full, "outcome": {**outcome, "norm_by_std": bool(grpo_norm_by_std)}}

    def _compute_padded(self) -> Callable[..., Any]:
        if self._backend is None:
            self._backend = backend(self.transport, self.url, self.client_options)
        return self._backend.compute_padded

    def __call__(
        self,
        token_level_rewards: Any,
        response_mask: Any,
        index: Any = None,
        *,
        grpo_norm_by_std: bool = True,
        gamma: float = 1.0,
        lambd: float = 1.0,
        responses: Any = None,
        logprobs: Any = None,
        prompt_keys: Any = None,
        **_settings: Any,
    ) -> tuple[Any, Any]:
        import torch

        if index is None:
            raise SkyRLConfigError(f"{self.name} needs the uids (SkyRL's metadata['uids'])")
        estimator = self.estimator_for(grpo_norm_by_std, gamma, lambd)
        batch = _BATCH.get()
        rows = int(response_mask.shape[0])
        if batch is not None and int(batch["sequences"].shape[0]) == rows:
            responses, logprobs, prompt_keys = _from_batch(
                batch, index, responses, logprobs, prompt_keys, self.history
            )
        if self.token_ids and responses is None:
            raise SkyRLConfigError(
                f"{self.name} needs the response token ids, which SkyRL does not pass to an "
                "estimator: wrap the trainer with advantage_client.integrations.skyrl."
                "patch_trainer(RayPPOTrainer), or pass responses= through "
                "compute_advantages_and_returns"
            )
        if "logprobs" in self.needs and logprobs is None:
            raise SkyRLConfigError(
                f"{self.name} needs log-probs: the batch's 'action_log_probs' (patch_trainer) "
                "or logprobs= through compute_advantages_and_returns"
            )
        if self.history and prompt_keys is None:
            raise SkyRLConfigError(
                f"{self.name} keeps history per prompt and needs a prompt key: patch_trainer "
                "hashes each prompt's tokens, or pass prompt_keys= (one string per row)"
            )
        rewards = token_level_rewards.sum(dim=-1)
        result = self._compute_padded()(
            responses if self.token_ids else None,
            response_mask,
            rewards,
            _names(index),
            estimator=estimator,
            logprobs=logprobs if "logprobs" in self.reads else None,
            ignore_token_ids=self.ignore_token_ids,
            namespace=self.namespace,
            request_id=f"skyrl:{self._request_prefix}:{self.name}:{next(self._calls)}",
            prompt_keys=prompt_keys if self.history else None,
        )
        advantages = result.advantages
        if not isinstance(advantages, torch.Tensor):
            advantages = torch.from_numpy(np.asarray(advantages))
        advantages = advantages.to(
            device=token_level_rewards.device, dtype=token_level_rewards.dtype
        )
        return advantages, advantages


def _from_batch(
    batch: Any, index: Any, responses: Any, logprobs: Any, prompt_keys: Any, history: bool
) -> tuple[Any, Any, Any]:
    """The response token ids, log-probs and prompt keys of SkyRL's ``TrainingInputBatch``
    (prompts left-padded, responses right-padded after them in ``sequences``)."""
    length = int(batch.metadata["response_length"])
    sequences = batch["sequences"]
    if responses is None:
        responses = sequences[:, -length:]
    if logprobs is None:
        logprobs = batch.get(BATCH_INPUTS["logprobs"])
    if prompt_keys is None and history:
        prompt_keys = _prompt_keys(sequences[:, :-length], batch.get("attention_mask"), index)
    return responses, logprobs, prompt_keys


def _names(uids: Any) -> np.ndarray:
    return np.asarray([str(u) for u in (uids.tolist() if hasattr(uids, "tolist") else uids)])


def _prompt_keys(prompts: Any, attention: Any, uids: Any) -> np.ndarray:
    """Per row, the contract's key of its prompt (its left padding removed by the attention
    mask), computed once per uid: SkyRL's uid is the prompt's row in its dataset."""
    names = _names(uids)
    _, first, inverse = np.unique(names, return_index=True, return_inverse=True)
    keys = []
    for row in first.tolist():
        ids = prompts[row].detach().cpu().numpy()
        if attention is not None:
            ids = ids[attention[row, : prompts.shape[1]].detach().cpu().numpy().astype(bool)]
        keys.append(prompt_key(ids))
    return np.asarray(keys, dtype=object)[inverse.reshape(-1)]


@contextmanager
def batch_inputs(data: Any) -> Iterator[None]:
    """Within it, the registered estimators read token ids, log-probs and prompt keys from
    ``data`` (SkyRL's ``TrainingInputBatch``)."""
    token = _BATCH.set(data)
    try:
        yield
    finally:
        _BATCH.reset(token)


def patch_trainer(trainer_cls: Any) -> Any:
    """Wrap ``trainer_cls.compute_advantages_and_returns`` (SkyRL's ``RayPPOTrainer`` or a
    subclass) so that the registered estimators see the batch; patching twice is a no-op."""
    original = trainer_cls.compute_advantages_and_returns
    if getattr(original, "_advantage_service", False):
        return trainer_cls

    @functools.wraps(original)
    def compute_advantages_and_returns(self: Any, data: Any) -> Any:
        with batch_inputs(data):
            return original(self, data)

    compute_advantages_and_returns._advantage_service = True  # type: ignore[attr-defined]
    trainer_cls.compute_advantages_and_returns = compute_advantages_and_returns
    return trainer_cls


def make_estimators(
    chosen: Mapping[str, Any],
    listing: Mapping[str, Any],
    transport: str,
    url: str | None,
    client_options: Mapping[str, Any],
    *,
    skip_unsupported: bool = False,
    **options: Any,
) -> dict[str, SkyRLEstimator]:
    """Each ``{name: estimator}`` checked against ``listing``; with ``skip_unsupported``, those
    needing an input SkyRL cannot give are left out rather than refused."""
    out = {}
    for checked in adapter.checked_each(chosen, listing, PREFIX, SkyRLConfigError):
        missing = sorted(checked.needs - set(BATCH_INPUTS))
        if missing:
            if skip_unsupported:
                continue
            raise SkyRLConfigError(
                f"{checked.name} needs {missing}, which the SkyRL integration cannot take from "
                f"SkyRL's batch (it gives {sorted(BATCH_INPUTS)} and the token ids)"
            )
        out[checked.name] = SkyRLEstimator(checked, transport, url, client_options, **options)
    return out


def register(
    transport: str = "inprocess",
    url: str | None = None,
    presets: Sequence[str] | Mapping[str, Any] | None = None,
    **client_options: Any,
) -> dict[str, SkyRLEstimator]:
    """Register the service's estimators in SkyRL's ``AdvantageEstimatorRegistry`` as
    ``adv_<name>`` (replacing ours of the same name); returns them by name.

    ``transport``: ``inprocess`` (the service library in the trainer's process), ``http`` or
    ``grpc`` to a service at ``url``. ``presets``: preset names or ``{name: estimator}``;
    None: every preset whose inputs SkyRL gives. ``client_options``: ``ignore_token_ids`` and
    ``namespace`` for every call, ``retry_for`` (seconds, default 60), the rest for the client.
    """
    from skyrl_train.utils.ppo_utils import AdvantageEstimatorRegistry

    options = adapter.call_options(client_options)
    if transport != "inprocess":
        client_options.setdefault("retry_for", DEFAULT_RETRY_FOR)
    listing = backend(transport, url, client_options).list_estimators()
    chosen = adapter.chosen_estimators(listing, presets)
    made = make_estimators(
        chosen,
        listing,
        transport,
        url,
        client_options,
        skip_unsupported=presets is None,
        **options,
    )
    for name, fn in made.items():
        if name in AdvantageEstimatorRegistry.list_available():
            AdvantageEstimatorRegistry.unregister(name)
        AdvantageEstimatorRegistry.register(name, fn)
    return made

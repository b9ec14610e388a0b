"""Tunix (google-tunix 0.1.7, JAX): the service's estimators as Tunix advantage estimators.

    from advantage_client.integrations import tunix as adv_tunix

    adv_tunix.register("http", url="http://advantage:8000")
    config = GRPOConfig(advantage_estimator="adv_grpo")       # the stock GRPOLearner
    config = GRPOConfig(advantage_estimator="adv_ktae")       # token-level: the learner below
    learner = adv_tunix.AdvantageGRPOLearner(rl_cluster=..., algo_config=config, reward_fns=...)

Tunix picks an advantage function by name from ``tunix.rl.function_registry`` and calls it
with the rewards (B,) and ``num_generations`` only. :func:`register` adds ``adv_<preset>`` for
every preset: an outcome preset (GRPO, RLOO, ...) needs nothing more and runs under Tunix's own
``GRPOLearner``. A token-level preset (KTAE, OTB, ...) needs the completions:
:class:`AdvantageGRPOLearner`, built with exactly ``GRPOLearner``'s arguments, makes one call
per step with the completion ids and mask, the rewards, the groups (each prompt's
``num_generations`` consecutive rows, as Tunix lays them out), a prompt key per group (from the
prompt's token ids: stable across steps and processes) and the old per-token log-probs when
Tunix has them, and hands the loss (B, T) advantages on the batch's sharding.

What Tunix's GRPO step holds: completion ids and mask, prompt ids, the reference model's
per-token log-probs (``beta != 0``) and the old policy's (``num_iterations > 1``). It computes no
entropy, no sum of squared probabilities and no teacher log-probs: a preset needing one is
refused when the learner is built, naming it. Tunix's agentic GRPO learner calls the same
registry once per group of trajectories, so outcome presets work there through
:func:`register`; token-level presets are for :class:`AdvantageGRPOLearner` only.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Unpack

import jax
import numpy as np
from tunix.rl import function_registry
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo.grpo_learner import GRPOLearner

from advantage_contract.arrays import to_numpy
from advantage_contract.prompt_keys import prompt_key

from . import adapter, backend
from .checks import is_token_level

PREFIX = "adv_"
# What Tunix's GRPO step does not compute, by compute_padded keyword.
NOT_IN_TUNIX = {
    "entropy": "Tunix's GRPO step computes no per-token entropy",
    "sum_pi_squared": "Tunix's GRPO step computes no sum of squared token probabilities",
    "teacher_logprobs": "Tunix's GRPO step has no teacher log-probs",
    "planning_mask": "Tunix's GRPO step has no planning mask",
    "is_weights": "Tunix's GRPO step has no importance weights",
    "returns": "Tunix's GRPO step has no per-token returns",
}


class TunixConfigError(ValueError):
    """A preset Tunix cannot run as configured, named before the first step."""


class TunixEstimator(adapter.RegisteredEstimator):
    """One service estimator behind Tunix's advantage-estimator signature
    ``(rewards (B,), num_generations) -> advantages (B,)``; for a token-level preset, the
    per-token computation :class:`AdvantageGRPOLearner` calls."""

    def __init__(
        self,
        checked: adapter.Checked,
        token_level: bool,
        compute_padded: Callable[..., Any],
        **call: Unpack[adapter.CallOptions],
    ) -> None:
        super().__init__(checked, **call)
        self.token_level = token_level
        self.compute_padded = compute_padded
        # The rewards of the step a learner is computing, per thread: the learner's own state
        # while its step runs (see AdvantageGRPOLearner), never shared between learners' steps.
        self._step = threading.local()
        self.__name__ = f"compute_{self.name}_advantages"

    def check(self, algo_config: Any) -> None:
        """Refuse what Tunix cannot give this estimator under ``algo_config``."""
        for need in sorted(self.needs):
            field = need.split(".", 1)[0]
            if field == "logprobs":
                if int(getattr(algo_config, "num_iterations", 1)) > 1:
                    continue
                reason = "Tunix computes the old per-token log-probs only with num_iterations > 1"
            else:
                reason = NOT_IN_TUNIX.get(field, "Tunix's GRPO step does not have it")
            raise TunixConfigError(f"{self.name} needs {need}, which Tunix cannot give: {reason}")

    def __call__(self, rewards: Any, num_generations: int, **_: Any) -> Any:
        """Tunix's registry call: per-row advantages of an outcome preset."""
        kept = getattr(self._step, "rewards", None)
        if kept is not None:  # (inside AdvantageGRPOLearner's step: it makes the one call)
            kept.append(np.array(to_numpy(rewards, "rewards"), dtype=np.float64))
            return np.zeros(len(kept[-1]), dtype=np.float32)
        if self.token_level or self.needs:
            raise TunixConfigError(
                f"{self.name} is token-level or needs {sorted(self.needs)}: Tunix's registry call "
                "has only the rewards; train with advantage_client.integrations.tunix."
                "AdvantageGRPOLearner"
            )
        values = np.asarray(to_numpy(rewards, "rewards"), dtype=np.float64)
        rows = values.shape[0]
        result = self.compute_padded(
            None,
            np.ones((rows, 1), dtype=bool),
            values,
            np.arange(rows) // int(num_generations),
            estimator=self.given,
            namespace=self.namespace,
        )
        return np.asarray(to_numpy(result.advantages, "advantages"))[:, 0]

    @contextlib.contextmanager
    def deferred(self) -> Iterator[list[np.ndarray]]:
        """While open on this thread, the registry call keeps the rewards (and answers zeros)
        instead of computing: the learner computes once it has the completions."""
        kept: list[np.ndarray] = []
        self._step.rewards = kept
        try:
            yield kept
        finally:
            self._step.rewards = None

    def per_token(self, example: Any, rewards: np.ndarray, num_generations: int) -> Any:
        """(B, T) advantages of a Tunix ``TrainExample`` (one call), on its sharding."""
        ids = to_numpy(example.completion_ids, "completion_ids")
        mask = to_numpy(example.completion_mask, "completion_mask").astype(bool)
        rows = ids.shape[0]
        options: dict[str, Any] = {}
        if "logprobs" in self.reads and example.old_per_token_logps is not None:
            options["logprobs"] = example.old_per_token_logps
        if self.history:
            prompts = to_numpy(example.prompt_ids, "prompt_ids")
            real = to_numpy(example.prompt_mask, "prompt_mask").astype(bool)
            options["prompt_keys"] = np.array(
                [prompt_key(prompts[i][real[i]]) for i in range(rows)], dtype=object
            )
        result = self.compute_padded(
            ids,
            mask,
            rewards,
            np.arange(rows) // int(num_generations),
            estimator=self.given,
            namespace=self.namespace,
            ignore_token_ids=self.ignore_token_ids,
            **options,
        )
        advantages = np.asarray(to_numpy(result.advantages, "advantages"), dtype=np.float32)
        sharding = getattr(example.completion_ids, "sharding", None)
        return jax.device_put(advantages, sharding)


def make_estimators(
    chosen: Mapping[str, Any],
    listing: Mapping[str, Any],
    compute_padded: Callable[..., Any],
    **options: Any,
) -> dict[str, TunixEstimator]:
    """Each ``{name: estimator}`` checked against the service's ``listing``."""
    return {
        checked.name: TunixEstimator(
            checked, is_token_level(listing, checked.full), compute_padded, **options
        )
        for checked in adapter.checked_each(chosen, listing, PREFIX, TunixConfigError)
    }


def register(
    transport: str = "inprocess",
    url: str | None = None,
    presets: Sequence[str] | Mapping[str, Any] | None = None,
    **client_options: Any,
) -> dict[str, TunixEstimator]:
    """Add the service's estimators to Tunix's advantage-estimator registry as
    ``adv_<name>``; returns them by name (Tunix's registry holds them: nothing is kept here).

    ``transport``: ``inprocess`` (the service library in this process), ``http`` (Arrow) or
    ``grpc`` to a service at ``url``. ``presets``: preset names (default: every preset the
    service has) or ``{name: estimator object}``, each checked against the service's listing.
    ``client_options``: ``namespace`` and ``ignore_token_ids`` for every call, the rest for the
    client (``timeout``, ``token``, ...). Registering a name again replaces it.
    """
    options = adapter.call_options(client_options)
    chosen_backend = backend(transport, url, client_options)
    listing = chosen_backend.list_estimators()
    chosen = adapter.chosen_estimators(listing, presets)
    made = make_estimators(chosen, listing, chosen_backend.compute_padded, **options)
    for name, fn in made.items():
        function_registry.register_advantage_estimator(name)(fn)
    return made


class AdvantageGRPOLearner(GRPOLearner):
    """Tunix's ``GRPOLearner`` computing its advantages with a registered ``adv_<name>``
    estimator, token-level ones included: one call per step with the completions. Built with
    exactly ``GRPOLearner``'s arguments; refuses, here, an estimator needing an input Tunix
    does not compute (or one :func:`register` did not add)."""

    def __init__(
        self,
        rl_cluster: Any,
        algo_config: Any,
        reward_fns: Any,
        metric_fns: Any = None,
        data_shuffle_seed: int | None = None,
    ) -> None:
        name = algo_config.advantage_estimator
        try:
            estimator = function_registry.get_advantage_estimator(name)
        except LookupError:
            estimator = None
        if not isinstance(estimator, TunixEstimator):
            raise TunixConfigError(
                f"advantage_estimator {name!r} is not one of the service's: call "
                "advantage_client.integrations.tunix.register() first and name an adv_<preset>"
            )
        estimator.check(algo_config)
        self.advantage_estimator = estimator
        super().__init__(
            rl_cluster=rl_cluster,
            algo_config=algo_config,
            reward_fns=reward_fns,
            metric_fns=metric_fns,
            data_shuffle_seed=data_shuffle_seed,
        )

    def _generate_and_compute_advantage(
        self, training_input: Any, mode: Any = rl_cluster_lib.Mode.TRAIN
    ) -> Any:
        estimator = self.advantage_estimator
        if not estimator.token_level:
            return super()._generate_and_compute_advantage(training_input, mode)
        # Tunix's step as it is (generation, log-probs, rewards, metrics); its registry call
        # keeps the rewards, and the advantages come from one call with the completions.
        # (metric_fns see per-row zeros as the advantages of a token-level preset.)
        with estimator.deferred() as kept:
            example = super()._generate_and_compute_advantage(training_input, mode)
        if len(kept) != 1:
            raise RuntimeError(f"expected one advantage call in Tunix's step, saw {len(kept)}")
        advantages = estimator.per_token(example, kept[0], self.algo_config.num_generations)
        return example.replace(advantages=advantages)

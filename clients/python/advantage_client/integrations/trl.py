"""TRL (1.x): a ``GRPOTrainer`` that trains on the service's per-token advantages.

::

    from advantage_client.integrations.trl import AdvantageGRPOTrainer

    trainer = AdvantageGRPOTrainer(
        model=model, reward_funcs=reward, args=GRPOConfig(...), train_dataset=dataset,
        advantage_estimator="ktae",                 # any preset or estimator object
        advantage_transport="http", advantage_url="http://advantage:8000",
    )
    trainer.train()

TRL computes GRPO's scalar advantages inside ``_generate_and_score_completions``; this subclass
lets it, then replaces them with the service's (B, T) advantages for the same batch: the
completion ids and mask (times the tool mask, when TRL has one), the rewards TRL's
``_calculate_rewards`` returned (weighted and summed as TRL does), and the prompt grouping (each
prompt's ``num_generations`` completions are consecutive rows). TRL's loss accepts (B, T)
advantages from subclasses. Rewards are gathered across processes, so the call covers the whole
generation batch (completion ids and masks are gathered, padded to one width) and each process
keeps its own rows. A completion every reward function scored None has no reward: it is sent
with reward 0 and its advantages are zeroed, as TRL zeroes its. Estimators that need log-probs,
entropies or teachers are not wired here (TRL has not computed them at this point with its
defaults); outcome baselines and KTAE need only the ids.
"""

from __future__ import annotations

from typing import Any

import torch
from trl import GRPOTrainer

from . import backend


class AdvantageGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` with the advantages from advantage-service.

    ``advantage_estimator``: a preset name or estimator object; ``advantage_transport``:
    ``inprocess``, ``http`` or ``grpc`` (then ``advantage_url``); ``advantage_options``:
    ``ignore_token_ids`` and ``namespace`` for every call, the rest for the client. The
    advantages of the latest generation batch are kept in :attr:`last_advantages`.
    """

    def __init__(
        self,
        *args: Any,
        advantage_estimator: Any = "grpo",
        advantage_transport: str = "inprocess",
        advantage_url: str | None = None,
        advantage_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        options = dict(advantage_options or {})
        self.advantage_estimator = advantage_estimator
        self._call_options = {
            "ignore_token_ids": options.pop("ignore_token_ids", None),
            "namespace": options.pop("namespace", None),
        }
        self._compute_padded, _, self.advantage_client = backend(
            advantage_transport, advantage_url, options
        )
        self._rewards_per_func: torch.Tensor | None = None
        self.last_advantages: torch.Tensor | None = None

    def _calculate_rewards(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        rewards_per_func: torch.Tensor = super()._calculate_rewards(*args, **kwargs)
        self._rewards_per_func = rewards_per_func  # gathered across processes
        return rewards_per_func

    def _gathered(self, values: torch.Tensor, pad: int) -> torch.Tensor:
        acc = self.accelerator
        if acc.num_processes == 1:
            return values
        return acc.gather(acc.pad_across_processes(values, dim=1, pad_index=pad))

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        output: dict[str, Any] = super()._generate_and_score_completions(inputs)
        rewards_per_func = self._rewards_per_func
        assert rewards_per_func is not None
        device = self.accelerator.device
        training = bool(getattr(self.model, "training", True))
        generations = (self.num_generations if training else self.num_generations_eval) or 1
        weights = self.reward_weights.to(rewards_per_func.device).unsqueeze(0)
        rewards = (rewards_per_func * weights).nansum(dim=1)
        unscorable = torch.isnan(rewards_per_func).all(dim=1)
        rewards = rewards.masked_fill(unscorable, 0.0)

        ids = output["completion_ids"]
        mask = output["completion_mask"]
        if output.get("tool_mask") is not None:
            mask = mask * output["tool_mask"]
        local = ids.shape[0]
        all_ids = self._gathered(ids, 0)
        all_mask = self._gathered(mask, 0).bool()
        groups = torch.arange(all_ids.shape[0]) // generations
        result = self._compute_padded(
            all_ids,
            all_mask,
            rewards,
            groups.numpy(),
            estimator=self.advantage_estimator,
            **self._call_options,
        )
        advantages = torch.as_tensor(result.advantages, device=device)
        advantages = advantages.masked_fill(unscorable.to(device).unsqueeze(1), 0.0)
        start = self.accelerator.process_index * local
        advantages = advantages[start : start + local, : ids.shape[1]]
        output["advantages"] = advantages
        self.last_advantages = advantages
        return output

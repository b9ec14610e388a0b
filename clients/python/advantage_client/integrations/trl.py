"""TRL (1.16): a ``GRPOTrainer`` that trains on the service's per-token advantages.

::

    from advantage_client.integrations.trl import AdvantageGRPOTrainer

    trainer = AdvantageGRPOTrainer(
        model=model, reward_funcs=reward, args=GRPOConfig(...), train_dataset=dataset,
        advantage_estimator={"outcome": "grpo", "ktae": {"history": "prompt"}},
        advantage_url="http://advantage:8000",       # HTTP; "inprocess" needs the service package
    )
    trainer.train()

TRL computes GRPO's scalar advantages inside ``_generate_and_score_completions``; this subclass
lets it, then replaces them with the service's (B, T) advantages for the same batch, which TRL's
loss accepts from subclasses. What it sends and why:

- the completion ids and mask (times the tool mask when TRL has one) and TRL's rewards (weighted
  and summed as TRL does); each prompt's ``num_generations`` completions form a group;
- a **prompt key** per group, so that history (KTAE's ``history: "prompt"``) means "earlier
  visits of this prompt": TRL's group ids are positions in the batch (``arange //
  num_generations``), another prompt every step. The key is the contract's key of the prompt's
  token ids (:mod:`advantage_contract.prompt_keys`, the one verl's integration sends too), or
  the value of a dataset column (``advantage_prompt_key="id"``);
- one call per generation batch for the whole batch: with several processes, rank 0 calls and
  broadcasts the advantages (every rank trains on the same numbers, each rollout is counted
  once), with a request id per call so that a retried call is never counted twice. The call
  holds every rank's rows, so ``scale_rewards="batch"`` (``grpo``'s ``std_scope: "request"``)
  divides by the std of the batch TRL gathers and scales over;
- rows every reward function scored ``None`` are left out of the call (so out of their group's
  baseline) and given advantage 0, as TRL does;
- with ``multi_objective_aggregation="normalize_then_sum"`` (the ``gdpo`` outcome, TRL's
  normalisation: ``advantage_estimator="gdpo"``), each reward function's rewards as a reward
  component under its name (None: missing) and TRL's ``reward_weights`` as the outcome's
  ``weights``;
- the per-token inputs an estimator reads: TRL's old log-probs when it computed them, else (and
  for entropies and ``sum_pi_squared``, which TRL never computes before the advantages) one
  extra forward pass of the policy when ``advantage_extra_forward=True``; teacher log-probs from
  ``advantage_teacher_logprobs``.

The estimator, its parameters and the inputs it needs are checked against the service's listing
(``GET /v1/estimators``, or the registry in-process) when the trainer is built, with TRL's
``scale_rewards`` and ``multi_objective_aggregation``.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from trl import GRPOTrainer

from advantage_contract import prompt_keys
from advantage_contract.errors import AdvantageError

from . import adapter, backend, checks, fallback, trl_config

log = logging.getLogger(__name__)

TRANSPORTS = ("inprocess", "http", "grpc")
# Codes after which the service could not answer at all (the client's retries spent): only then
# may the opt-in local fallback step in; a request the service refused is never papered over.
UNREACHABLE = frozenset(("unavailable", "timeout", "overloaded", "saturated"))
HISTORY_OUTCOMES = ("applied", "empty", "partial", "unavailable")
TeacherHook = Callable[[list[dict[str, Any]], torch.Tensor, torch.Tensor], Mapping[str, Any]]


# The key of a prompt for history (the same ids, the same key, in every process, run and
# trainer integration): the contract's.
prompt_key = prompt_keys.prompt_key


class AdvantageGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` with the advantages from advantage-service.

    - ``advantage_estimator``: a preset name or an estimator object (history on:
      ``{"outcome": "grpo", "ktae": {"history": "prompt"}}``).
    - ``advantage_transport``: ``http``, ``grpc`` (then ``advantage_url``) or ``inprocess`` (the
      service library in this process: ``pip install advantage-service``, no history). None
      (default): ``http`` when ``advantage_url`` is given, else ``inprocess``.
    - ``advantage_options``: ``ignore_token_ids``, ``namespace`` and ``request_id`` (a prefix:
      each call's id is ``<prefix>:<mode>:<step>:<n>``) for every call; ``prompt_key_scheme``
      (``"trl-0.1"``: the keys of client 0.1, for a run whose history started before the
      contract's key); the rest for the client (``timeout``, ``token``, ``retry_for``, ...).
    - ``advantage_prompt_key``: a dataset column naming each row's prompt for history (None: a
      hash of the prompt's token ids).
    - ``advantage_extra_forward``: one forward pass of the policy (no gradient) per generation
      batch for the log-probs, entropies and ``sum_pi_squared`` an estimator reads (OTB,
      forking tokens, OPSD) when TRL has not computed them.
    - ``advantage_teacher_logprobs``: teacher log-probs for CSCR and OPSD: a callable
      ``(inputs, completion_ids, completion_mask) -> {condition: (B, T)}`` (the rows of the
      dataset, the local completions), or ``{condition: column}``: the dataset column holding the
      teacher's prompt for that condition, under which the policy scores each completion.
    - ``advantage_fallback``: ``"local"`` computes an outcome-only estimator (``grpo``,
      ``dr_grpo``, ``rloo``, ``reinforce``) here when the service stays unreachable past the
      client's retries, logged as ``advantage_service/fallback``; None (default): the error.

    After each generation batch: :attr:`last_advantages` (this process's rows),
    :attr:`last_all_advantages` (the whole batch) and :attr:`advantage_calls` (one record per
    call: request id, history outcome, milliseconds, whether the fallback answered, the client's
    retries), the retries also as the metric ``advantage_service/retries``.
    """

    def __init__(
        self,
        *args: Any,
        advantage_estimator: Any = "grpo",
        advantage_transport: str | None = None,
        advantage_url: str | None = None,
        advantage_options: dict[str, Any] | None = None,
        advantage_prompt_key: str | None = None,
        advantage_extra_forward: bool = False,
        advantage_teacher_logprobs: TeacherHook | Mapping[str, str] | None = None,
        advantage_fallback: str | None = None,
        **kwargs: Any,
    ) -> None:
        transport = advantage_transport or ("http" if advantage_url else "inprocess")
        if transport not in TRANSPORTS:
            raise ValueError(f"advantage_transport must be one of {TRANSPORTS}, got {transport!r}")
        if advantage_fallback not in (None, "local"):
            raise ValueError(
                f"advantage_fallback must be None or 'local', got {advantage_fallback!r}"
            )
        options = dict(advantage_options or {})
        self._call_options = adapter.call_options(options)
        self._key_of = prompt_keys.key_function(options.pop("prompt_key_scheme", None))
        prefix = options.pop("request_id", None)
        self._request_prefix = str(prefix) if prefix is not None else uuid.uuid4().hex
        self.advantage_transport = transport
        try:
            self.advantage_backend = backend(transport, advantage_url, options)
        except ModuleNotFoundError as exc:
            raise ModuleNotFoundError(
                f"advantage_transport='inprocess': {exc}; to call a running service instead, "
                "pass advantage_url='http://host:8000'"
            ) from exc
        self._compute_padded: Any = self.advantage_backend.compute_padded

        # Everything about the estimator that can fail is checked here, before the model loads.
        self._fallback = advantage_fallback
        try:
            self._listing: dict[str, Any] | None = self.advantage_backend.list_estimators()
        except AdvantageError as exc:
            if advantage_fallback is None or exc.code not in UNREACHABLE:
                raise
            log.warning("advantage service unreachable at start (%s): checked locally only", exc)
            self._listing = None
        resolved = self._resolve(advantage_estimator)
        scale = trl_config.config_value(args, kwargs, "scale_rewards", "group")
        aggregation = trl_config.config_value(
            args, kwargs, "multi_objective_aggregation", "sum_then_normalize"
        )
        self.advantage_estimator, self._resolved = self._with_trl_settings(
            advantage_estimator, resolved, scale, aggregation
        )
        batch_scaled = self._resolved["outcome"].get("std_scope") == "request"
        if batch_scaled and self._listing is not None:
            try:  # (a service from before std_scope refuses it: say so now, not at step 1)
                checks.resolve(self._listing, self.advantage_estimator)
            except Exception as exc:
                raise ValueError(
                    f"scale_rewards='batch' needs the service's grpo std_scope 'request': {exc}"
                ) from exc
        if advantage_fallback is not None and batch_scaled:
            raise ValueError(
                "advantage_fallback='local' divides by each group's std only: it cannot stand "
                "in for scale_rewards='batch' (std_scope 'request'); drop one of them"
            )
        if advantage_fallback is not None and (why := fallback.unsupported(self._resolved)):
            raise ValueError(
                f"advantage_fallback='local' cannot stand in for this estimator: {why}"
            )
        self._prompt_key_column = advantage_prompt_key
        self._extra_forward = advantage_extra_forward
        self._teacher = advantage_teacher_logprobs

        super().__init__(*args, **kwargs)

        # normalize_then_sum (gdpo): each reward function's rewards sent under its name,
        # weighted by TRL's reward_weights
        self._gdpo = self._resolved["outcome"].get("name") == "gdpo"
        if self._gdpo:
            weights = trl_config.reward_components_weights(
                self.reward_func_names, self.reward_weights.tolist(), advantage_estimator
            )
            outcome = {**self._resolved["outcome"], "weights": weights}
            self._resolved = {**self._resolved, "outcome": outcome}
            self.advantage_estimator = self._resolved
        self._needed = (
            checks.required_inputs(self._listing, self._resolved) if self._listing else set()
        )
        # (required or optional: an optional input TRL has is sent, e.g. OTB's is_weights)
        self._reads = checks.inputs_read(self._listing, self._resolved) if self._listing else set()
        self._check_inputs()
        self._rewards_per_func: torch.Tensor | None = None
        self._calls_at: dict[tuple[str, int], int] = {}
        self.last_advantages: torch.Tensor | None = None
        self.last_all_advantages: torch.Tensor | None = None
        self.advantage_calls: list[dict[str, Any]] = []

    # ---- construction-time checks ----------------------------------------------------------

    def _resolve(self, estimator: Any) -> dict[str, Any]:
        if self._listing is None:  # (the fallback's own names only)
            name = estimator if isinstance(estimator, str) else None
            if name not in fallback.OUTCOMES:
                raise ValueError(
                    f"the service is unreachable and {estimator!r} is not an outcome the local "
                    f"fallback computes ({list(fallback.OUTCOMES)})"
                )
            return {"outcome": {"name": name}, "whiten": False, "clip": None}
        try:
            resolved = checks.resolve(self._listing, estimator)
        except Exception as exc:  # the listing's check
            raise ValueError(f"advantage_estimator {estimator!r}: {exc}") from exc
        return resolved

    # (TRL's scale_rewards and multi_objective_aggregation: :mod:`.trl_config`)
    _with_trl_settings = staticmethod(trl_config.with_trl_settings)

    def _trl_has_logprobs(self) -> bool:
        """Whether TRL computes ``old_per_token_logps`` before the advantages (its own rule)."""
        config: Any = self.args  # (a GRPOConfig)
        generate_every = config.steps_per_generation * self.num_iterations
        return bool(
            config.gradient_accumulation_steps % generate_every != 0
            or (self.use_vllm and self.vllm_importance_sampling_correction)
        )

    def _check_inputs(self) -> None:
        """Every input the estimator needs has a source, or the trainer is not built."""
        missing = []
        for name in sorted(self._needed):
            if name == "logprobs" and (self._trl_has_logprobs() or self._extra_forward):
                continue
            if name in ("entropy", "sum_pi_squared") and self._extra_forward:
                continue
            if name.startswith("teacher_logprobs."):
                condition = name.split(".", 1)[1]
                if callable(self._teacher):
                    continue
                if isinstance(self._teacher, Mapping) and condition in self._teacher:
                    continue
            missing.append(name)
        if not missing:
            return
        hints = []
        if {"logprobs", "entropy", "sum_pi_squared"} & set(missing):
            hints.append(
                "advantage_extra_forward=True computes log-probs, entropies and sum_pi_squared "
                "with one extra forward pass of the policy per generation batch"
            )
        if any(m.startswith("teacher_logprobs.") for m in missing):
            hints.append(
                "advantage_teacher_logprobs gives teacher log-probs (a callable, or "
                "{condition: dataset column of the teacher's prompt})"
            )
        raise ValueError(
            f"advantage_estimator needs {missing}, which TRL does not compute here: "
            + "; ".join(hints)
        )

    # ---- per generation batch --------------------------------------------------------------

    def _calculate_rewards(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        rewards_per_func: torch.Tensor = super()._calculate_rewards(*args, **kwargs)
        self._rewards_per_func = rewards_per_func  # gathered across processes
        return rewards_per_func

    def _gathered(self, values: torch.Tensor, pad: float | int) -> torch.Tensor:
        acc = self.accelerator
        if acc.num_processes == 1:
            return values
        return acc.gather(acc.pad_across_processes(values, dim=1, pad_index=pad))

    def _gathered_list(self, values: list[Any]) -> list[Any]:
        if self.accelerator.num_processes == 1:
            return values
        from accelerate.utils import gather_object

        return list(gather_object(values))

    def _prompt_keys(self, inputs: list[dict[str, Any]], output: Mapping[str, Any]) -> list[str]:
        column = self._prompt_key_column
        if column is not None:
            keys = []
            for i, row in enumerate(inputs):
                if row.get(column) is None:
                    raise ValueError(
                        f"advantage_prompt_key={column!r}: row {i} of the batch has no {column!r}"
                    )
                keys.append(str(row[column]))
            return keys
        ids = output["prompt_ids"].cpu().numpy()
        mask = output["prompt_mask"].cpu().numpy().astype(bool)
        return [self._key_of(row[m]) for row, m in zip(ids, mask, strict=True)]

    def _policy_forward(
        self,
        ids: torch.Tensor,
        attention: torch.Tensor,
        completion_ids: torch.Tensor,
        want: set[str],
    ) -> dict[str, torch.Tensor]:
        """Per completion token, from one forward pass of the policy without gradient, at TRL's
        sampling temperature: ``logprobs`` of the sampled token, the ``entropy`` and
        ``sum_pi_squared`` (sum of the squared probabilities) of the distribution."""
        width = completion_ids.shape[1]
        model: Any = self.model
        batch = self.args.per_device_train_batch_size if model.training else None
        batch = batch or self.args.per_device_eval_batch_size or ids.shape[0]
        parts: dict[str, list[torch.Tensor]] = {name: [] for name in want}
        with torch.no_grad():
            for start in range(0, ids.shape[0], batch):
                end = start + batch
                logits = model(input_ids=ids[start:end], attention_mask=attention[start:end]).logits
                # (position t's logits predict token t + 1)
                logits = logits[:, -width - 1 : -1].float() / self.temperature
                logp = torch.log_softmax(logits, dim=-1)
                if "logprobs" in want:
                    index = completion_ids[start:end].unsqueeze(-1)
                    parts["logprobs"].append(logp.gather(-1, index).squeeze(-1))
                if "entropy" in want or "sum_pi_squared" in want:
                    p = logp.exp()
                    if "entropy" in want:
                        parts["entropy"].append(-(p * logp).sum(-1))
                    if "sum_pi_squared" in want:
                        parts["sum_pi_squared"].append((p * p).sum(-1))
        return {name: torch.cat(values) for name, values in parts.items()}

    def _teacher_logprobs(
        self, inputs: list[dict[str, Any]], output: Mapping[str, Any], conditions: set[str]
    ) -> dict[str, torch.Tensor]:
        completion_ids, completion_mask = output["completion_ids"], output["completion_mask"]
        if callable(self._teacher):
            given = self._teacher(inputs, completion_ids, completion_mask)
            return {
                str(c): torch.as_tensor(v, device=completion_ids.device).float()
                for c, v in given.items()
            }
        assert isinstance(self._teacher, Mapping)
        from trl.trainer.utils import pad

        out = {}
        pad_id = getattr(self.processing_class, "pad_token_id", None) or 0
        for condition in sorted(conditions):
            column = self._teacher[condition]
            prompts = [row[column] for row in inputs]
            prompt_ids, _, _ = self._tokenize_prompts(prompts)
            ids = pad(
                [torch.tensor(p) for p in prompt_ids],
                padding_value=pad_id,
                padding_side="left",
            )
            mask = pad(
                [torch.ones(len(p), dtype=torch.long) for p in prompt_ids],
                padding_value=0,
                padding_side="left",
            )
            ids, mask = ids.to(completion_ids.device), mask.to(completion_ids.device)
            full = torch.cat([ids, completion_ids], dim=1)
            attention = torch.cat([mask, completion_mask], dim=1)
            out[condition] = self._policy_forward(full, attention, completion_ids, {"logprobs"})[
                "logprobs"
            ]
        return out

    def _per_token_inputs(
        self, inputs: list[dict[str, Any]], output: Mapping[str, Any]
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(this process's per-token inputs by keyword, its teacher log-probs by condition):
        only those the estimator needs."""
        per_token: dict[str, torch.Tensor] = {}
        want = {n for n in self._reads if n in ("logprobs", "entropy", "sum_pi_squared")}
        if "logprobs" in want and output.get("old_per_token_logps") is not None:
            per_token["logprobs"] = output["old_per_token_logps"]
            want.discard("logprobs")
        if not self._extra_forward:  # (an optional input costs a forward pass: opted into)
            want &= self._needed
        if want:
            ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
            attention = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
            per_token.update(self._policy_forward(ids, attention, output["completion_ids"], want))
        ratio = output.get("importance_sampling_ratio")
        if "is_weights" in self._reads and ratio is not None:
            # TRL's vLLM importance-sampling correction (pi_old / pi_rollout, truncated or
            # masked as configured): (B, T) per token, (B, 1) per sequence.
            per_token["is_weights"] = ratio.expand_as(output["completion_mask"]).float()
        conditions = {n.split(".", 1)[1] for n in self._needed if n.startswith("teacher_logprobs.")}
        teachers = self._teacher_logprobs(inputs, output, conditions) if conditions else {}
        return per_token, teachers

    def _request_id(self, mode: str) -> str:
        step = int(self.state.global_step)
        n = self._calls_at.get((mode, step), 0)
        self._calls_at[(mode, step)] = n + 1
        return f"{self._request_prefix}:{mode}:{step}:{n}"

    def _call_service(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        rewards: torch.Tensor,
        groups: np.ndarray,
        keys: list[str],
        per_token: Mapping[str, torch.Tensor],
        teachers: Mapping[str, torch.Tensor],
        request_id: str,
        components: Mapping[str, torch.Tensor] | None = None,
    ) -> tuple[np.ndarray, dict[str, Any]]:
        """(advantages (B, T) float32, the call's record), on the process that calls."""
        scored = ~torch.isnan(rewards)
        keep = scored.cpu().numpy()
        advantages = np.zeros(tuple(mask.shape), dtype=np.float32)
        record: dict[str, Any] = {
            "request_id": request_id,
            "rows": int(keep.sum()),
            "history": "none",
            "ms": 0.0,
            "fallback": False,
            "retries": 0,
        }
        if not keep.any():
            return advantages, record
        rows = torch.as_tensor(keep, device=mask.device)
        sent_keys = [k for k, kept in zip(keys, keep, strict=True) if kept]
        start = time.perf_counter()
        stats = getattr(self.advantage_backend, "retry_stats", None)  # (none in-process)
        retries_before = stats.retries if stats is not None else 0
        try:
            result = self._compute_padded(
                ids[rows],
                mask[rows],
                rewards[rows],
                groups[keep],
                estimator=self.advantage_estimator,
                prompt_keys=np.asarray(sent_keys, dtype=object),
                teacher_logprobs={c: v[rows] for c, v in teachers.items()} or None,
                request_id=request_id,
                **(
                    {"reward_components": {k: v[rows] for k, v in components.items()}}
                    if components
                    else {}
                ),
                **{name: values[rows] for name, values in per_token.items()},
                **self._call_options,
            )
            values = result.advantages
            values = values.detach().cpu().numpy() if isinstance(values, torch.Tensor) else values
            advantages[keep] = np.asarray(values, dtype=np.float32)
            record["history"] = str(result.summary.get("history", "none"))
        except AdvantageError as exc:
            if self._fallback is None or exc.code not in UNREACHABLE:
                raise
            log.warning(
                "advantage service unreachable (%s): local %s", exc, self._resolved["outcome"]
            )
            group_index = np.unique(groups[keep], return_inverse=True)[1]
            scalars = fallback.outcome_scalars(
                self._resolved, rewards[rows].double().cpu().numpy(), group_index
            )
            local_mask = mask[rows].cpu().numpy().astype(bool)
            advantages[keep] = np.where(local_mask, scalars[:, None], 0.0).astype(np.float32)
            record["fallback"] = True
        record["ms"] = (time.perf_counter() - start) * 1000.0
        record["retries"] = (stats.retries if stats is not None else 0) - retries_before
        return advantages, record

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        output: dict[str, Any] = super()._generate_and_score_completions(inputs)
        rewards_per_func = self._rewards_per_func
        assert rewards_per_func is not None
        acc = self.accelerator
        device = acc.device
        model: Any = self.model
        mode = "train" if model.training else "eval"
        generations = (self.num_generations if mode == "train" else self.num_generations_eval) or 1
        weights = self.reward_weights.to(rewards_per_func.device).unsqueeze(0)
        rewards = (rewards_per_func * weights).nansum(dim=1)
        # No reward at all: left out of the group's baseline (NaN here), advantage 0, as TRL.
        rewards = rewards.masked_fill(torch.isnan(rewards_per_func).all(dim=1), float("nan"))

        ids = output["completion_ids"]
        mask = output["completion_mask"]
        if output.get("tool_mask") is not None:
            mask = mask * output["tool_mask"]
        local = ids.shape[0]
        keys = self._gathered_list(self._prompt_keys(inputs, output))
        per_token, teachers = self._per_token_inputs(inputs, output)
        all_ids = self._gathered(ids, 0)
        all_mask = self._gathered(mask, 0).bool()
        all_inputs = {name: self._gathered(v.float(), 0.0) for name, v in per_token.items()}
        all_teachers = {name: self._gathered(v.float(), 0.0) for name, v in teachers.items()}
        groups = (np.arange(all_ids.shape[0]) // generations).astype(np.int64)
        # (gdpo: each function's own rewards, None as NaN: left out of its statistics)
        components = (
            {name: rewards_per_func[:, i] for i, name in enumerate(self.reward_func_names)}
            if self._gdpo
            else None
        )

        # One call for the whole batch, from rank 0; the others receive its answer, or the
        # text of its error (every rank must reach the broadcast, or the others hang in it).
        payload: list[Any] = [None]
        error: Exception | None = None
        if acc.is_main_process:
            try:
                payload[0] = self._call_service(
                    all_ids,
                    all_mask,
                    rewards,
                    groups,
                    keys,
                    all_inputs,
                    all_teachers,
                    self._request_id(mode),
                    components,
                )
            except Exception as exc:
                error = exc
                payload[0] = f"{type(exc).__name__}: {exc}"
        if acc.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            broadcast_object_list(payload, from_process=0)
        if error is not None:
            raise error
        if isinstance(payload[0], str):
            raise RuntimeError(f"the advantage call on rank 0 failed: {payload[0]}")
        all_advantages_np, record = payload[0]
        all_advantages = torch.as_tensor(all_advantages_np, device=device)

        start = acc.process_index * local
        advantages = all_advantages[start : start + local, : ids.shape[1]]
        output["advantages"] = advantages
        self.last_advantages = advantages
        self.last_all_advantages = all_advantages
        self.advantage_calls.append(record)
        self._log_advantages(mode, all_advantages, all_mask, record)
        return output

    def _log_advantages(
        self, mode: str, advantages: torch.Tensor, mask: torch.Tensor, record: Mapping[str, Any]
    ) -> None:
        """The completions table shows the advantages trained on (each completion's mean over
        its tokens, the one value of an outcome-only estimator); the service's call time,
        history outcome and fallback go to the metrics (every report_to backend)."""
        count = mask.sum(dim=1).clamp(min=1)
        per_row = ((advantages * mask).sum(dim=1) / count).tolist()
        table: Any = self._logs["advantages"]  # (a deque of the generation batch's rows)
        for _ in range(min(len(per_row), len(table))):
            table.pop()
        table.extend(per_row)
        metrics = self._metrics[mode]
        metrics["advantage_service/call_ms"].append(float(record["ms"]))
        for outcome in HISTORY_OUTCOMES:
            metrics[f"advantage_service/history_{outcome}"].append(
                float(record["history"] == outcome)
            )
        metrics["advantage_service/fallback"].append(float(record["fallback"]))
        metrics["advantage_service/retries"].append(float(record["retries"]))
        values = advantages[mask]
        if values.numel():
            metrics["advantage_service/token_advantage_mean"].append(float(values.mean()))
            metrics["advantage_service/token_advantage_abs_mean"].append(float(values.abs().mean()))

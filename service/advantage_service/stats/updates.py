"""What a request writes: its history update and its vocabulary statistics increments, built
from the computed result (vectorised over the batch). Semantics in :mod:`.base`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..batch import RolloutBatch
from ..estimators import AdvantageResult
from ..estimators.baselines import group_sum
from ..estimators.cscr import sensitivity
from ..estimators.ktae import KeyTokenTables
from ..request import ComputeRequest
from .blobs import INT32_MAX, PromptHistory, TokenStatsUpdate, merge_history
from .prior import TOKEN_BITS, HistoryPrior, prompt_ids, wants_history


@dataclass
class HistoryUpdate:
    """New stored history H' = d (H + current) of the batch's prompts: ``prompts[g]`` is what
    ``prompt_ids[g]`` stores (rows merged over the union of token ids and pruned)."""

    prompt_ids: list[str]
    prompts: list[PromptHistory]


@dataclass
class StatsUpdate:
    """Everything one request writes: history (None: nothing to write) and token statistics."""

    history: HistoryUpdate | None
    tokens: TokenStatsUpdate


def _empty_tables(device: torch.device) -> KeyTokenTables:
    """The tables of a batch without tokens (KTAE returns none then)."""
    i, f = (torch.zeros(0, dtype=d, device=device) for d in (torch.int64, torch.float64))
    return KeyTokenTables(i, i, f, f, f, f, i, i, None, 0)


def _history_update(
    batch: RolloutBatch,
    tables: KeyTokenTables,
    prior: HistoryPrior,
    params: dict[str, Any],
) -> HistoryUpdate:
    g_count = batch.num_groups
    decay = float(params["history_decay"])
    correct = (batch.rewards > params["correct_threshold"]).double()
    lengths = batch.lengths.double()
    n_c = group_sum(batch, correct)
    len_c = group_sum(batch, lengths * correct)
    len_all = group_sum(batch, lengths)
    totals = torch.stack([n_c, batch.group_sizes.double() - n_c, len_c, len_all - len_c], dim=1)

    # The tables hold this request's own counts, one row per (group, token id).
    keys = (tables.group << TOKEN_BITS) | tables.token
    current = torch.stack([tables.a, tables.b, tables.occ_c, tables.occ_w], dim=1).double()
    if keys.numel() > 1 and not bool((keys[1:] > keys[:-1]).all()):
        keys, order = torch.sort(keys)
        current = current[order]
    keys_np, current_np = keys.cpu().numpy(), current.cpu().numpy()
    bounds = np.searchsorted(keys_np >> TOKEN_BITS, np.arange(g_count + 1)).tolist()
    totals_np = totals.cpu().numpy()
    stored = prior.stored
    token_mask = (1 << TOKEN_BITS) - 1
    prompts = [
        merge_history(
            stored[g],
            totals_np[g],
            keys_np[bounds[g] : bounds[g + 1]] & token_mask,
            current_np[bounds[g] : bounds[g + 1]],
            decay,
        )
        for g in range(g_count)
    ]
    return HistoryUpdate(prompt_ids=prompt_ids(batch), prompts=prompts)


def _distinct(keys: torch.Tensor) -> torch.Tensor:
    """The distinct values of int64 ``keys`` >= 0, ascending, int64.

    On the CPU numpy's sort of int32 is several times torch's (``torch.unique`` sorts too), so
    keys that fit in int32 are sorted there and deduplicated by comparing neighbours."""
    if keys.device.type != "cpu" or keys.numel() == 0 or int(keys.max()) > INT32_MAX:
        return torch.unique(keys)
    ordered = np.sort(keys.numpy().astype(np.int32))
    first = np.ones(ordered.size, bool)
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    return torch.from_numpy(ordered[first].astype(np.int64))


def _distinct_tokens(
    tokens: torch.Tensor,
) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """The distinct token ids (ascending) and a map of token ids to their index among them.
    Token ids are a vocabulary's: usually a dense table, no sort; sparse ids take one sort."""
    vocab = int(tokens.max()) + 1 if tokens.numel() else 0
    if vocab <= max(4 * tokens.numel(), 1 << 20):
        present = torch.bincount(tokens, minlength=vocab) > 0
        index = torch.cumsum(present, 0) - 1
        return torch.nonzero(present).squeeze(1), lambda t: index[t]
    uniq = _distinct(tokens)
    return uniq, lambda t: torch.searchsorted(uniq, t)


def build_updates(
    req: ComputeRequest, result: AdvantageResult, prior: HistoryPrior | None
) -> StatsUpdate:
    """The writes of one computed request (vectorised over the batch, on the result's device).

    ``result`` must come from ``TermContext(collect_ktae_tables=True, ktae_prior=prior)`` when
    the estimator has KTAE. ``prior``: what ``read_history`` returned (None when the request did
    not ask for history or the store was down: then no history is written).
    """
    spec = result.estimator or req.estimator
    device = result.advantages.device
    batch = req.batch.to(device)
    tokens = batch.tokens.long()
    rollout = batch.rollout_of_token

    uniq, dense_of = _distinct_tokens(tokens)
    dense = dense_of(tokens)
    t_count = int(uniq.numel())
    occurrences = torch.bincount(dense, minlength=t_count)
    # Presence: one entry per distinct (rollout, token) pair.
    pairs = _distinct(rollout * max(t_count, 1) + dense)
    pair_token, pair_rollout = pairs % max(t_count, 1), pairs // max(t_count, 1)
    pair_correct = (batch.rewards > 0)[pair_rollout]
    correct = torch.bincount(pair_token[pair_correct], minlength=t_count)
    wrong = torch.bincount(pair_token, minlength=t_count) - correct

    key_sum = torch.zeros(t_count, dtype=torch.float64, device=device)
    key_count = torch.zeros(t_count, dtype=torch.int64, device=device)
    history: HistoryUpdate | None = None
    ktae_params = spec.terms.get("ktae")
    if ktae_params is not None:
        tables = result.extras.get("ktae.tables")
        score = result.extras.get("ktae.score")
        if tables is None and batch.num_tokens == 0:
            tables = _empty_tables(device)
            score = torch.zeros(0, dtype=torch.float64, device=device)
        if tables is None or score is None:
            raise ValueError(
                "build_updates needs the KTAE tables: compute with "
                "TermContext(collect_ktae_tables=True)"
            )
        correct_g = (batch.rewards > ktae_params["correct_threshold"]).double()
        n_c = group_sum(batch, correct_g)
        n_w = batch.group_sizes.double() - n_c
        if prior is not None and wants_history(req):
            prior = prior.to(device)
            history = _history_update(batch, tables, prior, ktae_params)
            n_c, n_w = n_c + prior.n_c, n_w + prior.n_w
        # Key scores of the tables KTAE scored: groups with both correct and wrong rollouts.
        scored = ((n_c > 0) & (n_w > 0))[tables.group]
        table_dense = dense_of(tables.token[scored])
        key_sum.index_add_(0, table_dense, score[scored].double())
        key_count.index_add_(0, table_dense, torch.ones_like(table_dense))

    sens_sum = torch.zeros(t_count, dtype=torch.float64, device=device)
    sens_count = torch.zeros(t_count, dtype=torch.int64, device=device)
    cscr_params = spec.terms.get("cscr")
    if cscr_params is not None:
        s = sensitivity(batch, cscr_params["positive"], cscr_params["negative"])
        sens_sum.index_add_(0, dense, s)
        sens_count = occurrences.clone()

    def host(t: torch.Tensor) -> np.ndarray:
        return t.cpu().numpy()

    return StatsUpdate(
        history=history,
        tokens=TokenStatsUpdate(
            rollouts=batch.num_rollouts,
            tokens=host(uniq),
            correct=host(correct),
            wrong=host(wrong),
            occurrences=host(occurrences),
            key_sum=host(key_sum),
            key_count=host(key_count),
            sens_sum=host(sens_sum),
            sens_count=host(sens_count),
        ),
    )


__all__ = ["HistoryUpdate", "StatsUpdate", "build_updates"]

"""KTAE: key-token advantage estimation (Sun et al., "KTAE: A Model-Free Algorithm to Key-Tokens
Advantage Estimation in Mathematical Reasoning").

Per group and token id v: how strongly is the presence of v associated with a correct rollout?
The score kt(v) is added to every occurrence of v in the group.

The reference loops over groups and distinct tokens with dense vocabulary-sized arrays. Here one
sort of (group, token, rollout) keys over the whole batch yields every group's contingency tables
at once: runs of equal (group, token) are the tables, and a change of rollout inside a run is one
more rollout containing the token. After the sort, a table's counts are differences of the bounds
of its runs, and its score is elementwise (computed per group for the tables of a single token).

The parts: :mod:`.ktae_tables` (the sort and the tables), :mod:`.ktae_statistics` (the
statistics, the score of a table, the per-token statistics diagnostics), :mod:`.ktae_history`
(history per prompt); this module, the term: its parameters, its state across requests and the
computation that puts them together.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..batch import RolloutBatch, Span, fresh
from ..errors import RequestError
from .baselines import group_sum
from .ktae_history import (
    SPACE,
    HistoryPrior,
    HistoryVisit,
    fold_history,
    history_visits,
    prompt_ids,
)
from .ktae_statistics import (
    GROUP_STATISTICS,
    STATISTICS,
    Association,
    AssociationGrid,
    EvaluatedTables,
    association,
    association_lookup,
    association_with_prior,
    evaluate_tables,
    information_gain,
    key_token_score,
    merged_counts,
    statistics_diagnostics,
    table_scores,
    table_tf,
    tf_contrast,
)
from .ktae_tables import KeyTokenTables, gather_tables, tabulate
from .registry import Param, TermContext, TermOutput, register_term
from .state import TermState, TermWrites, TokenCounts, WriteOptions

PARAMS = (
    Param("correct_threshold", float, 0.0, "a rollout is correct when its reward is above this"),
    Param("fisher_weight", float, 1.0, "weight w_F of the Fisher factor F = exp(-2p)", minimum=0.0),
    Param("ig_weight", float, 1.0, "weight w_IG of the information gain (bits)", minimum=0.0),
    Param("tf", bool, True, "add the BM25-style term-frequency contrast to Cohen's h"),
    Param("tf_k1", float, 2.0, "BM25 k1 saturation", minimum=0.0, exclusive_minimum=True),
    Param("tf_b", float, 0.5, "BM25 b length normalisation", minimum=0.0, maximum=1.0),
    Param("scale", float, 1.0, "scores lie in [-scale, scale]", minimum=0.0),
    Param(
        "history",
        str,
        "none",
        "'prompt': merge decayed counts from earlier requests for the same prompt id",
        choices=("none", "prompt"),
    ),
    Param(
        "history_decay", float, 0.5, "weight kept by history per visit", minimum=0.0, maximum=1.0
    ),
)


def _check(params: Mapping[str, Any], where: str) -> None:
    if params["fisher_weight"] + params["ig_weight"] <= 0:
        raise RequestError(
            "out_of_range",
            f"{where}.fisher_weight + {where}.ig_weight must be > 0",
            field=f"{where}.fisher_weight",
        )


# ---- state across requests: history per prompt, key scores in the vocabulary statistics --------


@dataclass
class KtaeState:
    """What a KTAE computation leaves for its writes: the tables, their scores, which groups
    were scored (contrast in the merged counts), each group's own totals float64 (G, 4)
    n_c, n_w, len_c, len_w, and, with history, each table's row in its prompt's stored
    history (int64 (M,), -1: none; what the lookup found, so the write need not search)."""

    tables: KeyTokenTables
    score: torch.Tensor
    scored: torch.Tensor
    totals: torch.Tensor
    stored_rows: torch.Tensor | None = None


def _select(state: KtaeState, span: Span) -> KtaeState:
    m_lo, m_hi = state.tables.table_range(span)
    return KtaeState(
        tables=state.tables.select(span),
        score=state.score[m_lo:m_hi],
        scored=state.scored[span.groups],
        totals=state.totals[span.groups],
        stored_rows=None if state.stored_rows is None else state.stored_rows[m_lo:m_hi],
    )


def _history_keys(batch: RolloutBatch, params: Mapping[str, Any]) -> list[str]:
    return prompt_ids(batch) if params["history"] != "none" else []


def _writes(
    batch: RolloutBatch,
    params: Mapping[str, Any],
    state: KtaeState,
    prior: HistoryPrior | None,
    options: WriteOptions,
) -> TermWrites:
    """History records (when the visit read its prior) and the key scores of the scored tables
    (``key_sum``, ``key_count``: their mean is the token's key score)."""
    tables = state.tables
    token, score = tables.token, state.score
    if not bool(state.scored.all()):
        scored = state.scored.index_select(0, tables.group)
        token, score = token[scored], score[scored]
    columns: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {
        "key_sum": (token, score.double()),
        "key_count": (token, None),
    }
    records: dict[str, HistoryVisit] = {}
    if prior is not None and params["history"] != "none":
        current = torch.stack([tables.a, tables.b, tables.occ_c, tables.occ_w], dim=1)
        records = history_visits(
            prompt_ids(batch),
            state.totals,
            tables.group,
            tables.token,
            current,
            prior,
            float(params["history_decay"]),
            state.stored_rows,
        )
    return TermWrites(records=dict(records), columns=columns, counts=_counts(tables, params))


def _counts(tables: KeyTokenTables, params: Mapping[str, Any]) -> TokenCounts | None:
    """The request's vocabulary counts (:class:`TokenCounts`) from its tables, when they hold
    every token of the batch and split the rollouts as the statistics do (reward > 0): per
    token id, the sums of its tables' counts over the groups. None otherwise (groups left out
    without contrast, ignored ids, another threshold): the engine counts them itself."""
    if tables.sorted_at.numel() != tables.num_tokens or params["correct_threshold"] != 0.0:
        return None
    token = tables.token.cpu().numpy()
    columns = (tables.a, tables.b, tables.run)
    a, b, run = (c.cpu().numpy().astype(np.float64, copy=False) for c in columns)
    largest = int(token.max()) if token.size else -1
    if largest < max(4 * token.size, 1 << 20):
        size, ids = largest + 1, token
        occurrences = np.bincount(ids, weights=run, minlength=size)
        uniq = np.flatnonzero(occurrences)
        occurrences = occurrences[uniq]
    else:
        uniq, inverse = np.unique(token, return_inverse=True)
        size, ids = uniq.size, inverse.reshape(-1)
        occurrences = np.bincount(ids, weights=run, minlength=size)

    def summed(values: np.ndarray) -> np.ndarray:
        per_id = np.bincount(ids, weights=values, minlength=size)
        return per_id if per_id.size == uniq.size else per_id[uniq]

    # (whole counts summed in float64: exact)
    return TokenCounts(
        ids=uniq.astype(np.int64),
        correct=summed(a).astype(np.int64),
        wrong=summed(b).astype(np.int64),
        occurrences=occurrences.astype(np.int64),
    )


def _fold(visits: Sequence[HistoryVisit], options: WriteOptions) -> bytes:
    return fold_history(visits, options.compression == "zstd")


STATE: TermState[HistoryPrior] = TermState(
    writes=_writes,
    columns=("key_sum", "key_count"),
    space=SPACE,
    keys=_history_keys,
    decode=HistoryPrior.decode,
    select=_select,
    contributed=lambda prior: any(stored is not None for stored in prior.stored),
    fold=_fold,
)


@register_term(
    "ktae",
    formula="b_it = scale tanh(z/2), z = (w_F exp(-2p) + w_IG IG) (h + tf) / (w_F + w_IG)",
    paper="Sun et al. 2025, KTAE: A Model-Free Algorithm to Key-Tokens Advantage Estimation",
    params=PARAMS,
    diagnostics=("ktae_score", *STATISTICS),
    requires=lambda params: {},
    check=_check,
    state=STATE,
)
def ktae(batch: RolloutBatch, params: Mapping[str, Any], ctx: TermContext) -> TermOutput:
    """Key-token bonus: the group's association score of each token id with correctness."""
    device = batch.device
    correct = batch.rewards > params["correct_threshold"]
    n_c = group_sum(batch, correct.double())
    n_w = batch.group_sizes.double() - n_c
    lengths = batch.lengths.double()
    len_c = group_sum(batch, lengths * correct)
    len_w = group_sum(batch, lengths) - len_c
    totals = torch.stack([n_c, n_w, len_c, len_w], dim=1)
    contrast = (n_c > 0) & (n_w > 0)
    drop = None
    # With a history read every group is tabulated: its merged counts may have the contrast its
    # own lack, and its counts are written back.
    if ctx.read is None and not bool(contrast.all()):
        # Groups without both correct and wrong rollouts score 0: skip their tokens entirely.
        drop = ~contrast[batch.group_index]
    wanted = ctx.diagnostics
    # (the statistics of each token's table; |C| and |W| are its group's)
    stats = any(name in wanted for name in STATISTICS if name not in GROUP_STATISTICS)
    if batch.num_tokens == 0 or (drop is not None and bool(drop.all())):
        bonus = torch.zeros(batch.num_tokens, dtype=torch.float32, device=device)
        empty = KeyTokenTables.empty(batch.num_tokens, device)
        score = torch.zeros(0, dtype=torch.float64, device=device)
        assoc = Association(score, score, score, score, score)
        none = EvaluatedTables(empty.group32, score, score, assoc, score, score)
        entry_of_token = none.entry_of_token(empty) if stats else None
        return TermOutput(
            bonus=bonus,
            diagnostics={
                "ktae_score": bonus,
                **statistics_diagnostics(batch, none, entry_of_token, totals, wanted),
            },
            state=KtaeState(empty, score, contrast, totals),
        )
    tables = tabulate(batch, correct, drop, ctx.ignore_token_ids)
    # A history read still in flight has had the tabulation's time to arrive.
    prior: HistoryPrior | None = None if ctx.read is None else ctx.read.result()
    stored_rows = None
    if prior is None:
        # (per table only where it needs to be: :func:`evaluate_tables`)
        evaluated = evaluate_tables(tables, n_c, n_w, len_c, len_w, params, parts=stats)
    else:
        n_c, n_w, len_c, len_w = (
            n_c + prior.n_c,
            n_w + prior.n_w,
            len_c + prior.len_c,
            len_w + prior.len_w,
        )
        contrast = (n_c > 0) & (n_w > 0)
        g = tables.group
        merged, stored_rows = merged_counts(tables, prior)
        assoc = association_with_prior(merged, g, n_c, n_w, params)
        occ_c, occ_w = merged[:, 2].contiguous(), merged[:, 3].contiguous()
        tf = table_tf(occ_c, occ_w, g, len_c, len_w, params)
        score = key_token_score(assoc.strength, assoc.h, tf, params["scale"])
        evaluated = EvaluatedTables(g, merged[:, 0], merged[:, 1], assoc, tf, score)
    score = evaluated.per_table(evaluated.score)
    merged_totals = torch.stack([n_c, n_w, len_c, len_w], dim=1)
    if not stats:
        # (the entries are let go before the spread, where memory peaks)
        del evaluated
        bonus = tables.spread(score.float())
        statistics = statistics_diagnostics(batch, None, None, merged_totals, wanted)
    else:
        # Each token's entry is found once, and every per-entry value (the score among them)
        # reaches the tokens by one gather from a small array.
        entry_of_token = evaluated.entry_of_token(tables)
        bonus = fresh((batch.num_tokens,), torch.float32, device)
        gather_tables(evaluated.score.float(), entry_of_token, out=bonus)
        statistics = statistics_diagnostics(batch, evaluated, entry_of_token, merged_totals, wanted)
    return TermOutput(
        bonus=bonus,
        diagnostics={"ktae_score": bonus, **statistics},
        state=KtaeState(tables, score, contrast, totals, stored_rows),
    )


__all__ = [
    "GROUP_STATISTICS",
    "PARAMS",
    "STATE",
    "STATISTICS",
    "AssociationGrid",
    "EvaluatedTables",
    "KeyTokenTables",
    "KtaeState",
    "association",
    "association_lookup",
    "evaluate_tables",
    "gather_tables",
    "information_gain",
    "key_token_score",
    "ktae",
    "table_scores",
    "tabulate",
    "tf_contrast",
]

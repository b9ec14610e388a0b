"""KTAE: key-token advantage estimation (Sun et al., "KTAE: A Model-Free Algorithm to Key-Tokens
Advantage Estimation in Mathematical Reasoning").

Per group and token id v: how strongly is the presence of v associated with a correct rollout?
The score kt(v) is added to every occurrence of v in the group.

The reference loops over groups and distinct tokens with dense vocabulary-sized arrays. Here one
sort of (group, token, rollout) keys over the whole batch yields every group's contingency tables
at once: runs of equal (group, token) are the tables, and a change of rollout inside a run is one
more rollout containing the token. After the sort, a table's counts are differences of the bounds
of its runs, and its score is elementwise (computed per group for the tables of a single token).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch

from ..batch import RolloutBatch, Span, fresh, repeat_runs
from ..errors import RequestError
from .baselines import group_sum
from .fisher import fisher_two_sided_grouped, margin_grid
from .ktae_history import (
    SPACE,
    HistoryPrior,
    HistoryVisit,
    fold_history,
    history_visits,
    prompt_ids,
)
from .registry import Param, TermContext, TermOutput, register_term
from .state import TermState, TermWrites, TokenCounts, WriteOptions

# "p is 1" within float rounding: such a token carries no evidence, so its Fisher factor is 0.
P_IS_ONE = 1.0 - 1e-6
# Bits of the packed sort key: int64 without the sign bit (keys sort as signed integers).
KEY_BITS = 63
# The reference's floor in the term-frequency ratio; it lets z reach ~1e5 (hence tanh, not exp).
TF_FLOOR = 1e-5
# Floor of divisors and logarithms' arguments (x log x at 0 is then 0 * finite = 0).
TINY = 1e-300
# Information gains below this (bits) are rounding, not information: taken as 0.
IG_ROUNDING = 1e-12

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


# ---- the statistics, one small function each (float64 tensors of one shape) ------------------


def fisher_factor(p: torch.Tensor) -> torch.Tensor:
    """F = exp(-2p), and 0 where p is 1: significance of the association."""
    return torch.where(p >= P_IS_ONE, torch.zeros_like(p), torch.exp(-2.0 * p))


def xlog2x(x: torch.Tensor) -> torch.Tensor:
    """x log2 x elementwise, 0 at x = 0 (x >= 0): one fresh tensor, no masks."""
    return x.clamp(min=TINY).log2_().mul_(x)


def information_gain(
    a: torch.Tensor,
    b: torch.Tensor,
    n_c: torch.Tensor,
    n_w: torch.Tensor,
    group: torch.Tensor | None = None,
) -> torch.Tensor:
    """IG = H(Y) - H(Y | X) in bits: Y correct/wrong, X token present.

    With c = n_c - a, d = n_w - b, P = a + b, Q = c + d, n = P + Q (0 log 0 = 0):
    n IG = n log n - n_c log n_c - n_w log n_w - P log P - Q log Q + a log a + b log b
    + c log c + d log d: six logarithms per table and none of the entropies' divisions. n_c, n_w
    broadcast against a, b, or are per group (G,) when ``group`` (M,) maps tables to groups (the
    terms that depend on the group alone are then computed once per group).
    """
    n = n_c + n_w
    n_h_y = xlog2x(n).sub_(xlog2x(n_c)).sub_(xlog2x(n_w))
    inv_n = torch.where(n > 0, 1.0 / n.clamp(min=TINY), torch.zeros_like(n))
    if group is not None:
        n_c, n_w, n = (t.index_select(0, group) for t in (n_c, n_w, n))
        n_h_y, inv_n = n_h_y.index_select(0, group), inv_n.index_select(0, group)
    present = a + b
    s = xlog2x(a).add_(xlog2x(b)).sub_(xlog2x(present))
    # (the clamps remove float rounding below 0 of differences that are >= 0 exactly)
    s.add_(xlog2x((n_c - a).clamp_(min=0.0))).add_(xlog2x((n_w - b).clamp_(min=0.0)))
    s.sub_(xlog2x((n - present).clamp_(min=0.0)))
    ig = s.add_(n_h_y).mul_(inv_n)
    # IG >= 0, and an independent table's (a/n_c = b/n_w) is exactly 0; the sums above leave
    # rounding of ~1e-16 either way, which would give such a table a score of ~1e-17 instead of
    # 0. Snapping a true IG below 1e-12 bits to 0 moves a score by at most ~3e-8 (|z| gains at
    # most 1e-12 * |h + tf| / 2 with |tf| < 1e5): below the float32 answer's resolution.
    return ig.masked_fill_(ig < IG_ROUNDING, 0.0)


def cohens_h(
    a: torch.Tensor,
    b: torch.Tensor,
    n_c: torch.Tensor,
    n_w: torch.Tensor,
    group: torch.Tensor | None = None,
) -> torch.Tensor:
    """Cohen's h between presence rates in correct and wrong rollouts: the direction.

    n_c, n_w as in :func:`information_gain` (per group when ``group`` is given)."""
    inv_c = torch.where(n_c > 0, 1.0 / n_c.clamp(min=TINY), torch.zeros_like(n_c))
    inv_w = torch.where(n_w > 0, 1.0 / n_w.clamp(min=TINY), torch.zeros_like(n_w))
    if group is not None:
        inv_c, inv_w = inv_c.index_select(0, group), inv_w.index_select(0, group)
    rate_c = (a * inv_c).clamp_(0.0, 1.0).sqrt_().asin_()
    return rate_c.sub_((b * inv_w).clamp_(0.0, 1.0).sqrt_().asin_())


def tf_saturation(
    occurrences: torch.Tensor,
    inv_length: torch.Tensor,
    k: torch.Tensor,
    k1: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """BM25 term-frequency saturation s = f (k1 + 1) / (f + K), f = occurrences / L.

    ``inv_length`` = 1 / L (0 for L = 0, so f = 0) and ``k`` = K > 0 come per table from its
    group; with f = 0 the formula gives s = 0 without a special case. ``inv_length`` is
    overwritten (with f + K): callers pass scratch; s goes into ``out`` when given.
    """
    f = inv_length.mul_(occurrences)
    return torch.mul(f, k1 + 1.0, out=out).div_(f.add_(k))


def tf_group_constants(
    length: torch.Tensor, avg_length: torch.Tensor, k1: float, b: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group: 1 / L (0 where L = 0) and K = k1 (1 - b + b L / avg) (1 where it is 0: only
    with b = 1 and L = 0, where f = 0 and s = 0 anyway)."""
    inv = torch.where(length > 0, 1.0 / length.clamp(min=TINY), torch.zeros_like(length))
    k = k1 * (1.0 - b + b * length / avg_length.clamp(min=TINY))
    return inv, torch.where(k > 0, k, torch.ones_like(k))


def tf_contrast(
    occ_c: torch.Tensor,
    occ_w: torch.Tensor,
    group: torch.Tensor,
    len_c: torch.Tensor,
    len_w: torch.Tensor,
    k1: float,
    b: float,
) -> torch.Tensor:
    """s_C / (s_W + 1e-5) - s_W / (s_C + 1e-5): does v occur more densely in correct rollouts?

    occ_c, occ_w, group: per table (M,); len_c, len_w: total tokens of the correct and wrong
    rollouts per group (G,), avg = (L_C + L_W) / 2.
    """
    avg = (len_c + len_w) / 2.0
    inv_c, k_c = tf_group_constants(len_c, avg, k1, b)
    inv_w, k_w = tf_group_constants(len_w, avg, k1, b)
    # (one fresh block, huge pages on the CPU: two rows of scratch for the per-table group
    # constants, reused by both sides and the quotient, and the two saturations; fresh float64
    # arrays of every table cost as much in page faults as in arithmetic)
    f, k, s_c, s_w = fresh((4, group.numel()), torch.float64, group.device)

    def saturation(
        occurrences: torch.Tensor, inv: torch.Tensor, k_g: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        torch.index_select(inv, 0, group, out=f)
        return tf_saturation(occurrences, f, torch.index_select(k_g, 0, group, out=k), k1, out)

    s_c = saturation(occ_c, inv_c, k_c, s_c)
    s_w = saturation(occ_w, inv_w, k_w, s_w)
    contrast = torch.div(s_c, torch.add(s_w, TF_FLOOR, out=f), out=k)
    return contrast.sub_(s_w.div_(s_c.add_(TF_FLOOR)))


@dataclass
class Association:
    """Per table (M,) float64: ``strength`` (w_F F + w_IG IG) / (w_F + w_IG) and ``h`` (Cohen's
    h), 0 where the group has no contrast (no correct or no wrong rollout); and, when the
    statistics diagnostics ask for them, the parts: ``p`` (the Fisher p-value), ``fisher``
    (F = exp(-2p), 0 where p is 1) and ``ig`` (bits), F and IG 0 without contrast as well
    (float32 when gathered for the diagnostics alone, which are float32)."""

    strength: torch.Tensor
    h: torch.Tensor
    p: torch.Tensor | None = None
    fisher: torch.Tensor | None = None
    ig: torch.Tensor | None = None

    def take(self, at: torch.Tensor, parts: bool) -> Association:
        """The values at flat positions ``at`` (of tensors of any shape); the parts only when
        ``parts``."""

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            # (rounded on the small grid, then gathered: the float32 of the gathered value)
            return None if t is None else t.reshape(-1).float().index_select(0, at)

        return Association(
            strength=self.strength.reshape(-1).index_select(0, at),
            h=self.h.reshape(-1).index_select(0, at),
            p=pick(self.p) if parts else None,
            fisher=pick(self.fisher) if parts else None,
            ig=pick(self.ig) if parts else None,
        )


def association(
    a: torch.Tensor,
    b: torch.Tensor,
    n_c: torch.Tensor,
    n_w: torch.Tensor,
    p: torch.Tensor,
    params: Mapping[str, Any],
    group: torch.Tensor | None = None,
) -> Association:
    """Strength and direction of tables, with their parts F and IG (:class:`Association`).

    n_c, n_w broadcast against a, b, or are per group (G,) when ``group`` (M,) maps tables to
    groups."""
    w_f, w_ig = params["fisher_weight"], params["ig_weight"]
    contrast = (n_c > 0) & (n_w > 0)
    if group is not None:
        contrast = contrast.index_select(0, group)
    no_contrast = ~contrast.expand_as(p)
    fisher = fisher_factor(p).masked_fill_(no_contrast, 0.0)
    ig = information_gain(a, b, n_c, n_w, group).masked_fill_(no_contrast, 0.0)
    strength = (fisher * w_f).add_(ig, alpha=w_ig).div_(w_f + w_ig)
    h = cohens_h(a, b, n_c, n_w, group).masked_fill_(no_contrast, 0.0)
    return Association(strength, h, p, fisher, ig)


def key_token_score(
    strength: torch.Tensor, h: torch.Tensor, tf: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """kt = scale tanh(z / 2), z = strength (h + tf contrast)  (steps 5-7)."""
    # In place on one fresh tensor: these are the largest arrays after the sort.
    x = h + tf if tf is not None else h.clone()
    x.mul_(strength).mul_(0.5).tanh_()
    if scale != 1.0:
        x.mul_(scale)
    # (+ 0.0 turns tanh(-0) into 0 so JSON shows no negative zeros)
    return x.add_(0.0)


class AssociationGrid:
    """:func:`association` of every possible whole-number table of some groups, to look tables
    up in (:meth:`lookup`).

    n_c, n_w: per-group float64 (G,) whole numbers. A group's tables all share its margins and
    have cells of at most the group size, so the Fisher p-value, information gain and Cohen's h
    are computed on the small grid of possible tables per distinct margin pair, once.
    """

    def __init__(self, n_c: torch.Tensor, n_w: torch.Tensor, params: Mapping[str, Any]) -> None:
        p, margin_of_group, m1, m2 = margin_grid(n_c.long(), n_w.long())  # p: [margin, a+b, a]
        _, k_count, x_count = p.shape
        dev = p.device
        a_grid = torch.arange(x_count, dtype=torch.float64, device=dev)[None, None, :]
        k_grid = torch.arange(k_count, dtype=torch.float64, device=dev)[None, :, None]
        b_grid = (k_grid - a_grid).clamp(min=0)
        self.grid = association(
            a_grid.expand_as(p),
            b_grid.expand_as(p),
            m1.double()[:, None, None].expand_as(p),
            m2.double()[:, None, None].expand_as(p),
            p,
            params,
        )
        self.x_count = x_count
        # (float64: a table's place is whole and far below 2^53, and float64 a and b are added
        # to it in place, with no int64 copies of them)
        self.group_base = (margin_of_group * (k_count * x_count)).double()

    def lookup(
        self, group: torch.Tensor, a: torch.Tensor, b: torch.Tensor, parts: bool = False
    ) -> Association:
        """The association of tables (``group``: int32 or int64 (M,); a, b: float64 (M,) whole
        numbers); ``parts``: p, F and IG too (the statistics diagnostics: a few gathers from
        the same grid, no second computation)."""
        x_count = self.x_count
        # The place (margin, a + b, a) of each table in the flat grid; int32 gathers faster.
        at = self.group_base.index_select(0, group).add_(a, alpha=x_count + 1)
        at = at.add_(b, alpha=x_count).int()
        return self.grid.take(at, parts)


def association_lookup(
    n_c: torch.Tensor,
    n_w: torch.Tensor,
    group: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    params: Mapping[str, Any],
    parts: bool = False,
) -> Association:
    """:func:`association` for whole-number tables, evaluated once per possible table
    (:class:`AssociationGrid`) and gathered, instead of once per (group, token).

    n_c, n_w: per-group float64 (G,) whole numbers; group, a, b: per-table (M,). ``parts``:
    gather p, F and IG too.
    """
    return AssociationGrid(n_c, n_w, params).lookup(group, a, b, parts)


@dataclass
class EvaluatedTables:
    """The tables whose association, tf contrast and score are computed ("entries", E of
    them), and which entry holds each table's values.

    ``group``: int (E,); ``a``, ``b``: float64 (E,) counts (with history the merged ones);
    ``assoc``: their :class:`Association` (with p, F and IG when the statistics were asked
    for); ``tf``: float64 (E,), None with tf off; ``score``: float64 (E,)
    (:func:`key_token_score`); ``entry``: int32 (M,), each table's entry, None when the
    entries are the tables.
    """

    group: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    assoc: Association
    tf: torch.Tensor | None
    score: torch.Tensor
    entry: torch.Tensor | None = None

    def per_table(self, values: torch.Tensor) -> torch.Tensor:
        """Per-entry ``values`` (E,) -> per table (M,)."""
        return values if self.entry is None else values.index_select(0, self.entry)

    def entry_of_token(self, tables: KeyTokenTables) -> torch.Tensor:
        """int32 (N,): each token's entry, E (one past the last) at tokens not tabulated: the
        per-entry values reach the tokens by one gather each (:func:`gather_tables`)."""
        if self.entry is None:
            return tables.table_of_token()
        return tables.spread(self.entry, fill=self.group.numel())


def evaluate_tables(
    tables: KeyTokenTables,
    n_c: torch.Tensor,
    n_w: torch.Tensor,
    len_c: torch.Tensor,
    len_w: torch.Tensor,
    params: Mapping[str, Any],
    parts: bool = False,
) -> EvaluatedTables:
    """:func:`key_token_score` of every table (without history), as computed over all of them,
    but per table only where it has more than one token (``parts``: with the association's
    p, F and IG, for the statistics diagnostics).

    A table of one token is (a, b, occ_c, occ_w) = (1, 0, 1, 0) or (0, 1, 0, 1): its values
    depend on its group and that token's rollout being correct alone, and are computed once per
    group for both (most tables of a Zipf batch: 87% of the training-sized one's). The same
    elementwise operations on the same values give the same bits. Entries 2g and 2g + 1 are
    group g's single-token tables (wrong, correct), then come the tables of several tokens.
    """
    dev = tables.group32.device
    groups = n_c.numel()
    group = tables.group32
    several = _nonzero(tables.runs > 1)
    several_cells = tables.cells_at(several)
    # (a, b, occ_c, occ_w) of the single-token tables: (0, 1, 0, 1) and (1, 0, 1, 0)
    single = torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0]], dtype=several_cells.dtype, device=dev)
    single_group = torch.arange(groups, dtype=group.dtype, device=dev).repeat_interleave(2)
    g = torch.cat([single_group, group.index_select(0, several)])
    evaluated_cells = torch.cat([single.repeat(1, groups), several_cells[:4]], 1)
    a, b, occ_c, occ_w = evaluated_cells.double()
    assoc = AssociationGrid(n_c, n_w, params).lookup(g, a, b, parts)
    tf = _tf(occ_c, occ_w, g, len_c, len_w, params)
    score = key_token_score(assoc.strength, assoc.h, tf, params["scale"])
    # Every table takes its group's single-token entry first (any entry in range for a table
    # of several tokens), then those of several tokens are overwritten.
    entry = tables.single_side().add_(group, alpha=2).int()
    first_several = torch.arange(2 * groups, g.numel(), dtype=torch.int32, device=dev)
    entry.index_copy_(0, several, first_several)
    return EvaluatedTables(g, a, b, assoc, tf, score, entry)


def table_scores(
    tables: KeyTokenTables,
    n_c: torch.Tensor,
    n_w: torch.Tensor,
    len_c: torch.Tensor,
    len_w: torch.Tensor,
    params: Mapping[str, Any],
) -> torch.Tensor:
    """float64 (M,): :func:`key_token_score` of every table (without history), evaluated per
    table only where it has more than one token (:func:`evaluate_tables`)."""
    evaluated = evaluate_tables(tables, n_c, n_w, len_c, len_w, params)
    return evaluated.per_table(evaluated.score)


def _tf(
    occ_c: torch.Tensor,
    occ_w: torch.Tensor,
    group: torch.Tensor,
    len_c: torch.Tensor,
    len_w: torch.Tensor,
    params: Mapping[str, Any],
) -> torch.Tensor | None:
    """The term-frequency contrast of each table (None with ``tf`` off)."""
    if not params["tf"]:
        return None
    return tf_contrast(occ_c, occ_w, group, len_c, len_w, params["tf_k1"], params["tf_b"])


def _merged_counts(
    tables: KeyTokenTables, prior: HistoryPrior
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (M, 4): each table's a, b, occ_c, occ_w with the prior's added; and int64 (M,)
    where each table's row is in its prompt's stored history (-1: none), for the write."""
    # (the prior's counts of each table, 0 for tokens it lacks)
    merged, rows = prior.lookup_rows(tables.group, tables.token)
    merged[:, 0] += tables.a
    merged[:, 1] += tables.b
    merged[:, 2] += tables.occ_c
    merged[:, 3] += tables.occ_w
    return merged, rows


def _association_with_prior(
    merged: torch.Tensor,
    group: torch.Tensor,
    n_c: torch.Tensor,
    n_w: torch.Tensor,
    params: Mapping[str, Any],
) -> Association:
    """:func:`association` of tables whose counts include decayed history (``merged``, float64
    (M, 4); n_c, n_w: the merged per-group totals): fractional counts, so every table is
    evaluated elementwise (with history nearly every group has contrast; those without get 0
    through :func:`association`), the per-group terms once per group."""
    a, b = merged[:, 0].contiguous(), merged[:, 1].contiguous()
    # The exact test needs whole tables: decayed counts are rounded for it (only for it).
    p = fisher_two_sided_grouped(
        n_c.round().long(), n_w.round().long(), group, a.round().long(), b.round().long()
    )
    return association(a, b, n_c, n_w, p, params, group=group)


# ---- the batched contingency tables -----------------------------------------------------------


@dataclass
class _TableBounds:
    """Where each table's runs of sorted tokens start and end (int32 when they fit), from which
    its counts are differences: ``pair`` (R + 1,): the first token of each (table, rollout) pair,
    then K; per table, ``table_pair`` and ``table_token`` (M + 1,): its first pair and token,
    then R and K, and (M,) ``first_end``: the end of its first half in pairs, and ``wrong``: 1
    when that half is its wrong rollouts' (0: it has correct rollouts alone)."""

    pair: torch.Tensor
    table_pair: torch.Tensor
    table_token: torch.Tensor
    first_end: torch.Tensor
    wrong: torch.Tensor

    def cells(self, at: torch.Tensor | None = None) -> torch.Tensor:
        """int (5, M): a, b, occ_c, occ_w and the run of each table (of the tables ``at``)."""

        def pick(t: torch.Tensor) -> torch.Tensor:
            return t if at is None else t.index_select(0, at)

        pair_lo, pair_hi = pick(self.table_pair[:-1]), pick(self.table_pair[1:])
        token_lo, token_hi = pick(self.table_token[:-1]), pick(self.table_token[1:])
        first_end, wrong = pick(self.first_end), pick(self.wrong)
        cells = fresh((5, pair_lo.numel()), pair_lo.dtype, pair_lo.device)
        torch.sub(first_end, pair_lo, out=cells[1]).mul_(wrong)
        torch.sub(pair_hi, pair_lo, out=cells[0]).sub_(cells[1])
        torch.sub(token_hi, token_lo, out=cells[4])
        wrong_end = self.pair.index_select(0, first_end)
        torch.sub(wrong_end, token_lo, out=cells[3]).mul_(wrong)
        torch.sub(cells[4], cells[3], out=cells[2])
        return cells


class KeyTokenTables:
    """Contingency counts per (group, token id) present in the batch.

    ``group``/``token``: int64 (M,); float64 (M,): ``a``/``b`` correct/wrong rollouts containing
    the token, ``occ_c``/``occ_w`` its occurrences in them. ``sorted_at`` (int64 (K,): the
    position of each tabulated token among them, table by table), ``kept_at`` (int64 (K,): the
    batch positions of the tabulated tokens, ascending; None: ``sorted_at`` holds batch
    positions) and ``run`` (int64 (M,): tokens per table) map per-table values back to token
    positions (:meth:`spread`, :attr:`order`); K < N when some tokens were left out (groups
    without contrast, ignored ids). ``starts``: int64 (M,), the first sorted position of each
    table.

    :func:`tabulate` gives them compact (int32 keys and run bounds, :meth:`compact`): the int64
    and float64 fields are made when first read, since a score without history or statistics
    reads few of them (:func:`table_scores` reads ``group32``, ``runs``, :meth:`single_side`
    and the counts of a few tables, :meth:`cells_at`).
    """

    def __init__(
        self,
        group: torch.Tensor,
        token: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        occ_c: torch.Tensor,
        occ_w: torch.Tensor,
        sorted_at: torch.Tensor,
        run: torch.Tensor,
        num_tokens: int,
        starts: torch.Tensor | None = None,
        kept_at: torch.Tensor | None = None,
    ) -> None:
        # (the cached properties' values, given)
        self.__dict__.update(group=group, token=token, a=a, b=b, occ_c=occ_c, occ_w=occ_w, run=run)
        if starts is not None:
            self.__dict__["starts"] = starts
        self.sorted_at, self.num_tokens, self.kept_at = sorted_at, num_tokens, kept_at
        self._heads: torch.Tensor | None = None
        self._vocab: torch.Tensor | None = None
        self._vocab_bits = 0
        self._bounds: _TableBounds | None = None

    @classmethod
    def compact(
        cls,
        heads: torch.Tensor,
        vocab_bits: int,
        vocab: torch.Tensor | None,
        bounds: _TableBounds,
        sorted_at: torch.Tensor,
        kept_at: torch.Tensor | None,
        num_tokens: int,
    ) -> KeyTokenTables:
        """Tables from ``heads`` (M,) group << vocab_bits | token (the index into ``vocab``
        when given) and the bounds of their runs."""
        tables = cls.__new__(cls)
        tables.sorted_at, tables.num_tokens, tables.kept_at = sorted_at, num_tokens, kept_at
        tables._heads, tables._vocab, tables._vocab_bits = heads, vocab, vocab_bits
        tables._bounds = bounds
        return tables

    @cached_property
    def group32(self) -> torch.Tensor:
        """int32 (M,): ``group``, as gathers index fastest."""
        if self._heads is None:
            return self.group.int()
        return (self._heads >> self._vocab_bits).int()

    @cached_property
    def cells(self) -> torch.Tensor:
        """int (5, M): a, b, occ_c, occ_w and the run of each table, whole."""
        if self._bounds is not None:
            return self._bounds.cells()
        return torch.stack(
            [self.a.long(), self.b.long(), self.occ_c.long(), self.occ_w.long(), self.run]
        )

    def cells_at(self, at: torch.Tensor) -> torch.Tensor:
        """int (5, len(at)): :attr:`cells` of the tables ``at``."""
        if self._bounds is not None and "cells" not in self.__dict__:
            return self._bounds.cells(at)
        return self.cells.index_select(1, at)

    @cached_property
    def runs(self) -> torch.Tensor:
        """int (M,): ``run``, int32 when the tables are compact."""
        if self._bounds is None:
            return self.run
        token = self._bounds.table_token
        return token[1:] - token[:-1]

    def single_side(self) -> torch.Tensor:
        """int (M,), fresh: 1 for a table of correct rollouts alone, 0 for one with wrong
        rollouts; for a table of a single token, whether that token's rollout is correct."""
        if self._bounds is None:
            return (self.b == 0).to(self.group32.dtype)
        return self._bounds.wrong.bitwise_xor(1)

    @cached_property
    def group(self) -> torch.Tensor:
        return self.group32.long()  # (made from the heads when compact)

    @cached_property
    def token(self) -> torch.Tensor:
        assert self._heads is not None
        token = (self._heads & ((1 << self._vocab_bits) - 1)).long()
        return token if self._vocab is None else self._vocab[token]

    @cached_property
    def _counts(self) -> torch.Tensor:
        """float64 (4, M): a, b, occ_c, occ_w, in one fresh block."""
        counts = self.cells[:4]
        return fresh(tuple(counts.shape), torch.float64, counts.device).copy_(counts)

    @cached_property
    def a(self) -> torch.Tensor:
        return self._counts[0]

    @cached_property
    def b(self) -> torch.Tensor:
        return self._counts[1]

    @cached_property
    def occ_c(self) -> torch.Tensor:
        return self._counts[2]

    @cached_property
    def occ_w(self) -> torch.Tensor:
        return self._counts[3]

    @cached_property
    def run(self) -> torch.Tensor:
        return self.runs.long()

    @cached_property
    def starts(self) -> torch.Tensor:
        if self._bounds is not None:
            return self._bounds.table_token[:-1].long()
        return torch.cumsum(self.run, 0) - self.run

    @property
    def order(self) -> torch.Tensor:
        """int64 (K,): the batch position of each tabulated token, table by table."""
        return self.sorted_at if self.kept_at is None else self.kept_at[self.sorted_at]

    @classmethod
    def empty(cls, num_tokens: int, device: torch.device) -> KeyTokenTables:
        """No tables (no tokens, or every group without contrast)."""
        i = torch.zeros(0, dtype=torch.int64, device=device)
        f = torch.zeros(0, dtype=torch.float64, device=device)
        return cls(i, i, f, f, f, f, i, i, num_tokens)

    def table_range(self, span: Span) -> tuple[int, int]:
        """The tables [lo, hi) of the groups of ``span`` (tables are ordered by group)."""
        bounds = torch.tensor([span.group_lo, span.group_hi], device=self.group.device)
        lo, hi = torch.searchsorted(self.group, bounds).tolist()
        return int(lo), int(hi)

    def select(self, span: Span) -> KeyTokenTables:
        """The tables of the groups of ``span`` (one request of a merged batch), renumbered
        from 0 and mapping to that request's tokens: what tabulating it alone gives."""
        m_lo, m_hi = self.table_range(span)
        starts = self.starts
        s_lo = int(starts[m_lo]) if m_hi > m_lo else 0
        s_hi = s_lo + int(self.run[m_lo:m_hi].sum())
        return KeyTokenTables(
            group=self.group[m_lo:m_hi] - span.group_lo,
            token=self.token[m_lo:m_hi],
            a=self.a[m_lo:m_hi],
            b=self.b[m_lo:m_hi],
            occ_c=self.occ_c[m_lo:m_hi],
            occ_w=self.occ_w[m_lo:m_hi],
            # (a request's tables hold its own tokens only)
            sorted_at=self.order[s_lo:s_hi] - span.token_lo,
            run=self.run[m_lo:m_hi],
            num_tokens=span.token_hi - span.token_lo,
            starts=starts[m_lo:m_hi] - s_lo,
        )

    def spread(self, values: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """Per-table ``values`` (M,) -> per-token (N,), ``fill`` at tokens that were not
        tabulated."""
        out = fresh((self.num_tokens,), values.dtype, values.device)
        k = self.sorted_at.numel()
        if values.device.type == "cpu" and values.numel():
            per_token = torch.from_numpy(np.repeat(values.numpy(), self.runs.numpy()))
        else:
            per_token = repeat_runs(values, self.starts, k)
        if k != self.num_tokens:
            out.fill_(fill)
        # (scatter_: ~3x faster than out[order] = ... on CPU)
        if self.kept_at is None:
            return out.scatter_(0, self.sorted_at, per_token)
        # Placed among the tabulated tokens first, then at their batch positions in ascending
        # order: two scatters, cheaper than the batch position of each sorted token (a random
        # gather of int64 over the tabulated tokens).
        tabulated = fresh((k,), values.dtype, values.device).scatter_(0, self.sorted_at, per_token)
        return out.scatter_(0, self.kept_at, tabulated)

    def table_of_token(self) -> torch.Tensor:
        """int32 (N,): each token's table, M (one past the last) at tokens not tabulated. Many
        per-table values reach the tokens by one gather each (:func:`gather_tables`) instead of
        one :meth:`spread` each."""
        m = self.group32.numel()
        return self.spread(torch.arange(m, dtype=torch.int32, device=self.group32.device), m)


def gather_tables(
    values: torch.Tensor, table: torch.Tensor, fill: float = 0.0, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-table ``values`` (M,) at each token of ``table`` (:meth:`KeyTokenTables.
    table_of_token`): (N,) (into ``out`` when given), ``fill`` at tokens not tabulated."""
    extended = torch.cat([values, values.new_full((1,), fill)])
    if out is None:
        return extended.index_select(0, table)
    return torch.index_select(extended, 0, table, out=out)


def _nonzero(flags: torch.Tensor) -> torch.Tensor:
    """int64 positions where bool ``flags`` (K,) is true, ascending."""
    if flags.device.type == "cpu":  # (numpy's: several times torch's on the CPU)
        return torch.from_numpy(np.flatnonzero(flags.numpy()))
    return torch.nonzero(flags).squeeze(1)


def _run_bounds(values: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """int64 (runs + 1,): the first position of each run of equal ``values`` (sorted, (n,)),
    then n. ``out``: bool (n + 1,) scratch for the run starts' flags (fresh when None)."""
    n = values.numel()
    if out is None:
        out = torch.empty(n + 1, dtype=torch.bool, device=values.device)
    out[:1] = True
    torch.ne(values[1:], values[:-1], out=out[1:n])
    # (the end as one more flag: the bounds come out of one nonzero, with no copy to extend them)
    out[n] = True
    return _nonzero(out)


class _Scratch:
    """Named arrays carved from one fresh block (huge pages on the CPU), each 64-byte aligned:
    ``_Scratch(device, name=(size, dtype), ...)``, then ``scratch[name]``."""

    def __init__(self, device: torch.device, **arrays: tuple[int, torch.dtype]) -> None:
        offsets, total = {}, 0
        for name, (size, dtype) in arrays.items():
            offsets[name] = total
            total += -(-size * dtype.itemsize // 64) * 64
        block = fresh((max(total, 1),), torch.uint8, device)
        self._arrays = {
            name: block[offsets[name] : offsets[name] + size * dtype.itemsize].view(dtype)
            for name, (size, dtype) in arrays.items()
        }

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._arrays[name]


def tabulate(
    batch: RolloutBatch,
    correct: torch.Tensor,
    drop: torch.Tensor | None = None,
    ignore: torch.Tensor | None = None,
) -> KeyTokenTables:
    """Contingency tables of every (group, token id).

    correct: bool (B,). Tokens of rollouts where ``drop`` (bool (B,)) and token ids in ``ignore``
    are left out of the tables.
    """
    tokens = batch.tokens
    vocab = None
    # One key per token, bit-packed as group | token id | correct | rank of the rollout in its
    # group. Sorting it puts each table's tokens in one run, wrong before correct rollouts, and
    # the tokens of one rollout next to each other.
    rank_bits = max(1, (int(batch.group_sizes.max()) - 1).bit_length())
    group_bits = max(1, (batch.num_groups - 1).bit_length())
    vocab_bits = max(1, int(tokens.max()).bit_length()) if tokens.numel() else 1
    if group_bits + vocab_bits + 1 + rank_bits > KEY_BITS:  # huge ids: densify them first
        vocab, tokens = torch.unique(tokens.long(), return_inverse=True)
        vocab_bits = max(1, (vocab.numel() - 1).bit_length())
    # int32 keys when they fit (a training batch's do): they sort faster and halve the memory
    # every pass below moves.
    key_dtype = torch.int32 if group_bits + vocab_bits + 1 + rank_bits <= 31 else torch.int64
    low_bits = 1 + rank_bits
    prefix = (
        (batch.group_index << (vocab_bits + low_bits))
        | (correct.long() << rank_bits)
        | batch.rank_in_group
    ).to(key_dtype)
    key = batch.per_token(prefix)
    # (the kept rollouts' flags repeated: a pass over bytes, not over the keys)
    keep = batch.per_token(~drop) if drop is not None else None
    if ignore is not None and ignore.numel():
        not_ignored = ~torch.isin(batch.tokens, ignore.to(batch.tokens.dtype))
        keep = not_ignored if keep is None else keep & not_ignored
    # The token ids' bits are 0 in the prefix, so adding them is or-ing them, in one pass and no
    # temporary (a multiply, not <<: the shift has no vectorised CPU kernel).
    key.add_(tokens if tokens.dtype == key_dtype else tokens.to(key_dtype), alpha=1 << low_bits)
    kept_at = None if keep is None else _nonzero(keep)
    k = key.numel() if kept_at is None else kept_at.numel()
    # The arrays of the sorted tokens in one fresh block (huge pages on the CPU): fresh arrays
    # would cost more in page faults than the passes that fill them.
    scratch = _Scratch(
        key.device,
        sorted_key=(k, key_dtype),
        kept_key=(k if kept_at is not None else 0, key_dtype),
        new_pair=(k + 1, torch.bool),
    )
    if kept_at is not None:
        key = torch.index_select(key, 0, kept_at, out=scratch["kept_key"])
    # (the sorted positions outlive the scratch, in the tables: a fresh array of their own)
    sorted_at = fresh((k,), torch.int64, key.device)
    key, sorted_at = torch.sort(key, out=(scratch["sorted_key"], sorted_at))
    # Runs of equal keys are the (table, rollout) pairs, and the tokens are read once more only
    # for where the pairs start: the rest works on the pairs' keys, then on the halves of the
    # tables (group | token | correct), then on the tables, each a fraction of the tokens. A
    # table's counts are differences of the bounds of its runs at each level.
    pair_bound = _run_bounds(key, scratch["new_pair"])  # (R + 1,): tokens, then K
    half = key.index_select(0, pair_bound[:-1]).bitwise_right_shift_(rank_bits)
    half_bound = _run_bounds(half)  # (S + 1,): pairs, then R
    half_key = half.index_select(0, half_bound[:-1])
    table_key = half_key >> 1
    table_bound = _run_bounds(table_key)  # (M + 1,): halves, then S
    # A table's first half holds its wrong rollouts unless its correct bit is set (then it is
    # the only half). Bounds as int32 when they fit: torch's int64 arithmetic is several times
    # slower on the CPU, and every table's count is a few differences of them.
    if k < 2**31:
        pair_bound, half_bound = pair_bound.int(), half_bound.int()
    first = table_bound[:-1]
    table_pair = half_bound.index_select(0, table_bound)
    bounds = _TableBounds(
        pair=pair_bound,
        table_pair=table_pair,
        table_token=pair_bound.index_select(0, table_pair),
        first_end=half_bound[1:].index_select(0, first),
        wrong=half_key.index_select(0, first).bitwise_and_(1).bitwise_xor_(1),
    )
    return KeyTokenTables.compact(
        heads=table_key.index_select(0, first),
        vocab_bits=vocab_bits,
        vocab=vocab,
        bounds=bounds,
        sorted_at=sorted_at,
        kept_at=kept_at,
        num_tokens=batch.num_tokens,
    )


# ---- the per-token statistics diagnostics (why a token got its score: the viewer's table) --------

# Per token, the statistics of its (group, token id) table; a request asks for any of them in
# `return`. Computed only when asked for (each costs a pass over the tokens: one gather).
STATISTICS = (
    "ktae_a",  # correct rollouts containing the token
    "ktae_b",  # wrong rollouts containing it
    "ktae_n_correct",  # |C| of its group
    "ktae_n_wrong",  # |W| of its group
    "ktae_p",  # two-sided Fisher exact p-value of [[a, b], [|C| - a, |W| - b]]
    "ktae_fisher",  # F = exp(-2p), 0 where p is 1
    "ktae_ig",  # information gain in bits
    "ktae_h",  # Cohen's h
    "ktae_tf",  # the term-frequency contrast (0 with tf off)
)
# Those of them that are per group, not per table: repeated per rollout, no table read.
GROUP_STATISTICS = ("ktae_n_correct", "ktae_n_wrong")


def statistics_diagnostics(
    batch: RolloutBatch,
    evaluated: EvaluatedTables | None,
    entry_of_token: torch.Tensor | None,
    totals: torch.Tensor,
    wanted: frozenset[str],
) -> dict[str, torch.Tensor]:
    """The per-token (N,) float32 statistics of :data:`STATISTICS` in ``wanted``, from what
    the score was computed with: ``evaluated`` (its entries' counts, :class:`Association`
    with p, F and IG, and tf contrast) and ``totals`` float64 (G, 4) n_c, n_w, len_c, len_w
    (with history the merged ones). ``entry_of_token``: :meth:`EvaluatedTables.
    entry_of_token` (both None when only |C| and |W| are asked for). A token outside the tables
    (an ignored id, a group without both correct and wrong rollouts) has a = b = 0, p = 1 and
    0 statistics; |C| and |W| are its group's in every case; tables of groups without contrast
    get 0 but for their counts and p = 1."""
    names = [name for name in STATISTICS if name in wanted]
    if not names:
        return {}
    rows: dict[str, torch.Tensor] = {}
    n_c, n_w = totals[:, 0], totals[:, 1]
    for name, column in zip(GROUP_STATISTICS, (n_c, n_w), strict=True):
        if name in wanted:
            # (per rollout, repeated over its tokens: a copy per rollout, no gather)
            rows[name] = batch.per_token(column.float().index_select(0, batch.group_index))
    per_entry = [name for name in names if name not in rows]
    if per_entry:
        assert evaluated is not None and entry_of_token is not None
        parts = evaluated.assoc
        assert parts.p is not None and parts.fisher is not None and parts.ig is not None
        contrast = ((n_c > 0) & (n_w > 0)).index_select(0, evaluated.group)
        values: dict[str, torch.Tensor | None] = {
            "ktae_a": evaluated.a,
            "ktae_b": evaluated.b,
            "ktae_p": parts.p,
            "ktae_fisher": parts.fisher,
            "ktae_ig": parts.ig,
            "ktae_h": parts.h,
            "ktae_tf": evaluated.tf,
        }
        # The per-entry float32 values, each followed by its value at tokens outside the
        # tables, in one block, each gathered by the tokens' entries into a row of one fresh
        # block (fresh memory costs a page fault per page on first touch, which one large
        # allocation, huge pages on the CPU, mostly avoids; the rows are contiguous).
        e = evaluated.group.numel()
        source = fresh((len(per_entry), e + 1), torch.float32, batch.device)
        block = fresh((len(per_entry), batch.num_tokens), torch.float32, batch.device)
        for name, row, out in zip(per_entry, source, block, strict=True):
            rows[name] = out
            per_entry_values = values[name]
            if per_entry_values is None:  # (tf off)
                out.zero_()
                continue
            row[:e].copy_(per_entry_values)
            row[e] = 1.0 if name == "ktae_p" else 0.0
            if name in ("ktae_p", "ktae_tf"):
                row[:e].masked_fill_(~contrast, 1.0 if name == "ktae_p" else 0.0)
            torch.index_select(row, 0, entry_of_token, out=out)
    return {name: rows[name] for name in names}


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
        merged, stored_rows = _merged_counts(tables, prior)
        assoc = _association_with_prior(merged, g, n_c, n_w, params)
        occ_c, occ_w = merged[:, 2].contiguous(), merged[:, 3].contiguous()
        tf = _tf(occ_c, occ_w, g, len_c, len_w, params)
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
    "key_token_score",
    "ktae",
    "table_scores",
    "tabulate",
    "tf_contrast",
]

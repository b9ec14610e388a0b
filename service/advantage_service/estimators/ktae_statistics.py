"""KTAE's statistics (:mod:`.ktae`): Fisher's exact p, the information gain, Cohen's h and the
term-frequency contrast of each contingency table, one small function each; the score of a
table from them, evaluated per table only where a table has several tokens; and the per-token
statistics diagnostics (why a token got its score: the viewer's table).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..batch import RolloutBatch, fresh
from .fisher import fisher_two_sided_grouped, margin_grid
from .ktae_history import HistoryPrior
from .ktae_tables import KeyTokenTables, nonzero_indices

# "p is 1" within float rounding: such a token carries no evidence, so its Fisher factor is 0.
P_IS_ONE = 1.0 - 1e-6
# The reference's floor in the term-frequency ratio; it lets z reach ~1e5 (hence tanh, not exp).
TF_FLOOR = 1e-5
# Floor of divisors and logarithms' arguments (x log x at 0 is then 0 * finite = 0).
TINY = 1e-300
# Information gains below this (bits) are rounding, not information: taken as 0.
IG_ROUNDING = 1e-12


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
    several = nonzero_indices(tables.runs > 1)
    several_cells = tables.cells_at(several)
    # (a, b, occ_c, occ_w) of the single-token tables: (0, 1, 0, 1) and (1, 0, 1, 0)
    single = torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0]], dtype=several_cells.dtype, device=dev)
    single_group = torch.arange(groups, dtype=group.dtype, device=dev).repeat_interleave(2)
    g = torch.cat([single_group, group.index_select(0, several)])
    evaluated_cells = torch.cat([single.repeat(1, groups), several_cells[:4]], 1)
    a, b, occ_c, occ_w = evaluated_cells.double()
    assoc = AssociationGrid(n_c, n_w, params).lookup(g, a, b, parts)
    tf = table_tf(occ_c, occ_w, g, len_c, len_w, params)
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


def table_tf(
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


def merged_counts(tables: KeyTokenTables, prior: HistoryPrior) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (M, 4): each table's a, b, occ_c, occ_w with the prior's added; and int64 (M,)
    where each table's row is in its prompt's stored history (-1: none), for the write."""
    # (the prior's counts of each table, 0 for tokens it lacks)
    merged, rows = prior.lookup_rows(tables.group, tables.token)
    merged[:, 0] += tables.a
    merged[:, 1] += tables.b
    merged[:, 2] += tables.occ_c
    merged[:, 3] += tables.occ_w
    return merged, rows


def association_with_prior(
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

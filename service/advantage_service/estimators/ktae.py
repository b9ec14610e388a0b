"""KTAE: key-token advantage estimation (Sun et al., "KTAE: A Model-Free Algorithm to Key-Tokens
Advantage Estimation in Mathematical Reasoning").

Per group and token id v: how strongly is the presence of v associated with a correct rollout?
The score kt(v) is added to every occurrence of v in the group.

The reference loops over groups and distinct tokens with dense vocabulary-sized arrays. Here one
sort of (group, token, rollout) keys over the whole batch yields every group's contingency tables
at once: runs of equal (group, token) are the tables, and a change of rollout inside a run is one
more rollout containing the token. Everything after the sort is elementwise or a segment sum.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..batch import RolloutBatch
from ..errors import RequestError
from .baselines import group_sum
from .fisher import fisher_two_sided
from .registry import Param, TermContext, TermOutput, register_term

# "p is 1" within float rounding: such a token carries no evidence, so its Fisher factor is 0.
P_IS_ONE = 1.0 - 1e-6
# The reference's floor in the term-frequency ratio; it lets z reach ~1e5 (hence tanh, not exp).
TF_FLOOR = 1e-5

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


def binary_entropy(k: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Entropy in bits of a k-of-n split, 0 log 0 = 0 (and 0 for n = 0)."""
    q = k / n.clamp(min=1e-300)
    r = 1.0 - q

    def plogp(x: torch.Tensor) -> torch.Tensor:
        return torch.where(x > 0, x * torch.log2(x.clamp(min=1e-300)), torch.zeros_like(x))

    return torch.where(n > 0, -(plogp(q) + plogp(r)), torch.zeros_like(q))


def information_gain(
    a: torch.Tensor, b: torch.Tensor, n_c: torch.Tensor, n_w: torch.Tensor
) -> torch.Tensor:
    """IG = H(Y) - H(Y | X) in bits: Y correct/wrong, X token present."""
    n = n_c + n_w
    present, absent = a + b, n - a - b
    h_y = binary_entropy(n_c, n)
    h_y_x = (present * binary_entropy(a, present) + absent * binary_entropy(n_c - a, absent)) / n
    return h_y - h_y_x


def cohens_h(
    a: torch.Tensor, b: torch.Tensor, n_c: torch.Tensor, n_w: torch.Tensor
) -> torch.Tensor:
    """Cohen's h between presence rates in correct and wrong rollouts: the direction."""
    return torch.asin(torch.sqrt((a / n_c).clamp(0, 1))) - torch.asin(
        torch.sqrt((b / n_w).clamp(0, 1))
    )


def tf_saturation(
    occurrences: torch.Tensor, length: torch.Tensor, avg_length: torch.Tensor, k1: float, b: float
) -> torch.Tensor:
    """BM25 term-frequency saturation s = f (k1 + 1) / (f + K), K = k1 (1 - b + b L / avg)."""
    f = torch.where(length > 0, occurrences / length.clamp(min=1e-300), torch.zeros_like(length))
    k = k1 * (1.0 - b + b * length / avg_length)
    return torch.where(f > 0, f * (k1 + 1.0) / (f + k).clamp(min=1e-300), torch.zeros_like(f))


def key_token_score(
    a: torch.Tensor,
    b: torch.Tensor,
    n_c: torch.Tensor,
    n_w: torch.Tensor,
    occ_c: torch.Tensor,
    occ_w: torch.Tensor,
    len_c: torch.Tensor,
    len_w: torch.Tensor,
    p: torch.Tensor,
    params: Mapping[str, Any],
) -> torch.Tensor:
    """kt = scale * tanh(z / 2), z = (w_F F + w_IG IG) x / (w_F + w_IG)  (steps 2-7)."""
    x = cohens_h(a, b, n_c, n_w)
    if params["tf"]:
        avg = (len_c + len_w) / 2.0
        s_c = tf_saturation(occ_c, len_c, avg, params["tf_k1"], params["tf_b"])
        s_w = tf_saturation(occ_w, len_w, avg, params["tf_k1"], params["tf_b"])
        x = x + s_c / (s_w + TF_FLOOR) - s_w / (s_c + TF_FLOOR)
    w_f, w_ig = params["fisher_weight"], params["ig_weight"]
    strength = w_f * fisher_factor(p) + w_ig * information_gain(a, b, n_c, n_w)
    z = strength * x / (w_f + w_ig)
    return params["scale"] * torch.tanh(z / 2.0)


# ---- the batched contingency tables -----------------------------------------------------------


@dataclass
class KeyTokenTables:
    """Contingency counts per (group, token id) present in the batch, float64 (M,) unless noted.

    ``group``/``token``: int64 (M,); ``a``/``b``: correct/wrong rollouts containing the token;
    ``occ_c``/``occ_w``: its occurrences in them. ``positions``: int64 (K,) flat token positions
    that were tabulated, ``table``: int64 (K,) the table each belongs to.
    """

    group: torch.Tensor
    token: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    occ_c: torch.Tensor
    occ_w: torch.Tensor
    positions: torch.Tensor
    table: torch.Tensor


def tabulate(batch: RolloutBatch, correct: torch.Tensor, keep: torch.Tensor) -> KeyTokenTables:
    """Contingency tables of every (group, token id) over the tokens where ``keep`` (bool (N,))."""
    device = batch.device
    positions = torch.nonzero(keep).squeeze(1)
    rollout = batch.rollout_of_token[positions]
    token = batch.tokens[positions].long()
    # One int64 key per token: group | token id | rank of the rollout in its group, bit-packed so
    # that sorting groups equal tables together with their rollouts adjacent inside.
    rank_bits = max(1, int(batch.group_sizes.max()).bit_length())
    vocab_bits = max(1, (int(token.max()) + 1).bit_length() if token.numel() else 1)
    group_bits = max(1, batch.num_groups.bit_length())
    if rank_bits + vocab_bits + group_bits > 62:  # only with huge ids: densify them first
        _, token = torch.unique(token, return_inverse=True)
        vocab_bits = max(1, (int(token.max()) + 1).bit_length())
    group = batch.group_index[rollout]
    key = (group << (vocab_bits + rank_bits)) | (token << rank_bits) | batch.rank_in_group[rollout]
    key, order = torch.sort(key)
    table_key = key >> rank_bits
    new_table = torch.ones_like(key, dtype=torch.bool)
    new_table[1:] = table_key[1:] != table_key[:-1]
    new_rollout = torch.ones_like(new_table)
    new_rollout[1:] = key[1:] != key[:-1]
    table = torch.cumsum(new_table, 0) - 1
    m = int(table[-1]) + 1 if table.numel() else 0
    is_correct = correct[rollout[order]].double()
    contains = new_rollout.double()

    def per_table(weights: torch.Tensor) -> torch.Tensor:
        return torch.zeros(m, dtype=torch.float64, device=device).index_add_(0, table, weights)

    occ = per_table(torch.ones_like(is_correct))
    a = per_table(contains * is_correct)
    occ_c = per_table(is_correct)
    heads = table_key[new_table]
    return KeyTokenTables(
        group=heads >> vocab_bits,
        token=heads & ((1 << vocab_bits) - 1),
        a=a,
        b=per_table(contains) - a,
        occ_c=occ_c,
        occ_w=occ - occ_c,
        positions=positions[order],
        table=table,
    )


@register_term(
    "ktae",
    formula="b_it = scale tanh(z/2), z = (w_F exp(-2p) + w_IG IG) (h + tf) / (w_F + w_IG)",
    paper="Sun et al. 2025, KTAE: A Model-Free Algorithm to Key-Tokens Advantage Estimation",
    params=PARAMS,
    diagnostics=("ktae_score",),
    requires=lambda params: {},
    check=_check,
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
    prior = ctx.ktae_prior
    if prior is not None:
        n_c, n_w, len_c, len_w = (
            n_c + prior.n_c,
            n_w + prior.n_w,
            len_c + prior.len_c,
            len_w + prior.len_w,
        )

    keep = torch.ones(batch.num_tokens, dtype=torch.bool, device=device)
    if ctx.ignore_token_ids is not None and ctx.ignore_token_ids.numel():
        keep &= ~torch.isin(batch.tokens, ctx.ignore_token_ids.to(batch.tokens.dtype))
    if not ctx.collect_ktae_tables:
        # Groups without both correct and wrong rollouts score 0: skip their tokens entirely.
        contrast = (n_c > 0) & (n_w > 0)
        keep &= contrast[batch.group_index][batch.rollout_of_token]

    tables = tabulate(batch, correct, keep)
    a, b, occ_c, occ_w = tables.a, tables.b, tables.occ_c, tables.occ_w
    if prior is not None:
        pa, pb, poc, pow_ = prior.lookup(tables.group, tables.token)
        a, b, occ_c, occ_w = a + pa, b + pb, occ_c + poc, occ_w + pow_
    g = tables.group
    tn_c, tn_w = n_c[g], n_w[g]
    # Decayed history makes counts fractional; the exact test needs whole tables.
    p = fisher_two_sided(
        torch.round(tn_c).long(),
        torch.round(tn_w).long(),
        torch.round(a).long(),
        torch.round(b).long(),
    )
    score = key_token_score(a, b, tn_c, tn_w, occ_c, occ_w, len_c[g], len_w[g], p, params)
    # (+ 0.0 turns tanh(-0) into 0 so JSON shows no negative zeros)
    score = torch.where((tn_c > 0) & (tn_w > 0), score, torch.zeros_like(score)) + 0.0

    bonus = torch.zeros(batch.num_tokens, dtype=torch.float64, device=device)
    bonus[tables.positions] = score[tables.table]
    out = TermOutput(bonus=bonus, diagnostics={"ktae_score": bonus})
    if ctx.collect_ktae_tables:
        out.extras["tables"] = tables
        out.extras["score"] = score
    return out


__all__ = ["PARAMS", "KeyTokenTables", "key_token_score", "ktae", "tabulate"]

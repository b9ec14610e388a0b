"""Tests of the oracle itself (tests/oracle.py), so that it can be trusted as the reference.

Hand-worked examples carry their arithmetic in comments; the expected values are written as
the closed forms derived there.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import oracle
import pytest
from scipy.stats import fisher_exact

# ---------------------------------------------------------------------------------------------
# Fisher exact test
# ---------------------------------------------------------------------------------------------


def _all_tables_with_row_margins_up_to(limit: int):
    for row1 in range(limit + 1):
        for row2 in range(limit + 1):
            for a in range(row1 + 1):
                for c in range(row2 + 1):
                    yield a, row1 - a, c, row2 - c


def test_fisher_p_matches_scipy_on_every_table_with_row_margins_up_to_8():
    mismatches = []
    for a, b, c, d in _all_tables_with_row_margins_up_to(8):
        ours = oracle.fisher_two_sided_p(a, b, c, d)
        theirs = float(fisher_exact([[a, b], [c, d]], alternative="two-sided").pvalue)
        if not math.isclose(ours, theirs, rel_tol=1e-9, abs_tol=1e-12):
            mismatches.append(((a, b, c, d), ours, theirs))
    assert not mismatches, mismatches[:10]


def test_fisher_p_hand_worked_tables():
    # [[2, 0], [0, 2]]: margins 2/2, 2/2; tables x=0,1,2 have probabilities 1/6, 4/6, 1/6;
    # the observed 1/6 and its mirror are at most as likely: p = 1/3.
    assert oracle.fisher_two_sided_p(2, 0, 0, 2) == pytest.approx(1 / 3, rel=1e-15)
    # [[1, 2], [1, 0]]: row margins 3/1, column margins 2/2; x in {1, 2}, each 2/4: p = 1.
    assert oracle.fisher_two_sided_p(1, 2, 1, 0) == 1.0
    # [[3, 0], [0, 3]]: 1/20 each end (comb(6,3) = 20): p = 2/20.
    assert oracle.fisher_two_sided_p(3, 0, 0, 3) == pytest.approx(0.1, rel=1e-15)
    # A zero margin leaves a single table: p = 1.
    assert oracle.fisher_two_sided_p(0, 0, 3, 2) == 1.0
    assert oracle.fisher_two_sided_p(2, 3, 0, 0) == 1.0


def test_fisher_p_is_never_above_one():
    for table in _all_tables_with_row_margins_up_to(6):
        assert 0.0 < oracle.fisher_two_sided_p(*table) <= 1.0


def test_fisher_significance_is_zero_at_p_one_and_exp_minus_2p_below():
    assert oracle.fisher_significance(1.0) == 0.0
    assert oracle.fisher_significance(1.0 - 1e-7) == 0.0
    assert oracle.fisher_significance(0.5) == pytest.approx(math.exp(-1.0))
    assert oracle.fisher_significance(1.0 - 1e-5) == pytest.approx(math.exp(-2.0 * (1 - 1e-5)))


# ---------------------------------------------------------------------------------------------
# Small statistics
# ---------------------------------------------------------------------------------------------


def test_information_gain_hand_worked():
    # Perfect separation: H(Y) = 1 bit, both rows pure: IG = 1.
    assert oracle.information_gain_bits(2, 0, 0, 2) == pytest.approx(1.0)
    # [[1, 2], [1, 0]]: H(Y) = 1; present row 1/3 vs 2/3 has H = 0.918296 bits, weight 3/4;
    # absent row is pure: IG = 1 - 0.75 * 0.918296 = 0.311278.
    h_third = -(1 / 3) * math.log2(1 / 3) - (2 / 3) * math.log2(2 / 3)
    assert oracle.information_gain_bits(1, 2, 1, 0) == pytest.approx(1 - 0.75 * h_third)
    assert oracle.information_gain_bits(1, 2, 1, 0) == pytest.approx(0.311278, abs=1e-6)
    # Independent presence: IG = 0.
    assert oracle.information_gain_bits(1, 1, 1, 1) == pytest.approx(0.0, abs=1e-15)


def test_cohens_h_and_tf_saturation_hand_worked():
    assert oracle.cohens_h(1.0, 0.0) == pytest.approx(math.pi / 2)
    assert oracle.cohens_h(0.5, 1.0) == pytest.approx(-math.pi / 4)
    # f = 2/4 = 0.5, K = 2 (1 - 0.5 + 0.5 * 4/4) = 2: s = 0.5 * 3 / 2.5 = 0.6.
    assert oracle.tf_saturation(2, 4, 4.0, 2.0, 0.5) == pytest.approx(0.6)
    # f = 1/4, K = 2: s = 0.25 * 3 / 2.25 = 1/3.
    assert oracle.tf_saturation(1, 4, 4.0, 2.0, 0.5) == pytest.approx(1 / 3)
    # Length 0 or no occurrence: s = 0 (even where K would be 0 with b = 1).
    assert oracle.tf_saturation(0, 0, 2.0, 2.0, 1.0) == 0.0
    assert oracle.tf_saturation(0, 5, 2.5, 2.0, 0.5) == 0.0


def test_ktae_squash_is_tanh_half_and_saturates_without_overflow():
    assert oracle.ktae_squash(1.0, 1.0) == pytest.approx(2 / (1 + math.exp(-1.0)) - 1)
    assert oracle.ktae_squash(1e5, 2.0) == 2.0
    assert oracle.ktae_squash(-1e5, 1.0) == -1.0


# ---------------------------------------------------------------------------------------------
# KTAE: a 2-correct / 2-wrong group
# ---------------------------------------------------------------------------------------------

# r0 = [5, 7] reward 1 (C), r1 = [5, 8] reward 1 (C), r2 = [8, 9] reward 0 (W),
# r3 = [9, 8] reward 0 (W).
#
# token 5: only in correct rollouts: table [[2, 0], [0, 2]]; p = 1/3, F = exp(-2/3) = 0.513417;
#          IG = 1 bit; h = asin(1) - asin(0) = pi/2.
# token 9: mirror of token 5: [[0, 2], [2, 0]]; F = 0.513417, IG = 1, h = -pi/2.
# token 7: only in r0: [[1, 0], [1, 2]]; tables x = 0, 1 each 2/4: p = 1, F = 0;
#          IG = 1 - 0.75 H(1/3) = 0.311278; h = asin(sqrt(1/2)) = pi/4.
# token 8: in r1, r2, r3: [[1, 2], [1, 0]]; p = 1, F = 0; IG = 0.311278; h = pi/4 - pi/2 = -pi/4.
#
# Without tf: z = (F + IG) x / 2 and kt = tanh(z / 2):
#   token 5: z = (0.513417 + 1) (pi/2) / 2 = 1.188635, kt = 0.532994; token 9: -0.532994.
#   token 7: z = 0.311278 (pi/4) / 2 = 0.122239, kt = 0.061043; token 8: -0.061043.
# With tf (k1 = 2, b = 0.5): L_C = L_W = 4, avg = 4, K_C = K_W = 2.
#   token 5: s_C = (2/4) 3 / (0.5 + 2) = 0.6, s_W = 0: x = pi/2 + 0.6 / 1e-5 = 60001.57: kt = 1.
#   token 7: s_C = (1/4) 3 / 2.25 = 1/3, s_W = 0: x = 33334.1, z = 5188: kt = 1 (F = 0 but IG > 0).
#   token 9: kt = -1 by symmetry.
#   token 8: s_C = 1/3, s_W = 0.6: x = -pi/4 + (1/3)/0.60001 - 0.6/0.3333433
#            = -0.785398 + 0.555546 - 1.799946 = -2.029798; z = 0.311278 x / 2 = -0.315916;
#            kt = tanh(-0.157958) = -0.156657.
# GRPO outcome: mean 0.5, std = sqrt(4 * 0.25 / 3) = 0.577350: a = +-0.5 / 0.577351 = +-0.866024.

KTAE_GROUP = [([5, 7], 1.0), ([5, 8], 1.0), ([8, 9], 0.0), ([9, 8], 0.0)]


def _request(groups, estimator, **extra):
    request = {
        "estimator": estimator,
        "groups": [
            {"id": f"g{k}", "rollouts": [{"tokens": t, "reward": r} for t, r in rollouts]}
            for k, rollouts in enumerate(groups)
        ],
    }
    request.update(extra)
    return request


def _rollouts(response, group=0):
    return response["groups"][group]["rollouts"]


def test_ktae_two_correct_two_wrong_without_tf():
    est = {"outcome": {"name": "grpo"}, "ktae": {"tf": False}}
    out = _rollouts(oracle.reference_compute(_request([KTAE_GROUP], est)))
    kt5 = math.tanh((math.exp(-2 / 3) + 1) * (math.pi / 2) / 2 / 2)
    h_third = -(1 / 3) * math.log2(1 / 3) - (2 / 3) * math.log2(2 / 3)
    ig = 1 - 0.75 * h_third
    kt7 = math.tanh(ig * (math.pi / 4) / 2 / 2)
    assert kt5 == pytest.approx(0.532994, abs=1e-6)
    assert kt7 == pytest.approx(0.061043, abs=1e-6)
    np.testing.assert_allclose(out[0]["ktae_score"], [kt5, kt7], rtol=1e-12)
    np.testing.assert_allclose(out[1]["ktae_score"], [kt5, -kt7], rtol=1e-12)
    np.testing.assert_allclose(out[2]["ktae_score"], [-kt7, -kt5], rtol=1e-12)
    np.testing.assert_allclose(out[3]["ktae_score"], [-kt5, -kt7], rtol=1e-12)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert a == pytest.approx(0.866024, abs=1e-6)
    assert [r["scalar"] for r in out] == pytest.approx([a, a, -a, -a], rel=1e-12)
    np.testing.assert_allclose(out[0]["advantages"], [a + kt5, a + kt7], rtol=1e-12)
    np.testing.assert_allclose(out[3]["advantages"], [-a - kt5, -a - kt7], rtol=1e-12)


def test_ktae_two_correct_two_wrong_with_default_tf():
    out = _rollouts(oracle.reference_compute(_request([KTAE_GROUP], "ktae")))
    h_third = -(1 / 3) * math.log2(1 / 3) - (2 / 3) * math.log2(2 / 3)
    ig = 1 - 0.75 * h_third
    x8 = -math.pi / 4 + (1 / 3) / (0.6 + 1e-5) - 0.6 / (1 / 3 + 1e-5)
    kt8 = math.tanh(ig * x8 / 2 / 2)
    assert x8 == pytest.approx(-2.029798, abs=1e-6)
    assert kt8 == pytest.approx(-0.156657, abs=1e-6)
    np.testing.assert_allclose(out[0]["ktae_score"], [1.0, 1.0], rtol=1e-12)
    np.testing.assert_allclose(out[1]["ktae_score"], [1.0, kt8], rtol=1e-12)
    np.testing.assert_allclose(out[2]["ktae_score"], [kt8, -1.0], rtol=1e-12)
    np.testing.assert_allclose(out[3]["ktae_score"], [-1.0, kt8], rtol=1e-12)


def test_ktae_scale_weights_and_ignored_ids():
    # fisher_weight 0 leaves only IG: token 5 gets tanh(1 * (pi/2) / 2) * 3 without tf;
    # token 7 is ignored and scores 0 (its presence still counts nowhere else).
    est = {
        "outcome": {"name": "dr_grpo"},
        "ktae": {"tf": False, "fisher_weight": 0.0, "ig_weight": 2.0, "scale": 3.0},
    }
    out = _rollouts(oracle.reference_compute(_request([KTAE_GROUP], est, ignore_token_ids=[7])))
    kt5 = 3.0 * math.tanh(1.0 * (math.pi / 2) / 2)
    assert out[0]["ktae_score"][0] == pytest.approx(kt5, rel=1e-12)
    assert out[0]["ktae_score"][1] == 0.0
    # dr_grpo: a = r - 0.5.
    assert out[0]["advantages"][1] == pytest.approx(0.5, rel=1e-12)


def test_ktae_is_zero_when_all_rollouts_are_on_one_side():
    all_correct = [([1, 2], 1.0), ([2, 3], 0.5)]
    with_threshold = [([1, 2], 1.0), ([2, 3], 0.5)]
    out = _rollouts(oracle.reference_compute(_request([all_correct], "ktae")))
    assert all(np.all(r["ktae_score"] == 0.0) for r in out)
    # threshold 0.5: 0.5 is not > 0.5, so r1 is wrong and the group has contrast.
    est = {"outcome": {"name": "grpo"}, "ktae": {"correct_threshold": 0.5}}
    out = _rollouts(oracle.reference_compute(_request([with_threshold], est)))
    assert out[0]["ktae_score"][0] != 0.0


def test_ktae_counts_presence_not_occurrences_in_the_table():
    # Token 4 occurs three times in r0 and once in r2: table [[1, 1], [1, 1]] (not [[3, 1], ...]):
    # p = 1, IG = 0, so z = 0 whatever the tf direction is.
    group = [([4, 4, 4], 1.0), ([6], 1.0), ([4], 0.0), ([6], 0.0)]
    out = _rollouts(oracle.reference_compute(_request([group], "ktae")))
    assert out[0]["ktae_score"].tolist() == [0.0, 0.0, 0.0]
    assert out[2]["ktae_score"].tolist() == [0.0]


def test_ktae_empty_rollouts_count_in_the_table():
    # r1 is empty and correct: token 5 appears in 1 of 2 correct and 0 of 1 wrong rollouts.
    # table [[1, 0], [1, 1]]: x in {0, 1} with probs comb(2,0)comb(1,1)/3 = 1/3 and 2/3;
    # observed x = 1 (2/3) -> p = 1, F = 0. IG = H(2/3) - (2/3) H(1/2) = 0.918296 - 0.666667.
    # h = asin(sqrt(1/2)) - 0 = pi/4. tf off: z = IG (pi/4) / 2.
    group = [([5], 1.0), ([], 1.0), ([9], 0.0)]
    est = {"outcome": {"name": "grpo"}, "ktae": {"tf": False}}
    out = _rollouts(oracle.reference_compute(_request([group], est)))
    ig = -(1 / 3) * math.log2(1 / 3) - (2 / 3) * math.log2(2 / 3) - 2 / 3
    assert out[0]["ktae_score"][0] == pytest.approx(math.tanh(ig * (math.pi / 4) / 4), rel=1e-12)
    assert out[1]["ktae_score"].shape == (0,)
    assert out[1]["advantages"].shape == (0,)


# ---------------------------------------------------------------------------------------------
# Outcome baselines
# ---------------------------------------------------------------------------------------------

# Group [1.0, 0.5, 0.0] with token lengths [1, 2, 3]:
#   mean 0.5, sample std sqrt((0.25 + 0 + 0.25) / 2) = 0.5, sum 1.5.
THREE = [([1], 1.0), ([1, 2], 0.5), ([1, 2, 3], 0.0)]


def _scalars(estimator, groups=(THREE,)):
    response = oracle.reference_compute(_request(list(groups), estimator))
    return [[r["scalar"] for r in g["rollouts"]] for g in response["groups"]]


def test_outcome_baselines_hand_worked():
    s = 0.5 / (0.5 + 1e-6)  # 0.999998
    assert _scalars("grpo")[0] == pytest.approx([s, 0.0, -s], rel=1e-12)
    grpo_raw = {"outcome": {"name": "grpo", "norm_by_std": False}}
    assert _scalars(grpo_raw)[0] == pytest.approx([0.5, 0.0, -0.5])
    assert _scalars("dr_grpo")[0] == pytest.approx([0.5, 0.0, -0.5])
    # rloo: (3 r - 1.5) / 2.
    assert _scalars("rloo")[0] == pytest.approx([0.75, 0.0, -0.75])
    assert _scalars("reinforce")[0] == pytest.approx([1.0, 0.5, 0.0])
    assert _scalars("reinforce_pp_baseline")[0] == pytest.approx([0.5, 0.0, -0.5])
    # opo: b = (1*1 + 2*0.5 + 3*0) / 6 = 1/3.
    assert _scalars("opo")[0] == pytest.approx([2 / 3, 1 / 6, -1 / 3])
    # grpo_passk: best is r0, second 0.5: (1 - 0.5) / (0.5 + 1e-6); others 0.
    assert _scalars("grpo_passk")[0] == pytest.approx([s, 0.0, 0.0], rel=1e-12)
    passk_raw = {"outcome": {"name": "grpo_passk", "norm_by_std": False}}
    assert _scalars(passk_raw)[0] == pytest.approx([0.5, 0.0, 0.0])


def test_gpg_alpha_counts_nonzero_rewards_over_the_whole_request():
    # Groups THREE and [0.0]: B = 4 rollouts, 2 with r != 0: alpha = 2.
    # THREE: 2 (r - 0.5) = [1, 0, -1]; group of one: mean 0, 2 (0 - 0) = 0.
    scal = _scalars("gpg", groups=(THREE, [([7], 0.0)]))
    assert scal[0] == pytest.approx([1.0, 0.0, -1.0])
    assert scal[1] == [0.0]
    # all rewards zero: alpha = B / max(1, 0) = B, times 0.
    assert _scalars("gpg", groups=([([1], 0.0), ([2], 0.0)],)) == [[0.0, 0.0]]


def test_grpo_passk_ties_go_to_the_lowest_index():
    tied = [([1], 0.0), ([1], 1.0), ([2], 1.0)]
    assert _scalars("grpo_passk", groups=(tied,))[0] == [0.0, 0.0, 0.0]
    # [0, 1, 0.25]: best index 1; gap 0.75; mean 5/12, std = sqrt(((5/12)^2 + (7/12)^2
    # + (1/6)^2) / 2) = 0.520416.
    spread = [([1], 0.0), ([1], 1.0), ([2], 0.25)]
    std = math.sqrt(((5 / 12) ** 2 + (7 / 12) ** 2 + (1 / 6) ** 2) / 2)
    assert std == pytest.approx(0.520416, abs=1e-6)
    expected = [0.0, 0.75 / (std + 1e-6), 0.0]
    assert _scalars("grpo_passk", groups=(spread,))[0] == pytest.approx(expected, rel=1e-12)
    with pytest.raises(ValueError):
        _scalars("grpo_passk", groups=([([1], 1.0)],))


def test_group_of_one_conventions():
    one = [([3, 4], 0.7)]
    assert _scalars("grpo", groups=(one,)) == [[pytest.approx(0.7 / (1 + 1e-6), rel=1e-12)]]
    assert _scalars("dr_grpo", groups=(one,)) == [[pytest.approx(0.7)]]
    assert _scalars("rloo", groups=(one,)) == [[0.0]]
    assert _scalars("opo", groups=(one,)) == [[pytest.approx(0.7)]]
    assert _scalars("reinforce_pp_baseline", groups=(one,)) == [[pytest.approx(0.7)]]


def test_opo_all_empty_group_uses_the_plain_mean():
    empty = [([], 1.0), ([], 0.0), ([], 0.5)]
    assert _scalars("opo", groups=(empty,))[0] == pytest.approx([0.5, -0.5, 0.0])


def test_advantage_is_scalar_on_every_token_without_terms():
    response = oracle.reference_compute(_request([THREE], "dr_grpo"))
    advantages = [r["advantages"].tolist() for r in _rollouts(response)]
    assert advantages == [[0.5], [0.0, 0.0], [-0.5, -0.5, -0.5]]


# ---------------------------------------------------------------------------------------------
# Whitening and clipping
# ---------------------------------------------------------------------------------------------


def test_reinforce_pp_baseline_whitens_over_all_tokens():
    # A = [0.5, 0, -0.5] (one token each): mean 0, var (0.25 + 0 + 0.25) / 2 = 0.25.
    group = [([1], 1.0), ([1], 0.5), ([1], 0.0)]
    out = _rollouts(oracle.reference_compute(_request([group], "reinforce_pp_baseline")))
    d = math.sqrt(0.25 + 1e-8)
    assert [r["advantages"][0] for r in out] == pytest.approx([0.5 / d, 0.0, -0.5 / d])
    # the scalar is the pre-whitening a_i
    assert [r["scalar"] for r in out] == pytest.approx([0.5, 0.0, -0.5])


def test_whitening_one_token_gives_zero_and_clip_bounds():
    single = oracle.reference_compute(
        _request([[([1], 3.0)], [([], 2.0)]], {"outcome": {"name": "reinforce"}, "whiten": True})
    )
    assert single["groups"][0]["rollouts"][0]["advantages"].tolist() == [0.0]
    assert single["groups"][1]["rollouts"][0]["advantages"].tolist() == []
    clipped = oracle.reference_compute(
        _request([[([1, 2], 3.0), ([4], -0.2)]], {"outcome": {"name": "reinforce"}, "clip": 1.0})
    )
    out = _rollouts(clipped)
    assert out[0]["advantages"].tolist() == [1.0, 1.0]
    assert out[1]["advantages"].tolist() == [-0.2]


def test_whiten_then_clip_order():
    # A = [2, 0, 0, 0] over 4 tokens: mean 0.5, var (2.25 + 3 * 0.25) / 3 = 1:
    # whitened [1.5, -0.5, -0.5, -0.5] / sqrt(1 + 1e-8); clip 1 -> [1, -0.5, -0.5, -0.5].
    est = {"outcome": {"name": "reinforce"}, "whiten": True, "clip": 1.0}
    response = oracle.reference_compute(_request([[([1], 2.0), ([1, 2, 3], 0.0)]], est))
    out = _rollouts(response)
    d = math.sqrt(1 + 1e-8)
    assert out[0]["advantages"].tolist() == [1.0]
    assert out[1]["advantages"] == pytest.approx([-0.5 / d] * 3)


# ---------------------------------------------------------------------------------------------
# CSCR and OPSD
# ---------------------------------------------------------------------------------------------


def test_cscr_weights_hand_worked():
    # s = [0, 0.15]: u0 = 1 (below onset); u1 = 1 - 0.2 (1 - exp(-10 * 0.1)) = 0.873576;
    # w = 2 u / 1.873576 = [1.067477, 0.932523].
    w = oracle.cscr_exp_onset_weights(np.array([0.0, 0.15]), 0.05, 10.0, 0.2)
    np.testing.assert_allclose(w, [1.067477, 0.932523], atol=1e-6)
    # gamma = 1 and every token saturated: u -> 0 only in the limit; with s huge u underflows
    # to exactly 0 and w falls back to 1.
    w = oracle.cscr_exp_onset_weights(np.array([1e6, 1e6]), 0.0, 10.0, 1.0)
    assert w.tolist() == [1.0, 1.0]


def test_cscr_preserves_budget_and_sign_on_random_requests():
    rng = np.random.default_rng(1234)
    for _ in range(40):
        est = {
            "outcome": {"name": str(rng.choice(["grpo", "rloo", "reinforce"]))},
            "cscr": {"strength": float(rng.uniform(0, 1)), "decay": float(rng.uniform(0, 30))},
        }
        response = oracle.reference_compute(oracle.random_request(rng, estimator=est))
        for group in response["groups"]:
            for r in group["rollouts"]:
                t = len(r["advantages"])
                assert np.all(r["cscr_weight"] > 0)
                assert float(np.sum(r["cscr_weight"])) == pytest.approx(t, rel=1e-12, abs=1e-12)
                assert float(np.sum(r["advantages"])) == pytest.approx(
                    t * r["scalar"], rel=1e-12, abs=1e-12
                )
                if t:
                    below = r["sensitivity"] <= est["cscr"].get("onset", 0.05)
                    if np.any(below):
                        shared = r["cscr_weight"][below]
                        assert np.all(shared == shared[0])
                        assert shared[0] == pytest.approx(r["cscr_weight"].max(), rel=1e-15)


def test_cscr_strength_zero_gives_the_outcome_unchanged():
    rng = np.random.default_rng(7)
    est = {"outcome": {"name": "grpo"}, "cscr": {"strength": 0.0}}
    response = oracle.reference_compute(oracle.random_request(rng, estimator=est))
    for group in response["groups"]:
        for r in group["rollouts"]:
            assert np.all(r["cscr_weight"] == 1.0)
            assert np.all(r["advantages"] == r["scalar"])


def test_opsd_hand_worked():
    # d = teacher - student = [-0.5 + 1, -3 + 2] = [0.5, -1]; clip 0.8 -> [0.5, -0.8];
    # coef 2: bonus [1.0, -1.6]; reinforce a = 0.25: A = [1.25, -1.35].
    request = {
        "estimator": {"outcome": {"name": "reinforce"}, "opsd": {"coef": 2.0, "clip": 0.8}},
        "groups": [
            {
                "id": "p",
                "rollouts": [oracle.rollout([1, 2], 0.25, [-1.0, -2.0], pos=[-0.5, -3.0])],
            }
        ],
    }
    out = _rollouts(oracle.reference_compute(request))[0]
    assert out["opsd_reward"].tolist() == [0.5, -0.8]
    assert out["advantages"] == pytest.approx([1.25, -1.35])


# ---------------------------------------------------------------------------------------------
# resolve_estimator
# ---------------------------------------------------------------------------------------------


def doc_example() -> dict:
    """The resolved object docs/estimator-config.md shows first (every term on)."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "estimator-config.md").read_text()
    return json.loads(doc.split("```json\n", 1)[1].split("```", 1)[0])


DOC_EXAMPLE = doc_example()
# What a spec naming only the KTAE, CSCR and OPSD terms resolves to: the token-level terms off.
FULL_DOC_EXAMPLE = {**DOC_EXAMPLE, "forking": None, "hicra": None}
# grpo's scaling parameters at their defaults (the std's and the mean's scopes, ...).
GRPO_SCALING = {
    k: v
    for k, v in oracle.OUTCOME_PARAM_DEFAULTS["grpo"].items()
    if k not in ("norm_by_std", "epsilon")
}


def test_resolve_estimator_fills_every_default():
    spec = {"outcome": {"name": "grpo"}, "ktae": {}, "cscr": True, "opsd": {}}
    assert oracle.resolve_estimator(spec) == FULL_DOC_EXAMPLE


@pytest.mark.parametrize("preset", oracle.PRESETS)
def test_resolve_estimator_presets(preset):
    resolved = oracle.resolve_estimator(preset)
    assert set(resolved) == {
        "outcome",
        "ktae",
        "cscr",
        "opsd",
        "forking",
        "hicra",
        "whiten",
        "clip",
    }
    assert resolved["forking"] is resolved["hicra"] is None
    assert resolved["clip"] is None
    if preset in oracle.TERM_PRESETS:
        assert resolved["outcome"] == FULL_DOC_EXAMPLE["outcome"]
        for term in oracle.TERM_PRESETS:
            expected = FULL_DOC_EXAMPLE[term] if term == preset else None
            assert resolved[term] == expected
    else:
        assert resolved["outcome"]["name"] == preset
        assert resolved["ktae"] is resolved["cscr"] is resolved["opsd"] is None
    assert resolved["whiten"] is (preset == "reinforce_pp_baseline")
    if preset in ("grpo", "grpo_passk"):
        scope = GRPO_SCALING if preset == "grpo" else {}
        assert resolved["outcome"] == {
            "name": preset,
            "norm_by_std": True,
            "epsilon": 1e-6,
            **scope,
        }
    elif preset not in oracle.TERM_PRESETS:
        assert resolved["outcome"] == {"name": preset}


def test_resolve_estimator_token_presets():
    forking = oracle.resolve_estimator("forking")
    assert forking["outcome"] == FULL_DOC_EXAMPLE["outcome"]
    assert forking["forking"] == DOC_EXAMPLE["forking"] == {"rho": 0.2, "scope": "request"}
    assert forking["ktae"] is forking["cscr"] is forking["opsd"] is None
    otb = oracle.resolve_estimator("otb")
    assert otb["outcome"] == {"name": "otb", "epsilon": 1e-8, "handle_zero_tail": True}
    assert otb["forking"] is None
    composed = oracle.resolve_estimator({"outcome": "otb", "forking": {"rho": 1}})
    assert composed["forking"] == {"rho": 1.0, "scope": "request"}
    hicra = oracle.resolve_estimator("hicra")
    assert hicra["outcome"] == FULL_DOC_EXAMPLE["outcome"]
    assert hicra["hicra"] == DOC_EXAMPLE["hicra"] == {"alpha": 0.2, "phrases": None}
    assert oracle.resolve_estimator("maxrl")["outcome"] == {"name": "maxrl", "epsilon": 0.0}
    shaping = {"alpha1": 1.0, "alpha2": 0.1, "correct_threshold": 0.0, "epsilon": 1e-6}
    gtpo = {"name": "gtpo", **shaping, "scope": "group"}
    assert oracle.resolve_estimator("gtpo")["outcome"] == gtpo
    assert oracle.resolve_estimator("grpo_s")["outcome"] == {"name": "grpo_s", **shaping}


def test_reference_compute_otb_and_forking_follow_their_group_oracles():
    """reference_compute's OTB is otb_group's a_it in place of a_i (scalar: the mean a_it,
    0 when empty), and its forking mask, applied last, is forking_masks'."""
    rng = np.random.default_rng(4)
    request = oracle.random_request(
        rng, estimator={"outcome": "otb", "forking": {"rho": 0.5}}, is_weights=True
    )
    out = oracle.reference_compute(request)
    groups = [g["rollouts"] for g in request["groups"]]
    masks = oracle.forking_masks(groups, 0.5, "request")
    for rollouts, got, group_masks in zip(groups, out["groups"], masks, strict=True):
        per_rollout = zip(oracle.otb_group(rollouts), got["rollouts"], group_masks, strict=True)
        for (baseline, a), r, mask in per_rollout:
            np.testing.assert_array_equal(r["otb_baseline"], baseline)
            np.testing.assert_array_equal(r["advantages"], a * mask)
            assert r["scalar"] == (float(np.mean(a)) if a.size else 0.0)


def test_resolve_estimator_partial_objects():
    resolved = oracle.resolve_estimator(
        {"outcome": {"name": "rloo"}, "cscr": {"strength": 0.5}, "clip": 2}
    )
    assert resolved["outcome"] == {"name": "rloo"}
    assert resolved["cscr"] == {**FULL_DOC_EXAMPLE["cscr"], "strength": 0.5}
    assert resolved["ktae"] is None and resolved["opsd"] is None
    assert resolved["whiten"] is False and resolved["clip"] == 2.0
    pp = oracle.resolve_estimator({"outcome": {"name": "reinforce_pp_baseline"}})
    assert pp["whiten"] is True
    pp_off = oracle.resolve_estimator(
        {"outcome": {"name": "reinforce_pp_baseline"}, "whiten": False}
    )
    assert pp_off["whiten"] is False
    grpo = oracle.resolve_estimator({"outcome": {"name": "grpo", "norm_by_std": False}})
    assert grpo["outcome"] == {
        "name": "grpo",
        "norm_by_std": False,
        "epsilon": 1e-6,
        **GRPO_SCALING,
    }


@pytest.mark.parametrize(
    "spec",
    [
        "nope",
        {"outcome": {"name": "rloo", "epsilon": 1e-6}},
        {"outcome": {"name": "grpo"}, "ktae": {"alpha": 1}},
        {"outcome": {"name": "grpo"}, "extra": 1},
        {"outcome": {"name": "otb", "norm_by_std": True}},
        {"forking": {"quantile": 0.2}},
    ],
)
def test_resolve_estimator_rejects_unknown_names_and_parameters(spec):
    with pytest.raises(ValueError):
        oracle.resolve_estimator(spec)


def test_random_request_shapes_are_valid():
    rng = np.random.default_rng(0)
    est = {"outcome": {"name": "grpo"}, "cscr": {}, "opsd": {}, "ktae": {}}
    for _ in range(20):
        request = oracle.random_request(rng, estimator=est)
        for group in request["groups"]:
            for r in group["rollouts"]:
                t = len(r["tokens"])
                assert len(r["logprobs"]) == t and max(r["logprobs"], default=0.0) <= 0.0
                for name in ("pos", "neg"):
                    values = r["teacher_logprobs"][name]
                    assert len(values) == t and max(values, default=0.0) <= 0.0
        oracle.reference_compute(request)


# ---------------------------------------------------------------------------------------------
# MaxRL, GTPO, GRPO-S, HICRA
# ---------------------------------------------------------------------------------------------


def test_maxrl_oracle_hand_worked():
    # K = 1 of 4: p = 1/4, (1 - 1/4) / (1/4) = 3 = (N - K) / K; (0 - 1/4) / (1/4) = -1
    assert oracle.outcome_maxrl([1.0, 0.0, 0.0, 0.0], 0.0) == [3.0, -1.0, -1.0, -1.0]
    assert oracle.outcome_maxrl([0.0, 0.0], 0.0) == [0.0, 0.0]
    assert oracle.outcome_maxrl([1.0, 1.0], 0.0) == [0.0, 0.0]
    assert oracle.outcome_maxrl([0.7], 0.0) == [0.0]
    with pytest.raises(ValueError):
        oracle.outcome_maxrl([1.0, -1.0], 0.0)


def test_entropy_shares_hand_worked():
    assert oracle.entropy_shares([1.0, 3.0], inverse=False) == [0.25, 0.75]
    assert oracle.entropy_shares([0.0, 0.0], inverse=False) == [0.5, 0.5]
    # inverse: 1/1, 1/3 (sum 4/3) -> 3/4, 1/4; with zeros, the zeros share
    assert oracle.entropy_shares([1.0, 3.0], inverse=True) == pytest.approx([0.75, 0.25])
    assert oracle.entropy_shares([0.0, 2.0, 0.0], inverse=True) == [0.5, 0.0, 0.5]


def test_gtpo_oracle_hand_worked():
    """Two correct rollouts (entropies 1, 3 and 3) and one wrong (entropy 2). t = 0: O+ shares
    1/4, 3/4 of d = 2 -> 1.05, 1.15; t = 1: the first rollout alone, share 1 -> 1.1; the wrong
    one alone: -1.1. Eq. 6 normalises each class over its own tokens: R+ = (1.05, 1.1, 1.15),
    mean 1.1, sample std 0.05 -> -1, 0, 1; R- = (-1.1,): one value, 0."""
    group = [
        {"reward": 1.0, "entropy": [1.0, 3.0]},
        {"reward": 1.0, "entropy": [3.0]},
        {"reward": 0.0, "entropy": [2.0]},
    ]
    (shaped_a, adv_a), (shaped_b, adv_b), (shaped_w, adv_w) = oracle.gtpo_group(group, epsilon=0.0)
    assert shaped_a.tolist() == pytest.approx([1.05, 1.1]) and shaped_b.tolist() == [1.15]
    assert shaped_w.tolist() == pytest.approx([-1.1])
    assert adv_a.tolist() == pytest.approx([-1.0, 0.0], abs=1e-9)
    assert adv_b.tolist() == pytest.approx([1.0])
    assert adv_w.tolist() == [0.0]
    # no contrast: 0
    same = oracle.gtpo_group([group[0], {"reward": 2.0, "entropy": [1.0]}])
    assert all(np.all(a == 0.0) for _, a in same)


def test_grpo_s_oracle_hand_worked():
    """Mean entropies 1 and 3 (correct): shares 1/4, 3/4 of 2 -> 1.05, 1.15; one wrong: -1.1;
    normalised as GRPO over the group's 3 rollouts."""
    group = [
        {"reward": 1.0, "entropy": [0.5, 1.5]},
        {"reward": 1.0, "entropy": [3.0]},
        {"reward": 0.0, "entropy": [4.0, 4.0]},
    ]
    result = oracle.grpo_s_group(group, epsilon=0.0)
    assert [r for r, _ in result] == pytest.approx([1.05, 1.15, -1.1])
    pool = np.array([1.05, 1.15, -1.1])
    expected = (pool - pool.mean()) / pool.std(ddof=1)
    assert [a for _, a in result] == pytest.approx(expected.tolist())


def test_hicra_oracle_hand_worked():
    out = oracle.hicra_amplify(np.array([2.0, -2.0, 2.0, -2.0]), [1, 1, 0, 0], 0.25)
    assert out.tolist() == [2.5, -1.5, 2.0, -2.0]

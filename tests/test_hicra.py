"""HICRA (estimators/hicra.py): A_it + alpha |A_it| m_it on the combined advantage, after
whitening and clipping and before the forking mask, with any outcome and term; its properties
(hypothesis: more credit, less blame, signs kept); and the planning mask found from strategic
phrases in decoded token text (a server with a tokenizer), in-process."""

from __future__ import annotations

from typing import Any

import numpy as np
import oracle
import pytest
import torch
from advantage_service import RequestError, RolloutBatch, compute, compute_batch
from advantage_service.estimators import resolve_estimator
from advantage_service.estimators.hicra import (
    DEFAULT_PHRASES,
    phrase_words,
    strategic_phrase_mask,
)
from advantage_service.estimators.pipeline import derive_inputs
from hypothesis import given, settings
from hypothesis import strategies as st
from token_cases import token_request

SETTINGS = settings(max_examples=60, deadline=None)


def amplified(advantages: np.ndarray, mask: np.ndarray, alpha: float) -> np.ndarray:
    """a + alpha |a| m in float64."""
    a = advantages.astype(np.float64)
    return a + alpha * np.abs(a) * mask


def flat(response: dict[str, Any], key: str) -> np.ndarray:
    return np.concatenate(
        [np.atleast_1d(r[key]) for g in response["groups"] for r in g["rollouts"]]
    ).astype(np.float64)


def test_hicra_with_grpo_is_a_plus_alpha_abs_a_on_planning_tokens() -> None:
    request = token_request("hicra", ["scalar", "planning_mask"])
    out = compute(request, device="cpu")
    for g_out, g_in in zip(out["groups"], request["groups"], strict=True):
        for r_out, r_in in zip(g_out["rollouts"], g_in["rollouts"], strict=True):
            a = float(r_out["scalar"])  # GRPO's a_i: the outcome is untouched
            m = np.asarray(r_in["planning_mask"])
            np.testing.assert_allclose(r_out["advantages"], a + 0.2 * abs(a) * m, rtol=1e-7)
            np.testing.assert_array_equal(r_out["planning_mask"], m)
    grpo = compute(token_request("grpo"), device="cpu")
    assert [r["scalar"] for g in out["groups"] for r in g["rollouts"]] == [
        r["scalar"] for g in grpo["groups"] for r in g["rollouts"]
    ]


OUTCOMES = ["grpo", "dr_grpo", "rloo", "reinforce", "opo", "gpg", "grpo_passk", "otb"]
OUTCOMES += ["maxrl", "gtpo", "grpo_s", "reinforce_pp_baseline"]


@pytest.mark.parametrize("outcome", OUTCOMES)
@pytest.mark.parametrize("alpha", [0.2, 1.0])
def test_hicra_amplifies_whatever_the_outcome_and_terms_gave(outcome: str, alpha: float) -> None:
    """Composed with any outcome (and KTAE, CSCR, whitening, clipping), HICRA's answer is the
    estimator's answer without it, amplified on the planning tokens."""
    base: dict[str, Any] = {"outcome": outcome, "ktae": {}, "cscr": {}, "clip": 0.75}
    if outcome == "grpo_passk":
        base["whiten"] = True
    rng = np.random.default_rng(len(outcome))
    request = oracle.random_request(
        rng,
        estimator={**base, "hicra": {"alpha": alpha}},
        n_groups=(2, 4),
        group_size=(2, 6),
        entropy=True,
        sum_pi_squared=True,
        logprobs=True,
        planning_mask=True,
    )
    with_hicra = compute(request, device="cpu")
    without = compute({**request, "estimator": base, "return": ["scalar"]}, device="cpu")
    mask = flat(with_hicra, "planning_mask")
    expected = amplified(flat(without, "advantages"), mask, alpha)
    np.testing.assert_allclose(flat(with_hicra, "advantages"), expected, rtol=1e-6, atol=1e-7)


def test_hicra_applies_after_whitening_and_clipping_and_before_the_forking_mask() -> None:
    base = {"outcome": "otb", "ktae": {}, "whiten": True, "clip": 0.75}
    request = token_request({**base, "hicra": {"alpha": 0.5}, "forking": {"rho": 0.5}})
    request["return"] = ["forking_mask", "planning_mask"]
    out = compute(request, device="cpu")
    plain = compute(token_request(base), device="cpu")
    keep = flat(out, "forking_mask") == 1.0
    expected = amplified(flat(plain, "advantages"), flat(out, "planning_mask"), 0.5)
    got = flat(out, "advantages")
    np.testing.assert_allclose(got[keep], expected[keep], rtol=1e-6)
    assert np.all(got[~keep] == 0.0)
    # Clipping bounds what HICRA is given, not its answer: a planning token at the bound grows.
    assert np.max(np.abs(flat(plain, "advantages"))) == pytest.approx(0.75)
    assert np.max(np.abs(got)) == pytest.approx(0.75 * 1.5)


def test_hicra_bonus_is_what_hicra_added_before_the_forking_mask() -> None:
    base = {"outcome": "grpo", "ktae": {}, "whiten": True}
    request = token_request({**base, "hicra": {"alpha": 0.5}, "forking": {"rho": 0.5}})
    request["return"] = ["hicra_bonus", "planning_mask", "forking_mask"]
    out = compute(request, device="cpu")
    plain = flat(compute(token_request(base), device="cpu"), "advantages")
    bonus = flat(out, "hicra_bonus")
    np.testing.assert_allclose(bonus, 0.5 * np.abs(plain) * flat(out, "planning_mask"), rtol=1e-6)
    keep = flat(out, "forking_mask") == 1.0
    np.testing.assert_allclose(flat(out, "advantages")[keep], (plain + bonus)[keep], rtol=1e-6)
    assert np.any(bonus[~keep] != 0.0)  # the mask zeroes a token after HICRA gave it a bonus
    # Asked for or not, the advantages are the same.
    del request["return"]
    np.testing.assert_array_equal(
        flat(compute(request, device="cpu"), "advantages"), flat(out, "advantages")
    )


def test_hicra_with_alpha_zero_changes_nothing() -> None:
    request = token_request({"outcome": "rloo", "ktae": {}, "hicra": {"alpha": 0}})
    out = compute(request, device="cpu")
    plain = compute(token_request({"outcome": "rloo", "ktae": {}}), device="cpu")
    np.testing.assert_array_equal(flat(out, "advantages"), flat(plain, "advantages"))


@st.composite
def planned_batches(draw):
    sizes = [draw(st.integers(1, 5)) for _ in range(draw(st.integers(1, 3)))]
    lengths = [draw(st.integers(0, 8)) for _ in range(sum(sizes))]
    n = sum(lengths)
    return RolloutBatch.from_flat(
        tokens=np.zeros(n, dtype=np.int32),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        group_ids=[f"g{i}" for i in range(len(sizes))],
        group_index=np.repeat(np.arange(len(sizes)), sizes),
        rewards=np.array([draw(st.floats(-2, 2, width=32)) for _ in lengths], dtype=np.float32),
        planning_mask=np.array(
            draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=n, max_size=n)), dtype=np.float32
        ),
    )


@SETTINGS
@given(planned_batches(), st.floats(0.0, 0.99))
def test_hicra_gives_planning_tokens_more_credit_and_less_blame_keeping_signs(batch, alpha):
    base = compute_batch(batch, "grpo").advantages.double()
    out = compute_batch(batch, {"hicra": {"alpha": alpha}}).advantages.double()
    m = batch.planning_mask.bool()  # type: ignore[union-attr]
    assert torch.equal(out[~m], base[~m])  # execution tokens keep their advantage
    # (Values below float32's normal range, 1.18e-38, keep fewer bits than rtol asks and may
    # round to 0 once scaled by 1 - alpha: the properties are those of normal numbers.)
    normal = base.abs() >= torch.finfo(torch.float32).tiny
    pos, neg = m & (base > 0) & normal, m & (base < 0) & normal
    torch.testing.assert_close(out[pos], base[pos] * (1 + alpha), rtol=1e-6, atol=0)
    torch.testing.assert_close(out[neg], base[neg] * (1 - alpha), rtol=1e-6, atol=1e-7)
    assert torch.all(torch.sign(out[normal]) == torch.sign(base[normal]))
    assert torch.all(out >= base)  # never less credit, never more blame


# ---- the planning mask from strategic phrases ----------------------------------------------------

# A vocabulary with spaces, as a byte-level BPE decodes single ids: id -> text.
WORDS = [
    "<unk>",
    "So",
    " wait",
    ",",
    " let",
    " me",
    " check",
    " the",
    " sum",
    ".",
    "Wait",
    "await",
    "\n",
    " double",
    "-",
    "check",
    " hmm",
    " x",
    " =",
    " 4",
    " may",
    " be",
    " waiting",
    "'s",
    " ",
    "wait ",
]
ID = {w: i for i, w in enumerate(WORDS)}


def ids(*words: str) -> list[int]:
    return [ID[w] for w in words]


def mask_of(
    rollouts: list[list[int]],
    phrases: tuple[str, ...] = DEFAULT_PHRASES,
    vocabulary: list[str] = WORDS,
) -> list[list[int]]:
    tokens = np.array([t for r in rollouts for t in r], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum([len(r) for r in rollouts])]).astype(np.int64)
    mask = strategic_phrase_mask(tokens, offsets, vocabulary, phrases)
    return [mask[offsets[i] : offsets[i + 1]].astype(int).tolist() for i in range(len(rollouts))]


ONE_PASS = [
    {"hicra": {"alpha": 0.3}},  # broadcast and amplified in one pass
    {"hicra": {"alpha": 0.7}, "clip": 0.4},  # clipped a_i, then the same
    {"outcome": "rloo", "hicra": {"alpha": 0.3}, "whiten": True},  # amplified in place
]


@SETTINGS
@given(planned_batches(), st.sampled_from(ONE_PASS))
def test_hicra_one_pass_loops_give_torchs_bits(batch, estimator):
    """On the CPU HICRA runs as one compiled pass (while a_i is broadcast, or in place after
    whitening); its answer is, bit for bit, torch's A + alpha |A| m on the answer without
    HICRA, and the answer of the path that also returns what HICRA added."""
    alpha = estimator["hicra"]["alpha"]
    without = compute_batch(batch, {k: v for k, v in estimator.items() if k != "hicra"})
    expected = without.advantages.clone()
    expected.addcmul_(expected.abs(), batch.planning_mask, value=alpha)
    got = compute_batch(batch, estimator)
    assert torch.equal(got.advantages, expected)
    with_bonus = compute_batch(batch, estimator, diagnostics=("hicra_bonus",))
    assert torch.equal(with_bonus.advantages, expected)
    assert torch.equal(got.scalars, without.scalars)


def test_the_default_phrases_are_the_papers_strategic_grams() -> None:
    """Listing 1 of arXiv 2509.03646v3, Appendix A: 249 lower-case entries, its first and last
    ones, and entries with punctuation kept as the listing has them."""
    assert len(DEFAULT_PHRASES) == 249 == len(set(DEFAULT_PHRASES))
    assert DEFAULT_PHRASES[:2] == ("## step", "a good starting point is")
    assert DEFAULT_PHRASES[-3:] == ("which means", "will consider the", "work our way")
    for entry in ("hmm,", "let's", "wait, that's not right", "what am i missing?", "so, yes"):
        assert entry in DEFAULT_PHRASES
    assert "hmm" not in DEFAULT_PHRASES and "wait," not in DEFAULT_PHRASES
    assert all(p == p.strip() == p.lower() for p in DEFAULT_PHRASES)


def test_phrase_mask_marks_every_token_of_a_multi_token_phrase_whatever_case() -> None:
    rollout = ids("So", " wait", ",", " let", " me", " check", " the", " sum", ".")
    # "so", "wait", "let me": the paper's grams; "wait," is not one, "let me check" neither
    assert mask_of([rollout]) == [[1, 1, 0, 1, 1, 0, 0, 0, 0]]
    assert mask_of([ids("Wait", ",", " x")]) == [[1, 0, 0]]  # "Wait": case is ignored
    assert mask_of([rollout], ("let me check", "the sum.")) == [[0, 0, 0, 1, 1, 1, 1, 1, 1]]


def test_phrase_mask_matches_whole_tokens_only() -> None:
    # "await" contains "wait" but is one token that is not the phrase; " waiting" begins with it
    assert mask_of([ids("await", " x", " =", " 4")]) == [[0, 0, 0, 0]]
    assert mask_of([ids(" waiting", " x")]) == [[0, 0]]
    # whitespace at a token's ends is no part of the phrase: "wait " is the gram "wait"
    assert mask_of([ids("wait ", " x"), ids(" ", " wait", " ")]) == [[1, 0], [0, 1, 0]]


def test_phrase_mask_punctuation_belongs_to_the_phrase() -> None:
    # "hmm," is the paper's gram, "hmm" alone is not
    assert mask_of([ids(" hmm", ",", " x"), ids(" hmm", " x"), ids(" hmm", ".")]) == [
        [1, 1, 0], [0, 0], [0, 0]
    ]  # fmt: skip
    # "let's": the apostrophe's token joins the word's
    assert mask_of([ids(" let", "'s", " x")]) == [[1, 1, 0]]


def test_phrase_mask_a_space_matches_whitespace_or_a_token_boundary_and_only_there() -> None:
    # " may", " be" is two words: not the gram "maybe"; "let me" across a newline token
    assert mask_of([ids(" may", " be")], ("maybe",)) == [[0, 0]]
    assert mask_of([ids(" hmm", "\n", " let", " me", " check")], ("hmm let me",)) == [
        [1, 1, 1, 1, 0]
    ]
    # "double-check" over three tokens, no whitespace inside
    assert mask_of([ids(" double", "-", "check", " x")], ("double-check",)) == [[1, 1, 1, 0]]
    assert mask_of([ids(" double", " ", "-", "check")], ("double-check",)) == [[0, 0, 0, 0]]
    # A tokenizer whose lone tokens decode without their spaces (word-level, SentencePiece)
    # leaves only the token boundary between words: "let", "me" is "let me" (and "may", "be"
    # is "maybe": the text cannot tell them apart).
    bare = ["let", "me", "check", "may", "be"]
    assert mask_of([[0, 1, 2]], ("let me",), bare) == [[1, 1, 0]]
    assert mask_of([[3, 4]], ("maybe",), bare) == [[1, 1]]
    # A space of the phrase needs whitespace or a boundary: one token "letme" is not "let me"
    assert mask_of([[0]], ("let me",), ["letme"]) == [[0]]


def test_phrase_mask_never_spans_two_rollouts_and_skips_empty_ones() -> None:
    rollouts = [ids(" let", " me"), [], ids(" check", " x"), ids(" let", " me", " check")]
    assert mask_of(rollouts) == [[1, 1], [], [0, 0], [1, 1, 0]]
    assert mask_of(rollouts, ("let me check",)) == [[0, 0], [], [0, 0], [1, 1, 1]]
    # ("check" alone is not a default phrase; a request's own phrases may make it one)
    assert mask_of(rollouts, ("check",)) == [[0, 0], [], [1, 0], [0, 0, 1]]


def test_phrase_mask_ids_past_the_vocabulary_have_no_text() -> None:
    """An id the tokenizer does not know decodes to nothing: a phrase spans it as it spans a
    whitespace token."""
    tokens = np.array([ID[" let"], 999, ID[" me"], ID[" check"], 999], dtype=np.int64)
    mask = strategic_phrase_mask(tokens, np.array([0, 5]), WORDS, ("let me check",))
    assert mask.tolist() == [1.0, 1.0, 1.0, 1.0, 0.0]
    assert strategic_phrase_mask(tokens, np.array([0, 5]), WORDS).tolist() == [1, 1, 1, 0, 0]
    assert strategic_phrase_mask(tokens[:0], np.array([0]), WORDS).tolist() == []


def reference_mask(
    rollouts: list[list[int]], vocabulary: list[str], phrases: tuple[str, ...]
) -> list[int]:
    """The mask by brute force over characters: every phrase tried at every token start."""
    out: list[int] = []
    for rollout in rollouts:
        texts = [
            vocabulary[t].lower().replace("\u2019", "'") if 0 <= t < len(vocabulary) else ""
            for t in rollout
        ]
        chars = [(c, k) for k, text in enumerate(texts) for c in text]  # (char, its token)
        marked = [0] * len(rollout)
        for k, text in enumerate(texts):
            lead = len(text) - len(text.lstrip())
            if lead == len(text):
                continue  # a phrase starts at a token's first non-space character
            s = sum(len(t) for t in texts[:k]) + lead
            for phrase in phrases:
                end = match_at(chars, s, phrase.lower().replace("\u2019", "'").split())
                if end is not None:
                    for j in range(chars[s][1], chars[end][1] + 1):
                        marked[j] = 1
        out += marked
    return out


def match_at(chars: list[tuple[str, int]], s: int, words: list[str]) -> int | None:
    """The position of the phrase's last character if it matches from ``s``, else None."""
    i = s
    for w, word in enumerate(words):
        if w:  # a space: whitespace, a token boundary or both
            j = i
            while j < len(chars) and chars[j][0].isspace():
                j += 1
            if j == len(chars) or (j == i and chars[j][1] == chars[i - 1][1]):
                return None
            i = j
        for c in word:  # adjacent characters, token boundaries allowed
            if i == len(chars) or chars[i][0] != c:
                return None
            i += 1
    last = i - 1
    rest = [c for c, k in chars[i:] if k == chars[last][1]]
    return last if all(c.isspace() for c in rest) else None  # the phrase ends its token


PIECES = [" let", "let", " me", "me", "'s", " wait", "Wait", ",", " but", "but", " so", "so",
          " ", "\n", " \n", "-", "check", " check", "ing", "?", " hmm", " may", " be", "be ",
          "\u2019s", " step", " by", "##", " ##",
          "letme", "maybe"]  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.lists(st.integers(-1, len(PIECES)), max_size=12), min_size=1, max_size=4),
    st.sampled_from(["defaults", "own"]),
)
def test_phrase_mask_equals_a_brute_force_match(rollouts: list[list[int]], which: str) -> None:
    """Random token runs (ids -1 and len(PIECES) have no text) against the paper's grams, or
    phrases of our own with spaces, punctuation and a typographic apostrophe."""
    own = ("let me", "let's", "but wait", "so", "wait, but", "check?", "may be", "## step",
           "let\u2019s check", "me-check", "be", "maybe", "letme", "wait,but")  # fmt: skip
    phrases = DEFAULT_PHRASES if which == "defaults" else own
    tokens = np.array([t for r in rollouts for t in r], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum([len(r) for r in rollouts])]).astype(np.int64)
    got = strategic_phrase_mask(tokens, offsets, PIECES, phrases).astype(int).tolist()
    assert got == reference_mask(rollouts, PIECES, phrases)


def test_phrases_are_matched_by_their_words() -> None:
    assert phrase_words(" Let\u2019S  double-check\t") == ("let's", "double-check")
    assert phrase_words("   ") == ()
    forms = [phrase_words(p) for p in DEFAULT_PHRASES]
    assert len(forms) == len(set(forms)) and all(forms)


def test_the_docs_name_the_papers_listing_as_the_default() -> None:
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[1] / "docs" / "estimator-config.md").read_text()
    section = docs[docs.index("## HICRA") : docs.index("## Edge cases")]
    assert "Listing 1" in section and "DEFAULT_PHRASES" in section
    assert "249" in section


def request_without_mask(phrases: list[str] | None = None) -> dict[str, Any]:
    hicra: dict[str, Any] = {} if phrases is None else {"phrases": phrases}
    return {
        "estimator": {"outcome": "grpo", "hicra": hicra},
        "return": ["planning_mask"],
        "groups": [
            {
                "id": "g",
                "rollouts": [
                    {"tokens": ids("So", " wait", ",", " let", " me", " check"), "reward": 1.0},
                    {"tokens": ids(" the", " sum", " hmm"), "reward": 0.0},
                ],
            }
        ],
    }


def test_a_term_derives_its_missing_input_from_the_vocabulary_and_never_replaces_a_given_one():
    from advantage_service.wire.request import parse_request

    req = parse_request(request_without_mask())
    derived = derive_inputs(req.batch, req.estimator, WORDS)
    assert derived.planning_mask.tolist() == [1, 1, 0, 1, 1, 0, 0, 0, 0]  # type: ignore[union-attr]
    assert derive_inputs(req.batch, req.estimator, None) is req.batch  # no tokenizer
    custom = parse_request(request_without_mask(["the sum"]))
    assert derive_inputs(custom.batch, custom.estimator, WORDS).planning_mask.tolist() == [
        0, 0, 0, 0, 0, 0, 1, 1, 0
    ]  # fmt: skip
    given_mask = request_without_mask()
    for r in given_mask["groups"][0]["rollouts"]:
        r["planning_mask"] = [0.0] * len(r["tokens"])
    req = parse_request(given_mask)
    assert derive_inputs(req.batch, req.estimator, WORDS) is req.batch
    # An estimator without hicra derives nothing.
    plain = parse_request({**request_without_mask(), "estimator": "grpo", "return": []})
    assert derive_inputs(plain.batch, resolve_estimator("grpo"), WORDS) is plain.batch


def test_without_a_tokenizer_a_missing_planning_mask_names_the_field_and_the_tokenizer() -> None:
    with pytest.raises(RequestError) as info:
        compute(request_without_mask(), device="cpu")
    assert (info.value.code, info.value.field) == ("missing_input", "planning_mask")
    assert "--tokenizer" in info.value.message

"""HICRA: hierarchy-aware credit assignment ("Emergent Hierarchical Reasoning in LLMs through
Reinforcement Learning", arXiv 2509.03646).

RL on reasoning first sharpens execution (arithmetic, substitutions), then the gains come from
strategic planning: deduction, branching, backtracking, verification. HICRA concentrates the
learning signal on the planning tokens by amplifying their advantage:

    A_it <- A_it + alpha |A_it| m_it,    alpha >= 0 (default 0.2), m_it = 1 on planning tokens

so a planning token of a rollout with positive advantage gets (1 + alpha) A_it (a good plan is
reinforced more) and one with negative advantage (1 - alpha) A_it (a plan in a failed rollout is
blamed less); other tokens keep A_it. The term applies to the combined advantage after the
formula, whitening and clipping (so ``clip`` bounds the advantage it is given, not its answer),
and before the forking mask; with ``grpo`` and no other term, A_it = a_i + alpha |a_i| m_it.
The diagnostic ``hicra_bonus`` is the amount added, alpha |A_it| m_it (before the forking mask,
which may zero the token after it); ``planning_mask`` is m.

Version and sources: arXiv 2509.03646 (v3). No equation number is cited: the stored text that
could be read holds the abstract and the introduction, not the method section. The formula is
the one ESTIMATORS.md and the issue that asked for HICRA state; that the advantage of planning
tokens is amplified by alpha, 0.2 in the paper's experiments, and that planning tokens are those
of "strategic grams" (3-5-word n-grams such as "let's try", "we can use", "but the problem
mentions") is confirmed by summaries of v3, not by its equations. Some trainer
implementations also amplify high-entropy tokens of longer correct rollouts; that is not the
formula stated there and is not done here.

The planning mask comes from the rollouts' ``planning_mask`` input (0/1 per token), or, when a
request has none and the server has a tokenizer (``--tokenizer``/``ADV_TOKENIZER``), from
strategic phrases found in the decoded token text (:func:`strategic_phrase_mask`): the
request's ``phrases`` or :data:`DEFAULT_PHRASES`. The paper finds its strategic grams by
clustering n-grams of successful solutions (no list of them to reuse could be checked here);
:data:`DEFAULT_PHRASES` is this service's own list of hesitation, verification, backtracking and
planning phrases, in English (docs/estimator-config.md lists them).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from ..batch import RolloutBatch
from .registry import Derivation, Param, TermContext, TermOutput, register_term

# The service's default strategic phrases (matched case-insensitively, ignoring whitespace).
DEFAULT_PHRASES: tuple[str, ...] = (
    # hesitation
    "wait",
    "hmm",
    "hold on",
    "let me think",
    "let me reconsider",
    "on second thought",
    "i'm not sure",
    "actually",
    # verification
    "let me check",
    "let me verify",
    "let me confirm",
    "let's check",
    "let's verify",
    "double-check",
    "double check",
    "sanity check",
    "to confirm",
    "check that",
    "verify that",
    "plugging back",
    "substituting back",
    # backtracking and branching
    "that's not right",
    "that is not right",
    "this is wrong",
    "i made a mistake",
    "let me redo",
    "let's go back",
    "going back to",
    "alternatively",
    "instead",
    "another approach",
    "a different approach",
    "let's try a different approach",
    "but the problem",
    # planning and deduction
    "we can use the fact that",
    "the key idea",
    "the key insight",
    "let's break this down",
    "let's consider",
    "first, we need to",
    "this means that",
    "this suggests",
    "therefore",
)

# Text separators of the matching string: before each token, and before each rollout (a
# phrase never spans two rollouts). Neither survives normalisation of a token's text.
TOKEN_MARK = "\x01"
ROLLOUT_MARK = "\x00"
_WHITESPACE = re.compile(r"\s+")


def normalise(text: str) -> str:
    """Lower case, typographic apostrophes straight, whitespace and the separators removed:
    what phrases and token text are compared as (so "Let me" matches the tokens " let", " me"
    of a byte-level BPE as well as the words of a word-level vocabulary)."""
    text = text.replace("\u2019", "'").replace(TOKEN_MARK, "").replace(ROLLOUT_MARK, "")
    return _WHITESPACE.sub("", text.lower())


@lru_cache(maxsize=32)
def phrase_pattern(phrases: tuple[str, ...]) -> re.Pattern[str] | None:
    """A token boundary followed by any phrase (longest first, so the longest wins where two
    start together) whose text ends at a token or rollout boundary; token marks may fall
    between any two of its characters (a phrase spans tokens split anywhere)."""
    forms = sorted({normalise(p) for p in phrases} - {""}, key=lambda f: (-len(f), f))
    if not forms:
        return None
    alternatives = "|".join(
        (re.escape(TOKEN_MARK) + "*").join(re.escape(ch) for ch in form) for form in forms
    )
    return re.compile(
        f"{re.escape(TOKEN_MARK)}(?=({alternatives})(?:[{TOKEN_MARK}{ROLLOUT_MARK}]|\\Z))"
    )


class _Vocabulary:
    """A vocabulary's token texts, normalised, each after TOKEN_MARK; then two entries more: an
    id past the vocabulary (a token without text) and the rollout mark."""

    def __init__(self, vocabulary: Sequence[str]) -> None:
        texts = [TOKEN_MARK + normalise(t) for t in vocabulary] + [TOKEN_MARK, ROLLOUT_MARK]
        self.size = len(vocabulary)
        self.unknown = self.size
        self.rollout = self.size + 1
        self.texts = np.array(texts, dtype=object)
        self.lengths = np.array([len(t) for t in texts], dtype=np.int64)


_VOCABULARIES: dict[int, tuple[Sequence[str], _Vocabulary]] = {}
_VOCABULARIES_LOCK = threading.Lock()


def _normalised(vocabulary: Sequence[str]) -> _Vocabulary:
    """The normalised form of ``vocabulary``, made once per vocabulary object (a server has one)."""
    with _VOCABULARIES_LOCK:
        cached = _VOCABULARIES.get(id(vocabulary))
        if cached is None or cached[0] is not vocabulary:
            if len(_VOCABULARIES) >= 4:
                _VOCABULARIES.clear()
            cached = (vocabulary, _Vocabulary(vocabulary))
            _VOCABULARIES[id(vocabulary)] = cached
        return cached[1]


def strategic_phrase_mask(
    tokens: np.ndarray,
    offsets: np.ndarray,
    vocabulary: Sequence[str],
    phrases: Sequence[str] = DEFAULT_PHRASES,
) -> np.ndarray:
    """m_it = 1 on the tokens of every strategic phrase found in the decoded text: float32 (N,).

    tokens: int (N,) ids; offsets: int64 (B+1,); ``vocabulary[id]``: the text id decodes to
    alone (an id past the vocabulary has none). A phrase matches a run of whole tokens of one
    rollout whose text, concatenated, equals the phrase up to case and whitespace; every token of
    the run is marked (whitespace-only tokens inside it too). Phrases may overlap.
    """
    n = int(tokens.shape[0])
    mask = np.zeros(n, dtype=np.float32)
    pattern = phrase_pattern(tuple(phrases))
    if n == 0 or pattern is None:
        return mask
    vocab = _normalised(vocabulary)
    ids = np.asarray(tokens, dtype=np.int64)
    ids = np.where((ids >= 0) & (ids < vocab.size), ids, vocab.unknown)
    starts = np.asarray(offsets, dtype=np.int64)[:-1][np.diff(offsets) > 0]
    # The rollout mark before each non-empty rollout's first token.
    sequence = np.insert(ids, starts, vocab.rollout)
    is_token = np.ones(sequence.shape[0], dtype=bool)
    is_token[starts + np.arange(starts.size)] = False
    text = "".join(vocab.texts[sequence].tolist())
    element_lengths = vocab.lengths[sequence]
    element_starts = np.cumsum(element_lengths) - element_lengths
    token_starts = element_starts[is_token] + 1  # each token's text, after its mark
    first: list[int] = []
    last: list[int] = []
    for match in pattern.finditer(text):
        first.append(match.start(1))
        last.append(match.end(1) - 1)
    if not first:
        return mask
    begin = np.searchsorted(token_starts, np.array(first), side="left")
    end = np.searchsorted(token_starts, np.array(last), side="right")  # one past the last
    edges = np.zeros(n + 1, dtype=np.int64)
    np.add.at(edges, begin, 1)
    np.add.at(edges, end, -1)
    mask[np.cumsum(edges[:-1]) > 0] = 1.0
    return mask


def derive_planning_mask(
    batch: RolloutBatch, params: Mapping[str, Any], vocabulary: Sequence[str]
) -> torch.Tensor:
    """The planning mask from strategic phrases (the request's ``phrases`` or the defaults) in
    the batch's decoded tokens: float32 (N,) on the batch's device."""
    phrases = params["phrases"] if params["phrases"] is not None else DEFAULT_PHRASES
    mask = strategic_phrase_mask(
        batch.tokens.cpu().numpy(), batch.offsets.cpu().numpy(), vocabulary, phrases
    )
    return torch.from_numpy(mask).to(batch.device)


# ---- the term -----------------------------------------------------------------------------------

PARAMS = (
    Param(
        "alpha",
        float,
        0.2,
        "alpha: a planning token's advantage A becomes A + alpha |A|",
        minimum=0.0,
    ),
    Param(
        "phrases",
        list,
        None,
        "strategic phrases to find in the decoded tokens when a request gives no planning_mask "
        "and the server has a tokenizer (case and whitespace ignored); null: the service's "
        "default list (docs/estimator-config.md)",
        nullable=True,
    ),
)


@register_term(
    "hicra",
    formula="A_it <- A_it + alpha |A_it| m_it (after whitening and clipping, before masks), "
    "m_it = 1 on planning tokens",
    paper="Emergent Hierarchical Reasoning in LLMs through Reinforcement Learning, arXiv "
    "2509.03646 (HICRA)",
    params=PARAMS,
    diagnostics=("planning_mask", "hicra_bonus"),
    requires=lambda params: {"planning_mask": "planning_mask"},
    derives={
        "planning_mask": Derivation(
            derive_planning_mask,
            "a server tokenizer (--tokenizer) to find strategic phrases in the tokens",
        )
    },
)
def hicra(batch: RolloutBatch, params: Mapping[str, Any], ctx: TermContext) -> TermOutput:
    """Amplifies the advantage of planning tokens: more credit, less blame."""
    m = batch.planning_mask
    assert m is not None  # by `requires` (given, or derived from the tokens)
    alpha = params["alpha"]
    return TermOutput(
        amplification=m,
        amplification_scale=alpha,
        amplification_diagnostic="hicra_bonus",
        diagnostics={"planning_mask": m},
    )

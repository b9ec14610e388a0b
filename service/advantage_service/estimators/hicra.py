"""HICRA: hierarchy-aware credit assignment (Wang et al. 2025, "Emergent Hierarchical Reasoning
in LLMs through Reinforcement Learning", arXiv 2509.03646v3).

RL on reasoning first sharpens execution (arithmetic, substitutions), then the gains come from
strategic planning: deduction, branching, backtracking. HICRA concentrates the learning signal
on the planning tokens by amplifying their advantage. Section 3 ("HICRA: Hierarchy-Aware Credit
Assignment"), paragraph "Formulation" (the main text's equations are unnumbered):

    A^HICRA_it = A_it + alpha |A_it|  if t in S_i,  A_it otherwise,
    alpha in (0, 1) (0.2 in the paper's experiments, Appendix E.1), S_i the planning tokens of
    rollout i

which is A_it + alpha |A_it| m_it with m_it = 1 on planning tokens: a planning token of a
rollout with positive advantage gets (1 + alpha) A_it (a good plan is reinforced more) and one
with negative advantage (1 - alpha) A_it (a plan in a failed rollout is blamed less); other
tokens keep A_it. The paper applies it to GRPO's advantage; here it applies to the combined
advantage of any outcome and terms, after the formula, whitening and clipping (so ``clip``
bounds the advantage it is given, not its answer), and before the forking mask; with ``grpo``
and no other term, A_it = a_i + alpha |a_i| m_it. ``alpha`` accepts any value >= 0 (above 1 a
negative advantage changes sign on a planning token: the formula as written). The diagnostic
``hicra_bonus`` is the amount added, alpha |A_it| m_it (before the forking mask, which may zero
the token after it); ``planning_mask`` is m.

The paper's formula amplifies every planning token. A trainer port of the authors' code (TRL
pull request 4997, not merged) also gates the amplification by token entropy and rollout
length; that is not the paper's formula and is not done here.

Planning tokens (Section 2.1): "A token is classified as a strategic planning token if it is
part of a Strategic Gram in the current context." The paper's Strategic Grams are n-grams of
successful solutions, clustered by sentence embedding, of which the clusters in the top 20% by
document frequency are kept; Appendix A, Listing 1 gives the resulting set, which is
:data:`DEFAULT_PHRASES`. The planning mask comes from the rollouts' ``planning_mask`` input (0/1
per token), or, when a request has none and the server has a tokenizer
(``--tokenizer``/``ADV_TOKENIZER``), from the phrases found in the decoded token text
(:func:`strategic_phrase_mask`): the request's ``phrases`` or :data:`DEFAULT_PHRASES`. Every
token holding part of a matched phrase is marked. How a phrase matches (:func:`phrase_pattern`):
case is ignored and typographic apostrophes count as straight ones; the characters of a word
(punctuation included: "hmm," needs its comma) must be adjacent in the text, token boundaries
aside; a space between words matches whitespace, a token boundary or both; a phrase starts and
ends at token boundaries (whitespace at a token's ends aside), which stand for word boundaries,
so "but" does not match inside the one token " butter" (it would inside " but", "ter"). A
tokenizer that decodes a lone token without its leading space (word-level, SentencePiece)
leaves only the token boundary between two words, so there "may", "be" also reads as "maybe".
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

# The default strategic phrases: the paper's Strategic Grams, "Listing 1: Strategic Grams" of
# Appendix A ("SG construction") of arXiv 2509.03646v3, all 249 entries in the listing's order
# (the comments number its lines). The listing is a Python set of lower-case strings; a space at
# either end of an entry in the text conversion (' wait, no', 'think of this as ') is typesetting
# and is dropped here (the matcher ignores it anyway). The paper built the set by clustering the
# 3- to 5-grams of successful solutions and keeping the clusters in the top 20% by document
# frequency (Section 2.1); the set holds shorter grams too ('but', 'so', 'wait').
# fmt: off
DEFAULT_PHRASES: tuple[str, ...] = (
    # 1
    "## step", "a good starting point is", "a more direct approach is",
    "a more straightforward approach",
    # 2
    "a simpler approach is", "alright", "alternatively", "an alternative path is",
    "an error in the thought process",
    # 3
    "analyze the", "analyzing the given", "and then find", "another approach", "are looking for",
    # 4
    "based on the given", "break down the problem", "break it down",
    "break it down into manageable steps",
    # 5
    "but", "but wait", "but why", "but without more information", "can be rewritten as",
    # 6
    "can conclude that", "can see that", "check if", "consider the case where",
    "consider the properties of",
    # 7
    "correct the approach", "define the variables", "denote", "determine how many",
    "directly address the problem",
    # 8
    "does this hold true?", "does this make sense?", "double-checking the logic", "finally need to",
    # 9
    "finally we need to", "find a simpler", "find a way to", "find out how many",
    "find the critical points",
    # 10
    "first need to", "follow these steps", "for simplicity", "from earlier we have",
    "from the above",
    # 11
    "from this, it follows that", "from this, we can infer", "given the complexity",
    "given the complexity of",
    # 12
    "given the constraints", "given the nature of", "go back to the", "goal is to", "hmm,",
    "hold on",
    # 13
    "however", "however, we need to", "i might have made an error", "i need to re-evaluate",
    "i should verify this result",
    # 14
    "identify the", "identify the given information", "if that doesn't work, we can",
    "if we consider",
    # 15
    "in a way that", "in the context of", "is there a simpler method?", "is there a simpler way?",
    # 16
    "it logically follows that", "it seems", "it's better", "let me", "let me pause and think",
    # 17
    "let me rethink this", "let me verify", "let's", "let's analyze the possibilities",
    "let's assume",
    # 18
    "let's backtrack", "let's break this down", "let's check our work",
    "let's check the constraints again",
    # 19
    "let's consider another case", "let's denote", "let's double-check",
    "let's explore a different possibility",
    # 20
    "let's formulate a plan", "let's go back a step", "let's outline the steps",
    "let's pause and think",
    # 21
    "let's reconsider", "let's try a different angle", "let's validate this", "looking back at the",
    "maybe",
    # 22
    "maybe i can", "my previous step was flawed", "need to", "need to account for",
    "need to analyze",
    # 23
    "need to check", "need to consider", "need to count", "need to determine", "need to ensure",
    "need to express",
    # 24
    "need to find", "need to follow", "need to identify", "need to minimize", "need to reconsider",
    "need to show",
    # 25
    "need to solve", "need to think about", "need to understand", "need to use", "next",
    "note that", "now",
    # 26
    "now let", "now need to", "now we need to", "okay", "on second thought", "on the other hand",
    # 27
    "one way to", "our strategy is", "perhaps", "perhaps i can", "problem is asking",
    "problem states that",
    # 28
    "proceed with the following", "rearrange the equation", "recall that",
    "referring to a previous step",
    # 29
    "revisiting the initial assumption", "rewrite the equation", "says that",
    "seems a bit complicated",
    # 30
    "should consider", "should focus on", "should look for", "similarly", "simplify the problem",
    "since",
    # 31
    "so", "so after", "so again", "so the question becomes", "so, yes", "something is wrong here",
    "specifically",
    # 32
    "start by", "states that", "step by step", "step by step reasoning", "step by step solution",
    # 33
    "step-by-step reasoning", "that can't be right", "that seems", "that was a mistake",
    # 34
    "that assumption was incorrect", "the correct approach is", "the core idea is",
    "the first step is",
    # 35
    "the key insight is", "the key is to realize", "the key to solving this", "the logical flow is",
    # 36
    "the next step is", "the path to the solution", "the plan is to", "the problem asks for",
    # 37
    "the problem is about", "the problem mentions", "the problem says", "the problem states",
    # 38
    "there is a mistake", "there seems to be", "therefore", "think of this as", "this allows us to",
    # 39
    "this approach isn't working", "this approach seems", "this can be seen as", "this implies",
    # 40
    "this implies that", "this is because", "this is not the correct approach",
    "this isn't leading anywhere",
    # 41
    "this leads to", "this leads us to", "this logically leads to", "this means", "this means that",
    # 42
    "this seems a bit", "this suggests", "this suggests a path", "this suggests that", "thus",
    "to confirm",
    # 43
    "to consider the constraints", "to determine", "to do this", "to ensure",
    "to ensure correctness",
    # 44
    "to find", "to make it easier", "to proceed", "to see if", "to solve this problem", "to verify",
    # 45
    "try to", "understand the given information", "understanding the problem",
    "understanding the problem first",
    # 46
    "upon closer inspection", "use the concept of", "use the fact", "use the fact that",
    "use the method of",
    # 47
    "use the properties of", "verify the solution", "wait", "wait, but", "wait, no",
    "wait, that's not right",
    # 48
    "want to find", "we are dealing with", "we can", "we can approach this", "we can conclude",
    "we can deduce",
    # 49
    "we can infer", "we can see", "we can start by", "we can think of this as", "we can use",
    "we know",
    # 50
    "what am i missing?", "what happens if", "what if we assume", "what if we try",
    "what is being asked",
    # 51
    "which means", "will consider the", "work our way",
)
# fmt: on

# Text separators of the matching string: before each token, and before each rollout (a
# phrase never spans two rollouts). Neither survives normalisation of a token's text.
TOKEN_MARK = "\x01"
ROLLOUT_MARK = "\x00"
_MARK = re.escape(TOKEN_MARK)
_ANY_MARK = re.escape(TOKEN_MARK + ROLLOUT_MARK)
# What a space in a phrase matches: whitespace, token boundaries or both, at least one (a
# tokenizer that decodes a lone token without its leading space, as SentencePiece and
# word-level ones do, leaves only the boundary between two words).
_GAP = f"[\\s{_MARK}]+"
# Where a phrase may end: at the end of a token (whitespace at the token's end aside) or of
# the text.
_END = f"\\s*(?=[{_ANY_MARK}]|\\Z)"


def normalise(text: str) -> str:
    """Lower case, typographic apostrophes straight, the separators removed (whitespace is kept):
    what token text is matched as."""
    return text.lower().replace("\u2019", "'").replace(TOKEN_MARK, "").replace(ROLLOUT_MARK, "")


def phrase_words(phrase: str) -> tuple[str, ...]:
    """A phrase as it is matched: its normalised words, split at whitespace ("Let's  check " ->
    ("let's", "check"))."""
    return tuple(normalise(phrase).split())


def _trie_pattern(node: dict[Any, Any], first: bool) -> str:
    """The regular expression of a trie of phrases: a unit is a character (token boundaries may
    fall before it, whitespace may not; none before a phrase's first character) or a gap
    (None: a space of the phrase). Longer phrases are tried first, so where phrases start
    together the longest that matches wins."""
    alternatives = []
    for unit in sorted(node, key=lambda u: (u is None or u == "", u or "")):
        if unit == "":  # a phrase ends here
            continue
        # A gap; the first character of a phrase; a later one, after any token boundaries.
        char = re.escape(unit or "")
        head = _GAP if unit is None else char if first else f"{_MARK}*{char}"
        alternatives.append(head + _trie_pattern(node[unit], first=False))
    if "" in node:
        alternatives.append(_END)
    return alternatives[0] if len(alternatives) == 1 else "(?:" + "|".join(alternatives) + ")"


@lru_cache(maxsize=32)
def phrase_pattern(phrases: tuple[str, ...]) -> re.Pattern[str] | None:
    """A token boundary, then any phrase (group 1) that starts the token's text (whitespace at
    the token's start aside) and ends a token's.

    Within a word of a phrase, characters must be adjacent in the text, token boundaries aside
    (so "let's" matches " let", "'s" and "hmm," matches " hmm", ","); a space of the phrase
    matches whitespace, token boundaries or both. One trie of all the phrases, so that each
    token start tries each distinct first character once, not each phrase."""
    trie: dict[Any, Any] = {}
    for phrase in phrases:
        words = phrase_words(phrase)
        if not words:
            continue
        node = trie
        for k, word in enumerate(words):
            if k:
                node = node.setdefault(None, {})
            for ch in word:
                node = node.setdefault(ch, {})
        node[""] = {}
    if not trie:
        return None
    return re.compile(f"{_MARK}\\s*(?=({_trie_pattern(trie, first=True)}))")


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
    rollout whose text, concatenated, is the phrase (:func:`phrase_pattern`: case ignored, a
    space of the phrase matching whitespace or token boundaries, whitespace at the run's ends
    aside); every token of the run is marked (whitespace-only tokens inside it too). Phrases
    may overlap.
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
    # The tokens holding the first and the last character (a token's text may begin with
    # whitespace before a phrase does).
    begin = np.searchsorted(token_starts, np.array(first), side="right") - 1
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
        "and the server has a tokenizer (case ignored; a space matches whitespace or a token "
        "boundary); null: the paper's Strategic Grams (its Listing 1, 249 phrases)",
        nullable=True,
    ),
)


@register_term(
    "hicra",
    formula="A_it <- A_it + alpha |A_it| m_it (after whitening and clipping, before masks), "
    "m_it = 1 on planning tokens",
    paper="Wang et al. 2025, Emergent Hierarchical Reasoning in LLMs through Reinforcement "
    "Learning, arXiv 2509.03646v3 (HICRA, Section 3)",
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

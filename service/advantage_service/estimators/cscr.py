"""CSCR: counterfactual sensitivity credit reallocation ("Improving AI Reasoning by Rewarding
Better Tokens").

A token whose likelihood swings between two opposing privileged contexts (pos/neg) is a
surface-form token (a conjunction, formatting); CSCR moves the rollout's credit away from such
tokens toward the rest, keeping the rollout's total credit T_i a_i and its sign.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..batch import RolloutBatch
from .registry import Param, TermContext, TermOutput, register_term
from .state import TermState, TermWrites, WriteOptions


def exp_onset(s: torch.Tensor, onset: float, decay: float, strength: float) -> torch.Tensor:
    """u = 1 - gamma (1 - exp(-alpha max(0, s - lambda))): 1 below the onset, -> 1 - gamma."""
    return 1.0 - strength * (1.0 - torch.exp(-decay * torch.clamp(s - onset, min=0.0)))


# Sensitivity -> raw weight mappings, by the `mapping` parameter; add new ones beside exp_onset.
MAPPINGS: dict[str, Callable[[torch.Tensor, float, float, float], torch.Tensor]] = {
    "exp_onset": exp_onset,
}

PARAMS = (
    Param(
        "mapping", str, "exp_onset", "sensitivity -> raw weight mapping", choices=tuple(MAPPINGS)
    ),
    Param("positive", str, "pos", "teacher condition that confirms the outcome"),
    Param("negative", str, "neg", "the opposing teacher condition"),
    Param(
        "onset", float, 0.05, "lambda: sensitivity below which a token keeps weight 1", minimum=0.0
    ),
    Param("decay", float, 10.0, "alpha: how fast the weight falls past the onset", minimum=0.0),
    Param(
        "strength", float, 0.2, "gamma: the most weight a token can lose", minimum=0.0, maximum=1.0
    ),
)


def sensitivity(batch: RolloutBatch, positive: str, negative: str) -> torch.Tensor:
    """s_it = |logp_pos(y_it) - logp_neg(y_it)|, float64 (N,)."""
    return (
        batch.teacher_logprobs[positive].double() - batch.teacher_logprobs[negative].double()
    ).abs()


def normalise_within_rollout(batch: RolloutBatch, u: torch.Tensor) -> torch.Tensor:
    """w_it = u_it T_i / sum_t u_it, so each rollout's weights sum to its length T_i.

    A rollout whose raw weights sum to 0 (possible only with gamma = 1) keeps weight 1.
    """
    rollout = batch.rollout_of_token
    total = torch.zeros(batch.num_rollouts, dtype=u.dtype, device=u.device).index_add_(
        0, rollout, u
    )
    scale = batch.lengths.to(u.dtype) / total.clamp(min=torch.finfo(u.dtype).tiny)
    return torch.where(total[rollout] > 0, u * scale[rollout], torch.ones_like(u))


def _writes(
    batch: RolloutBatch,
    params: Mapping[str, Any],
    s: torch.Tensor,
    prior: None,
    options: WriteOptions,
) -> TermWrites:
    """The sensitivity of every occurrence, summed per token id (``sens_sum``) with the count of
    occurrences (``sens_count``): their mean is the token's mean sensitivity."""
    tokens = batch.tokens.long()
    return TermWrites(
        columns={
            "sens_sum": (tokens, s.double()),
            "sens_count": (tokens, None),
        }
    )


@register_term(
    "cscr",
    formula="w_it = u_it T_i / sum_t u_it, u = 1 - gamma (1 - exp(-alpha max(0, s - lambda)))",
    paper="Improving AI Reasoning by Rewarding Better Tokens (CSCR)",
    params=PARAMS,
    diagnostics=("cscr_weight", "sensitivity"),
    requires=lambda p: {
        f"teacher:{p['positive']}": f"teacher_logprobs.{p['positive']}",
        f"teacher:{p['negative']}": f"teacher_logprobs.{p['negative']}",
    },
    state=TermState(
        writes=_writes,
        columns=("sens_sum", "sens_count"),
        select=lambda s, span: s[span.tokens],
    ),
)
def cscr(batch: RolloutBatch, params: Mapping[str, Any], ctx: TermContext) -> TermOutput:
    """Credit weights that move a rollout's credit off counterfactually sensitive tokens."""
    s = sensitivity(batch, params["positive"], params["negative"])
    u = MAPPINGS[params["mapping"]](s, params["onset"], params["decay"], params["strength"])
    w = normalise_within_rollout(batch, u)
    return TermOutput(weight=w, diagnostics={"cscr_weight": w, "sensitivity": s}, state=s)

"""OPSD: on-policy self-distillation bonus, the competitor the CSCR paper compares against.

The model conditioned on privileged context acts as its own teacher; each token earns the
teacher's log-probability shift over the student's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..batch import RolloutBatch
from .registry import Param, TermContext, TermOutput, register_term

PARAMS = (
    Param("teacher", str, "pos", "teacher condition whose log-probs are the target"),
    Param("coef", float, 1.0, "coefficient of the bonus in the advantage"),
    Param(
        "clip",
        float,
        None,
        "bound |d| by this (null: no bound)",
        minimum=0.0,
        exclusive_minimum=True,
        nullable=True,
    ),
)


@register_term(
    "opsd",
    formula="b_it = coef * clip(logp_teacher(y_it) - logp_student(y_it), -clip, clip)",
    paper="On-policy self-distillation (as compared in the CSCR paper)",
    params=PARAMS,
    diagnostics=("opsd_reward",),
    requires=lambda p: {
        "logprobs": "logprobs",
        f"teacher:{p['teacher']}": f"teacher_logprobs.{p['teacher']}",
    },
)
def opsd(batch: RolloutBatch, params: Mapping[str, Any], ctx: TermContext) -> TermOutput:
    """Teacher-minus-student log-probability bonus."""
    assert batch.logprobs is not None  # guaranteed by `requires`
    d = batch.teacher_logprobs[params["teacher"]].double() - batch.logprobs.double()
    if params["clip"] is not None:
        d = d.clamp(-params["clip"], params["clip"])
    return TermOutput(bonus=params["coef"] * d, diagnostics={"opsd_reward": d})

"""Dynamic batching, the math side: which requests may share one computation, and how one
computation's result is split back into each request's own.

Requests merge when they ask for the same computation over different rollouts: the same
resolved estimator, ``return`` list, ``ignore_token_ids`` and ``vocab_size``, the same per-token
inputs, and no state to read (a history read is per request). Namespaces may differ. The merged
batch (``RolloutBatch.concat``) keeps every request's groups its own, even where ids collide, and
marks each request's rollouts as a segment, so that what the math computes over a whole request
(whitening, ``reinforce_pp_baseline``'s whitening, GPG's B) stays per request. Per-group and
per-token math is unchanged by its neighbours. The guarantee (tested as a property): a request's
answer is the one it gets alone, bit for bit on the CPU, since every per-group sum accumulates in
the same order; within float32 rounding on CUDA, whose scatter sums are not ordered.
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Sequence

from ..batch import RolloutBatch
from ..estimators import TERMS, AdvantageResult
from ..wire.request import ComputeRequest
from .term_state import reads_state


def merge_key(req: ComputeRequest) -> Hashable | None:
    """Requests with equal keys may be computed as one batch; None: this one never merges."""
    if reads_state(req):
        return None
    for name in req.estimator.terms:
        state = TERMS[name].state
        if state is not None and state.select is None:
            return None
    batch = req.batch
    return (
        json.dumps(req.estimator.to_dict(), sort_keys=True),
        req.returns,
        tuple(req.ignore_token_ids),
        req.vocab_size,
        batch.logprobs is not None,
        tuple(sorted(batch.teacher_logprobs)),
        str(batch.device),
    )


def merge(requests: Sequence[ComputeRequest]) -> RolloutBatch:
    """The batch of several compatible requests (one after another, a segment each)."""
    return RolloutBatch.concat([req.batch for req in requests])


def split(result: AdvantageResult, batch: RolloutBatch) -> list[AdvantageResult]:
    """Each request's result from the result of the merged ``batch``: views of its tokens and
    rollouts, and each term's state as the request alone would have left it."""
    out = []
    for span in batch.spans():
        state = {}
        for name, value in result.state.items():
            term_state = TERMS[name].state
            assert term_state is not None and term_state.select is not None
            state[name] = term_state.select(value, span)
        out.append(
            AdvantageResult(
                advantages=result.advantages[span.tokens],
                scalars=result.scalars[span.rollouts],
                diagnostics={k: v[span.tokens] for k, v in result.diagnostics.items()},
                estimator=result.estimator,
                state=state,
            )
        )
    return out


__all__ = ["merge", "merge_key", "split"]

"""The fields of a request and their limits, defined once: the service's decoders and checks,
both clients, the padded API and the integrations read them from here.

A request carries groups of rollouts. Per rollout: ``tokens`` (int32 ids), ``reward`` (one
number), the optional per-token inputs of :data:`TOKEN_FIELDS` (one float per token each) and
``teacher_logprobs`` (condition name -> one float per token) and ``reward_components``
(component name -> one number or None). Per group: ``id``, ``rollouts``
and an optional ``prompt_key`` (the key of its history).
"""

from __future__ import annotations

import numpy as np

# The request object's top-level fields (JSON; the other wires carry the same ones).
TOP_LEVEL_FIELDS = (
    "request_id",
    "namespace",
    "estimator",
    "ignore_token_ids",
    "vocab_size",
    "return",
    "groups",
)
# Optional per-token values of a rollout, one per token, beside the teachers' log-probabilities:
# their names on every wire and the keywords of every compute_padded (ESTIMATORS.md, "New
# per-token inputs"). The service's batch carries each as a float32 (N,) array. A new field goes
# at the end: the order is part of the request digests the service stores.
TOKEN_FIELDS = ("logprobs", "entropy", "sum_pi_squared", "is_weights", "returns", "planning_mask")
TEACHER_FIELD = "teacher_logprobs"
# Named rewards per rollout beside ``reward`` (component name -> a number, or None where the
# rollout has none): a rollout that gives them and no reward has their (weighted) sum as reward.
REWARD_COMPONENTS_FIELD = "reward_components"
ROLLOUT_FIELDS = ("tokens", "reward", *TOKEN_FIELDS, TEACHER_FIELD, REWARD_COMPONENTS_FIELD)
GROUP_FIELDS = ("id", "rollouts", "prompt_key")

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
# Token ids at or above this cannot be a vocabulary's (the batch holds them as int32).
TOKEN_ID_LIMIT = 2**31
# Integers a float64 holds exactly: a larger integer reward would be silently rounded (JSON
# carries it exactly), so it is refused on every transport.
EXACT_INTEGER_LIMIT = 2**53
FLOAT32_MAX = float(np.finfo(np.float32).max)
# The longest identifiers a request may carry (they are logged, stored as Redis keys and echoed
# back): group ids and teacher condition names.
MAX_GROUP_ID_LENGTH = 256
MAX_CONDITION_NAME_LENGTH = 64
# Distinct teacher_logprobs conditions in a request (every rollout gives the same ones).
MAX_TEACHER_CONDITIONS = 64
# Reward components of a request (every rollout gives the same names), named like conditions.
MAX_REWARD_COMPONENTS = 16
MAX_COMPONENT_NAME_LENGTH = MAX_CONDITION_NAME_LENGTH

"""Generated from the service's estimator registry by
clients/python/generate_methods.py; do not edit. The methods the service had when this client
was released, the optional inputs each reads (``teacher_logprobs``: any teacher condition), and
the presets that need no token ids.
"""

OUTCOMES: tuple[str, ...] = (
    "grpo",
    "dr_grpo",
    "rloo",
    "reinforce",
    "reinforce_pp_baseline",
    "opo",
    "gpg",
    "grpo_passk",
    "otb",
    "maxrl",
    "gtpo",
    "grpo_s",
    "gdpo",
)
TERMS: tuple[str, ...] = ("ktae", "cscr", "opsd", "forking", "hicra")
# Optional input -> the outcomes and terms that read it (an estimator with none of them
# is not sent that input).
INPUT_READERS: dict[str, tuple[str, ...]] = {
    "entropy": ("forking", "grpo_s", "gtpo"),
    "is_weights": ("otb",),
    "logprobs": ("opsd", "otb"),
    "planning_mask": ("hicra",),
    "returns": ("otb",),
    "sum_pi_squared": ("otb",),
    "teacher_logprobs": ("cscr", "opsd"),
}
# Presets that are an outcome of one number per rollout and no term: a padded call of
# one of these needs no token ids.
OUTCOME_ONLY_PRESETS: tuple[str, ...] = (
    "grpo",
    "dr_grpo",
    "rloo",
    "reinforce",
    "reinforce_pp_baseline",
    "opo",
    "gpg",
    "grpo_passk",
    "maxrl",
    "gdpo",
)

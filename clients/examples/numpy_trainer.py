"""A trainer in plain numpy calling advantage-service's padded API: the "any framework" path.

The policy is a table of next-token logits (a bigram model over a small vocabulary). Each step
samples a batch of responses for a few prompts, left-padded to one width as trainers hold them,
scores them (reward 1 when a response contains the "key" token), asks the service for per-token
advantages with ``compute_padded`` (one call, flat arrays on the wire), and takes a REINFORCE
step on the log-probabilities of the sampled tokens weighted by those advantages.

    python clients/examples/numpy_trainer.py --url http://127.0.0.1:8000 --estimator ktae
    python clients/examples/numpy_trainer.py --grpc 127.0.0.1:50051

Prints one JSON line per step (reward, advantage statistics) and exits 0.
"""

from __future__ import annotations

import argparse
import json
import uuid

import numpy as np
from advantage_client import GrpcClient, HttpClient

VOCAB, KEY, PAD = 16, 7, 0


def sample(rng: np.random.Generator, logits: np.ndarray, prompts: np.ndarray, width: int):
    """(tokens (B, width) left-padded, mask, previous token of each position)."""
    b = prompts.size
    lengths = rng.integers(1, width + 1, size=b)
    tokens = np.full((b, width), PAD, dtype=np.int64)
    mask = np.arange(width)[None, :] >= (width - lengths)[:, None]  # left padding
    previous = np.zeros((b, width), dtype=np.int64)
    current = prompts.copy()
    for t in range(width):  # generation is sequential; the advantage call is not
        probs = np.exp(logits[current] - logits[current].max(1, keepdims=True))
        probs /= probs.sum(1, keepdims=True)
        drawn = (probs.cumsum(1) > rng.random((b, 1))).argmax(1)
        live = mask[:, t]
        tokens[live, t] = drawn[live]
        previous[live, t] = current[live]
        current = np.where(live, drawn, current)
    return tokens, mask, previous


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="HTTP address of the service")
    parser.add_argument("--grpc", help="gRPC host:port of the service")
    parser.add_argument("--estimator", default="ktae")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--width", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if bool(args.url) == bool(args.grpc):
        parser.error("give one of --url and --grpc")
    client = HttpClient(args.url) if args.url else GrpcClient(args.grpc)

    rng = np.random.default_rng(args.seed)
    logits = np.zeros((VOCAB, VOCAB))
    for step in range(args.steps):
        # group_size rollouts per prompt, rows shuffled: a group's rows need not be adjacent
        prompt_ids = np.repeat(rng.integers(1, VOCAB, size=args.prompts), args.group_size)
        uids = np.repeat(
            np.array([uuid.uuid4() for _ in range(args.prompts)], dtype=object), args.group_size
        )
        order = rng.permutation(prompt_ids.size)
        prompt_ids, uids = prompt_ids[order], uids[order]
        tokens, mask, previous = sample(rng, logits, prompt_ids, args.width)
        rewards = ((tokens == KEY) & mask).any(1).astype(np.float64)

        result = client.compute_padded(
            tokens, mask, rewards, uids, estimator=args.estimator, ignore_token_ids=[PAD]
        )
        advantages = result.advantages  # (B, width) float32, 0 off the mask

        # REINFORCE on log pi(token | previous): d/dlogits = A (onehot - pi)
        probs = np.exp(logits - logits.max(1, keepdims=True))
        probs /= probs.sum(1, keepdims=True)
        grad = np.zeros_like(logits)
        rows, cols = np.nonzero(mask)
        prev, tok, adv = previous[rows, cols], tokens[rows, cols], advantages[rows, cols]
        np.add.at(grad, (prev, tok), adv)
        np.add.at(grad, prev, -adv[:, None] * probs[prev])
        logits += 0.5 * grad / max(1, rows.size)

        print(
            json.dumps(
                {
                    "step": step,
                    "reward": float(rewards.mean()),
                    "tokens": int(mask.sum()),
                    "advantage_abs_mean": float(np.abs(advantages[mask]).mean()),
                    "zero_off_mask": bool((advantages[~mask] == 0).all()),
                    "distinct_in_row": int(
                        max(len(np.unique(a[m])) for a, m in zip(advantages, mask, strict=True))
                    ),
                }
            ),
            flush=True,
        )
    client.close()


if __name__ == "__main__":
    main()

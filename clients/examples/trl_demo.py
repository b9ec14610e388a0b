"""A learning demo: the tiny model of trl_tiny.py trained through the service with GRPO, GRPO +
KTAE (history per prompt) and GTPO, each on several seeds, on the CPU; a PNG of the reward and
pass rate per step (the mean over seeds and the band from the lowest to the highest seed), a
Markdown table of each seed's final numbers, and everything as JSON.

    python clients/examples/trl_demo.py --start-service          # or --url http://host:8000
    make demo                                                     # the same

The task (trl_tiny.py): each prompt names two target words; the reward is the share of them in
the completion, a pass is both. Writes ``<out>/trl_demo.png``, ``<out>/trl_demo.md`` and
``<out>/trl_demo.json``.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trl_tiny

# label -> (estimator, whether it needs the extra forward pass for entropies)
RUNS = {
    "GRPO": ("grpo", False),
    "GRPO + KTAE (history per prompt)": ("ktae-history", False),
    "GTPO (entropy-shaped)": ("gtpo", True),
}
COLORS = ("tab:blue", "tab:orange", "tab:green")
# The final numbers of a run: the mean over its last steps (one step's reward is noisy).
LAST = 10


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_service() -> tuple[subprocess.Popen[bytes], str]:
    """``advantage-service serve`` on free ports, on the CPU, once it answers."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "advantage_service",
            "serve",
            "--http-port",
            str(port),
            "--grpc-port",
            str(free_port()),
            "--device",
            "cpu",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise SystemExit("the service exited before it was ready")
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("the service was not ready in 120 s")


def final(records: list[dict[str, Any]], key: str) -> float:
    last = records[-LAST:]
    return sum(r[key] for r in last) / len(last)


def plot(results: dict[str, dict[int, list[dict[str, Any]]]], path: Path, title: str) -> None:
    """Per arm: the mean over seeds per step, and the band between the lowest and highest."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), dpi=80)
    for (label, runs), color in zip(results.items(), COLORS, strict=False):
        steps = [r["step"] for r in next(iter(runs.values()))]
        for ax, key in zip(axes, ("reward", "pass_rate"), strict=True):
            per_step = [[records[i][key] for records in runs.values()] for i in range(len(steps))]
            mean = [sum(v) / len(v) for v in per_step]
            ax.fill_between(
                steps,
                [min(v) for v in per_step],
                [max(v) for v in per_step],
                color=color,
                alpha=0.15,
                linewidth=0,
            )
            ax.plot(steps, mean, color=color, linewidth=2, label=f"{label}, {len(runs)} seeds")
    axes[0].set_title("reward (share of target words): mean, min-max over seeds")
    axes[1].set_title("pass rate (both target words): mean, min-max over seeds")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.title.set_fontsize(9)
    axes[0].legend(fontsize=8, loc="upper left")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


def table(results: dict[str, dict[int, list[dict[str, Any]]]]) -> str:
    """Markdown: each arm's reward and pass rate over the last steps, per seed, and the mean."""
    seeds = sorted(next(iter(results.values())))
    head = "| run | " + " | ".join(f"seed {s}" for s in seeds) + " | mean |"
    lines = [head, "|" + "---|" * (len(seeds) + 2)]
    for key, what in (("reward", "reward"), ("pass_rate", "pass rate")):
        for label, runs in results.items():
            values = [final(runs[s], key) for s in seeds]
            cells = " | ".join(f"{v:.3f}" for v in values)
            lines.append(f"| {label}: {what} | {cells} | {sum(values) / len(values):.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = trl_tiny.parser()
    parser.description = __doc__.splitlines()[0]
    parser.add_argument("--start-service", action="store_true", help="start one on free ports")
    parser.add_argument("--out", default=".", help="folder for trl_demo.png, .md and .json")
    parser.add_argument("--seeds", type=int, default=5, help="seeds per arm: 0, 1, ...")
    parser.set_defaults(steps=40, lr=1e-2)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    proc = None
    began_all = time.perf_counter()
    if args.start_service:
        proc, args.url = start_service()
    total = len(RUNS) * args.seeds
    try:
        results: dict[str, dict[int, list[dict[str, Any]]]] = {label: {} for label in RUNS}
        seconds: dict[str, float] = {}
        done = 0
        # Seeds outermost: an interrupted demo has every arm on the same seeds so far.
        for seed in range(args.seeds):
            for label, (estimator, extra_forward) in RUNS.items():
                began = time.perf_counter()
                run_args = argparse.Namespace(
                    **{
                        **vars(args),
                        "estimator": estimator,
                        "seed": seed,
                        "extra_forward": extra_forward,
                        "output_dir": str(out / f"trl_demo_{estimator}_{seed}"),
                    }
                )
                results[label][seed] = trl_tiny.run(run_args)
                took = time.perf_counter() - began
                seconds[f"{label}, seed {seed}"] = took
                done += 1
                records = results[label][seed]
                print(
                    f"[{done}/{total}] {label}, seed {seed}: {took:.0f} s, last {LAST} steps "
                    f"reward {final(records, 'reward'):.3f}, "
                    f"pass rate {final(records, 'pass_rate'):.3f}",
                    flush=True,
                )
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    wall = time.perf_counter() - began_all
    title = (
        f"tiny Llama (2 layers, random init), {args.prompts} prompts, {args.prompts_per_step} x "
        f"{args.generations} completions per step, lr {args.lr:g}, seeds 0-{args.seeds - 1}"
    )
    plot(results, out / "trl_demo.png", title)
    md = table(results)
    (out / "trl_demo.md").write_text(md)
    (out / "trl_demo.json").write_text(
        json.dumps(
            {"settings": vars(args), "wall_seconds": wall, "seconds": seconds, "runs": results},
            indent=1,
        )
    )
    print(md, end="")
    print(f"wall time {wall / 60:.1f} min ({total} runs); written to {out}", flush=True)


if __name__ == "__main__":
    main()

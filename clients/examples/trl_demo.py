"""A learning demo: the tiny model of trl_tiny.py trained with GRPO and with GRPO + KTAE (history
per prompt) through the service, the same seed and steps, on the CPU; a PNG of the reward and
pass rate per step of both, and their numbers as JSON.

    python clients/examples/trl_demo.py --start-service          # or --url http://host:8000
    make demo                                                     # the same

The task (trl_tiny.py): each prompt names two target words; the reward is the share of them in
the completion, a pass is both. Writes ``<out>/trl_demo.png`` and ``<out>/trl_demo.json``.
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

RUNS = {"GRPO": "grpo", "GRPO + KTAE (history per prompt)": "ktae-history"}


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


def smooth(values: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        part = values[max(0, i - window + 1) : i + 1]
        out.append(sum(part) / len(part))
    return out


def plot(results: dict[str, list[dict[str, Any]]], path: Path, title: str, window: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), dpi=80)
    for (label, records), color in zip(results.items(), ("tab:blue", "tab:orange"), strict=False):
        steps = [r["step"] for r in records]
        for ax, key in zip(axes, ("reward", "pass_rate"), strict=True):
            values = [r[key] for r in records]
            ax.plot(steps, values, color=color, alpha=0.25, linewidth=1)
            ax.plot(steps, smooth(values, window), color=color, linewidth=2, label=label)
    axes[0].set_title("reward (share of target words)")
    axes[1].set_title("pass rate (both target words)")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="upper left")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = trl_tiny.parser()
    parser.description = __doc__.splitlines()[0]
    parser.add_argument("--start-service", action="store_true", help="start one on free ports")
    parser.add_argument("--out", default=".", help="folder for trl_demo.png and trl_demo.json")
    parser.add_argument("--window", type=int, default=5, help="moving average of the plot")
    parser.set_defaults(steps=40, lr=1e-2)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    proc = None
    if args.start_service:
        proc, args.url = start_service()
    try:
        results: dict[str, list[dict[str, Any]]] = {}
        seconds: dict[str, float] = {}
        for label, estimator in RUNS.items():
            began = time.perf_counter()
            run_args = argparse.Namespace(**{**vars(args), "estimator": estimator})
            run_args.output_dir = str(out / f"trl_demo_{estimator}")
            results[label] = trl_tiny.run(run_args)
            seconds[label] = time.perf_counter() - began
            last = results[label][-10:]
            print(
                json.dumps(
                    {
                        "run": label,
                        "seconds": round(seconds[label], 1),
                        "reward_last10": sum(r["reward"] for r in last) / len(last),
                        "pass_rate_last10": sum(r["pass_rate"] for r in last) / len(last),
                    }
                ),
                flush=True,
            )
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    title = (
        f"tiny Llama (2 layers, random init), {args.prompts} prompts, {args.prompts_per_step} x "
        f"{args.generations} completions per step, lr {args.lr:g}, seed {args.seed}"
    )
    plot(results, out / "trl_demo.png", title, args.window)
    (out / "trl_demo.json").write_text(
        json.dumps({"settings": vars(args), "seconds": seconds, "runs": results}, indent=1)
    )


if __name__ == "__main__":
    main()

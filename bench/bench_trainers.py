"""The trainer integrations' cost on a training-sized verl batch, through verl's own
``compute_advantage``.

    python bench/bench_trainers.py [--device cpu|cuda] [--repeats 7] [--rows 512] [--width 4096]
        [--threads N] [--no-remote]

A real verl 0.9.1 ``DataProto`` of ``--rows`` responses padded to ``--width`` tokens (lengths
uniform in [width/8, width], right padding), ``--uids`` prompt uids (uuid strings, rows of a
group scattered), binary rewards on each response's last token. After
``advantage_client.integrations.verl.register(); patch()``, interleaved in rounds, it times:

- ``grpo_vectorized``: verl's own vectorised GRPO (the reference);
- ``adv_grpo``: the service's GRPO in-process (goal at 1 thread: at most 1.3x verl's);
- ``adv_ktae``: KTAE in-process; ``compute_batch`` alone on the same batch already flat; and the
  padded <-> flat glue alone (what ``compute_padded`` does besides ``compute_batch``: the
  layout and uid grouping, the gather through the mask, the flat batch's checks, the scatter
  back), whose share of the in-process KTAE call has the goal of at most 25%;
- ``adv_ktae`` over HTTP (Arrow) and gRPC to a real server on the same machine and device
  (goal: the whole call at most 2x the in-process call).

Prints medians, best rounds and the ratios. On a shared machine the best round is the least
disturbed; both are printed, and at one thread on the CPU the medians of the process's CPU time
too. ``--threads``: torch's intra-op threads (0: torch's default).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from advantage_client.integrations import verl as adv_verl
from advantage_service import RolloutBatch, compute_batch
from advantage_service.wire.padded import _Padded
from service_process import ServiceProcess
from verl import DataProto
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo import ray_trainer

EOS = 151643
VOCAB = 151936
SETTLE_SECONDS = 0.2


def verl_batch(rows: int, width: int, uids: int, device: str, seed: int = 0) -> DataProto:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(width // 8, width + 1, size=rows)
    mask = torch.from_numpy(np.arange(width)[None, :] < lengths[:, None])
    tokens = torch.from_numpy(rng.integers(0, VOCAB, size=(rows, width)))
    tokens[torch.arange(rows), torch.from_numpy(lengths - 1)] = EOS
    rewards = torch.zeros(rows, width)
    rewards[torch.arange(rows), torch.from_numpy(lengths - 1)] = torch.from_numpy(
        rng.integers(0, 2, size=rows).astype(np.float32)
    )
    names = np.array([str(uuid.UUID(int=int(rng.integers(0, 2**63)))) for _ in range(uids)])
    index = rng.permutation(np.repeat(np.arange(uids), rows // uids))
    data = DataProto.from_dict(
        tensors={
            "responses": tokens.to(device),
            "response_mask": mask.long().to(device),
            "token_level_rewards": rewards.to(device),
        },
        non_tensors={"uid": names[index].astype(object)},
    )
    return data


def interleaved(
    fns: dict[str, Callable[[], object]],
    repeats: int,
    sync: Callable[[], None],
    cpu: dict[str, float] | None = None,
) -> dict[str, tuple[float, float]]:
    """(median, best) seconds of each function over round-robin rounds, after a warm-up (and,
    into ``cpu`` when given, the medians of the process's CPU time)."""
    for fn in fns.values():
        fn()
    sync()
    seconds: dict[str, list[float]] = {k: [] for k in fns}
    cpu_seconds: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            time.sleep(SETTLE_SECONDS)
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            sync()
            seconds[name].append(time.perf_counter() - start)
            cpu_seconds[name].append(time.process_time() - start_cpu)
    if cpu is not None:
        cpu.update({k: statistics.median(v) for k, v in cpu_seconds.items()})
    return {k: (statistics.median(v), min(v)) for k, v in seconds.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--uids", type=int, default=32)
    parser.add_argument("--no-remote", action="store_true", help="skip HTTP and gRPC")
    parser.add_argument(
        "--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    data = verl_batch(args.rows, args.width, args.uids, device)
    config = AlgoConfig()
    adv_verl.register(presets=["grpo", "ktae"], ignore_token_ids=[EOS])
    adv_verl.patch()

    def through_verl(name: str) -> Callable[[], object]:
        return lambda: ray_trainer.compute_advantage(data, adv_estimator=name, config=config)

    # compute_batch alone on the same batch, already flat (what the glue is measured against)
    mask = data.batch["response_mask"].bool()
    lengths = mask.sum(1)
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    names, group_index = np.unique(data.non_tensor_batch["uid"].astype(str), return_inverse=True)
    flat = RolloutBatch.from_flat(
        tokens=data.batch["responses"][mask],
        offsets=offsets,
        group_ids=list(names),
        group_index=torch.as_tensor(group_index.reshape(-1), device=mask.device),
        rewards=data.batch["token_level_rewards"].sum(-1),
    )

    flat_result = compute_batch(flat, "ktae", device, diagnostics=("scalar",)).advantages
    rewards = data.batch["token_level_rewards"].sum(-1)

    def glue_only() -> object:
        padded = _Padded(mask, rewards, data.non_tensor_batch["uid"])
        batch = RolloutBatch.from_flat(
            tokens=padded.gather(data.batch["responses"], "tokens"),
            offsets=padded.offsets,
            group_ids=padded.group_ids,
            group_index=padded.group_index,
            rewards=padded.rewards,
        )
        return batch, padded.scatter(flat_result)

    fns: dict[str, Callable[[], object]] = {
        "verl grpo_vectorized": through_verl("grpo_vectorized"),
        "adv_grpo in-process": through_verl("adv_grpo"),
        "adv_ktae in-process": through_verl("adv_ktae"),
        "ktae compute_batch only": lambda: compute_batch(
            flat, "ktae", device, diagnostics=("scalar",), ignore_token_ids=[EOS]
        ),
        "padded <-> flat glue only": glue_only,
    }
    server = None
    if not args.no_remote:
        server = ServiceProcess(device=device, log=Path(tempfile.mkdtemp()) / "service.log")
        adv_verl.register(
            "http",
            server.url,
            presets={"ktae_http": "ktae", "grpo_http": "grpo"},
            ignore_token_ids=[EOS],
            timeout=300,
        )
        adv_verl.register(
            "grpc", server.target, presets={"ktae_grpc": "ktae"}, ignore_token_ids=[EOS]
        )
        fns["adv_grpo HTTP (Arrow)"] = through_verl("adv_grpo_http")
        fns["adv_ktae HTTP (Arrow)"] = through_verl("adv_ktae_http")
        fns["adv_ktae gRPC"] = through_verl("adv_ktae_grpc")
    cpu: dict[str, float] = {}
    try:
        times = interleaved(fns, args.repeats, sync, cpu)
    finally:
        if server is not None:
            server.stop()

    tokens = int(lengths.sum())
    single = not device.startswith("cuda") and torch.get_num_threads() == 1
    print(
        f"bench_trainers: {args.rows} x {args.width} responses ({tokens} tokens), "
        f"{args.uids} uids, device {device}, torch threads {torch.get_num_threads()}, "
        f"{args.repeats} rounds"
    )
    for name, (median, best) in times.items():
        cpu_ms = f"   CPU {cpu[name] * 1e3:8.1f} ms" if single else ""
        print(f"  {name:28s} median {median * 1e3:8.1f} ms   best {best * 1e3:8.1f} ms{cpu_ms}")

    def ratio(a: str, b: str, goal: float, what: str) -> None:
        med = times[a][0] / times[b][0]
        best = times[a][1] / times[b][1]
        verdict = "ok" if min(med, best) <= goal else "OVER"
        cpu_ratio = f", {cpu[a] / cpu[b]:5.2f}x CPU" if single else ""
        print(
            f"  {what:46s} {med:5.2f}x median, {best:5.2f}x best{cpu_ratio} (goal <= {goal}x) "
            f"{verdict}"
        )

    ratio("adv_grpo in-process", "verl grpo_vectorized", 1.3, "adv_grpo / verl grpo_vectorized")
    ktae, glue = times["adv_ktae in-process"], times["padded <-> flat glue only"]
    share_med, share_best = glue[0] / ktae[0], glue[1] / ktae[1]
    verdict = "ok" if min(share_med, share_best) <= 0.25 else "OVER"
    print(
        f"  {'glue share of in-process adv_ktae':46s} {share_med:5.0%} median, "
        f"{share_best:5.0%} best (goal <= 25%) {verdict}"
    )
    if server is not None:
        ratio(
            "adv_grpo HTTP (Arrow)",
            "verl grpo_vectorized",
            1.05,
            "adv_grpo HTTP / verl grpo_vectorized",
        )
        ratio("adv_ktae HTTP (Arrow)", "adv_ktae in-process", 2.0, "adv_ktae HTTP / in-process")
        ratio("adv_ktae gRPC", "adv_ktae in-process", 2.0, "adv_ktae gRPC / in-process")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

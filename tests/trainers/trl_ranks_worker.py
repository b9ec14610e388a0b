"""One rank of a TRL run on several CPU processes (``torchrun --nproc-per-node 2``, gloo): the
tiny model of clients/examples/trl_tiny.py trained with KTAE (history per prompt) against a
running service. Each rank writes what it trained on, step by step, to ``<out>/rank<r>.json``.

    torchrun --nproc-per-node 2 trl_ranks_worker.py URL NAMESPACE OUT
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "clients" / "examples"))

import torch
from advantage_client.integrations.trl import AdvantageGRPOTrainer
from datasets import Dataset
from trl import GRPOConfig
from trl_tiny import KTAE_HISTORY, target_reward, tiny_model, tiny_tokenizer

# Three rows, one prompt per step; the first comes back on the third row.
PROMPTS = ["say red ball", "say big box", "say red ball"]


# A rank that hangs prints every thread's stack and exits, well inside the test's timeout, so that
# the failure says where it hung (torchrun then stops the other rank).
HANG_SECONDS = 150


def main() -> None:
    faulthandler.dump_traceback_later(HANG_SECONDS, exit=True)
    url, namespace, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer, seed=0, hidden=16)
    args = GRPOConfig(
        output_dir=str(out / "trainer"),
        per_device_train_batch_size=2,  # 2 ranks x 2 = one prompt's 4 completions per step
        num_generations=4,
        max_completion_length=6,
        max_steps=3,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        temperature=1.5,
        disable_tqdm=True,
    )
    steps: list[dict[str, Any]] = []

    class Recording(AdvantageGRPOTrainer):  # type: ignore[misc]
        def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
            output: dict[str, Any] = super()._generate_and_score_completions(inputs)
            assert self.last_all_advantages is not None
            steps.append(
                {
                    "prompts": sorted({row["prompt"] for row in inputs}),
                    "all": self.last_all_advantages.tolist(),
                    "local": output["advantages"].tolist(),
                    "call": self.advantage_calls[-1] if self.accelerator.is_main_process else None,
                }
            )
            return output

    trainer = Recording(
        model=model,
        reward_funcs=target_reward,
        args=args,
        train_dataset=Dataset.from_dict(
            {"prompt": PROMPTS, "targets": [p.split()[1:] for p in PROMPTS]}
        ),
        processing_class=tokenizer,
        advantage_estimator=KTAE_HISTORY,
        advantage_url=url,
        advantage_options={"namespace": namespace},
    )
    trainer.train()
    rank = trainer.accelerator.process_index
    (out / f"rank{rank}.json").write_text(
        json.dumps({"rank": rank, "world": trainer.accelerator.num_processes, "steps": steps})
    )
    torch.distributed.barrier()
    # Both ranks' work is written: leave at once. Left to the interpreter's exit, gloo's threads
    # can be destroyed while joinable and abort the rank ("terminate called without an active
    # exception", exit code -6); torn down with destroy_process_group, the group now and then
    # never returns (a run of this test hung past its 220 s after both ranks had trained; a
    # known gloo teardown hang, pytorch/pytorch#75097).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

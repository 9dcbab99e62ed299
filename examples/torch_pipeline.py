"""Interleaved 1F1B and ZB-H1 running on PyTorch's own pipelining runtime (not DeepSpeed's).

DeepSpeed's pipeline engine holds one stage per rank, so it cannot run interleaved 1F1B (several
stages per rank) or the zero-bubble schedules (the backward split into input and weight
gradients). `pipectl.runtime.torch_pipeline` runs pipectl's own `Schedule` objects, the ones the
simulator times, on `torch.distributed.pipelining`'s runtime. It is not a launch engine yet (no
checkpoints, data parallelism or metrics): this example starts two local gloo ranks itself.

    .venv/bin/python examples/torch_pipeline.py [--steps 20]

prints, per schedule, the losses (equal across schedules and to one process within 1e-4) and the
median step time of the slower rank.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

from pipectl.runtime.torch_pipeline import TorchPipelineJob, even_cuts, reference_run, spawn_local  # noqa: E402
from pipectl.schedule import interleaved, one_f_one_b, zb_h1  # noqa: E402

LAYERS = 9  # gpt-tiny: embedding, 6 blocks, final norm, head (tied to the embedding)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=8)
    args = parser.parse_args()
    m, steps, batch = args.micro_batches, args.steps, args.global_batch
    jobs = {
        "1f1b p2": TorchPipelineJob("gpt-tiny", one_f_one_b(2, m), even_cuts(LAYERS, 2), steps, batch),
        "interleaved p2 v2": TorchPipelineJob("gpt-tiny", interleaved(2, m, 2), even_cuts(LAYERS, 4), steps, batch),
        "zb-h1 p2": TorchPipelineJob("gpt-tiny", zb_h1(2, m), even_cuts(LAYERS, 2), steps, batch),
    }
    outcomes = spawn_local(list(jobs.values()), timeout_seconds=600)
    reference = reference_run(jobs["1f1b p2"])
    for index, (name, job) in enumerate(jobs.items()):
        ranks = [outcomes[rank][index] for rank in sorted(outcomes)]
        losses = next(r.losses for r in ranks if r.losses)
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
        step = max(r.median_step_seconds(skip=2) for r in ranks)
        print(f"{name:18s} median step {step * 1e3:6.1f} ms (slower rank, steps 3-{steps}); "
              f"losses {losses[0]:.4f} .. {losses[-1]:.4f}, max relative difference to one process {worst:.1e}")
        print(f"{'':18s} rank 0 ran: {' '.join(ranks[0].executed[-1])}")


if __name__ == "__main__":
    main()

"""Interleaved 1F1B and ZB-H1 running on PyTorch's own pipelining runtime (not DeepSpeed's).

DeepSpeed's pipeline engine holds one stage per rank, so it cannot run interleaved 1F1B (several
stages per rank) or the zero-bubble schedules (the backward split into input and weight
gradients). `pipectl.runtime.engines.torch_pipeline` runs pipectl's own `Schedule` objects, the ones the
simulator times, on `torch.distributed.pipelining`'s runtime. This example starts two local gloo
ranks itself, without a run directory; `pipectl plan --engine torch` plans for that runtime and
`pipectl launch` runs such a plan with checkpoints, metrics and resizes.

    python examples/torch_pipeline.py [--steps 20] [--schedules 1f1b,interleaved,zb-h1]
        [--profile gpt-tiny.json]

prints, per schedule (named as `--schedule` names it everywhere; interleaved with `--chunks` v),
the losses (equal across schedules and to one process within 1e-4) and the median step time of
the slower rank. With `--profile` (a gpt-tiny profile, e.g. `pipectl profile gpt-tiny -o ...`)
each schedule runs the cut the planner chose for it on two local ranks (`--engine torch`, p and
b pinned) and its predicted step time is printed beside the measured one; without, even cuts.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

from pipectl.errors import PipectlError  # noqa: E402
from pipectl.runtime.engines.torch_pipeline import TorchPipelineJob, reference_run, spawn_local  # noqa: E402
from pipectl.runtime.engines.torch_stages import even_cuts  # noqa: E402
from pipectl.schedule import ScheduleKind, generate, torch_runnable  # noqa: E402

LAYERS = 9  # gpt-tiny: embedding, 6 blocks, final norm, head (tied to the embedding)
RANKS = 2


def planned(profile_path: str, kind: ScheduleKind, chunks: int, micro_batches: int, global_batch: int):
    """The planner's candidate for this schedule on two local ranks (p = 2, d = 1, b pinned)."""
    from pipectl.artifacts.plan import Engine, PlanRequest
    from pipectl.artifacts.profile import ModelProfile
    from pipectl.cluster import load_cluster, local_cluster
    from pipectl.io import load_model
    from pipectl.plan.search import plan

    request = PlanRequest(
        global_batch=global_batch, pipeline_parallel=RANKS, data_parallel=1,
        micro_batch_size=global_batch // micro_batches, schedule=kind, chunks=[max(chunks, 2)], allow_recompute=False,
        engine=Engine.TORCH, morph=False, workers=1,
    )  # fmt: skip
    profile = load_model(ModelProfile, profile_path)
    return plan(profile, local_cluster(RANKS, load_cluster("local")), request).chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--schedules", default="1f1b,interleaved,zb-h1",
                        help="comma list of schedule names (those torch's runtime runs: 1f1b, gpipe, interleaved, zb-h1)")
    parser.add_argument("--chunks", type=int, default=2, help="v for interleaved")
    parser.add_argument("--profile", help="a gpt-tiny profile: run the planner's cuts and print its predictions")
    args = parser.parse_args()
    m, steps, batch = args.micro_batches, args.steps, args.global_batch
    kinds = []
    for name in args.schedules.split(","):
        try:
            kind = ScheduleKind(name.strip())
        except ValueError:
            parser.error(f"unknown schedule {name!r}; known: {', '.join(k.value for k in ScheduleKind)}")
        if not torch_runnable(kind):
            parser.error(f"torch's pipelining runtime does not run {kind.value}")
        kinds.append(kind)
    jobs, predictions = {}, {}
    for kind in kinds:
        v = args.chunks if kind is ScheduleKind.INTERLEAVED else 1
        name = f"{kind.value} p{RANKS}" + (f" v{v}" if v > 1 else "")
        cuts = even_cuts(LAYERS, RANKS * v)
        if args.profile:
            try:
                candidate = planned(args.profile, kind, v, m, batch)
            except PipectlError as exc:  # a missing or unreadable profile: one line, exit 2
                parser.error(f"--profile {args.profile}: {exc.message}" + (f" ({exc.hint})" if exc.hint else ""))
            cuts = tuple(tuple(stage) for stage in candidate.stage_layers)
            predictions[name] = candidate.predicted_step_seconds
        jobs[name] = TorchPipelineJob("gpt-tiny", generate(kind, RANKS, m, v), cuts, steps, batch)
    outcomes = spawn_local(list(jobs.values()), timeout_seconds=600)
    reference = reference_run(next(iter(jobs.values())))
    for index, (name, job) in enumerate(jobs.items()):
        ranks = [outcomes[rank][index] for rank in sorted(outcomes)]
        losses = next(r.losses for r in ranks if r.losses)
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
        step = max(r.median_step_seconds(skip=2) for r in ranks)
        predicted = f", predicted {predictions[name] * 1e3:6.1f} ms" if name in predictions else ""
        print(f"{name:18s} median step {step * 1e3:6.1f} ms (slower rank, steps 3-{steps}){predicted}; "
              f"losses {losses[0]:.4f} .. {losses[-1]:.4f}, max relative difference to one process {worst:.1e}")
        print(f"{'':18s} cuts {list(job.cuts)}; rank 0 ran: {' '.join(ranks[0].executed[-1])}")


if __name__ == "__main__":
    main()

"""What the step-time simulator reads: a step's costs per virtual stage, in seconds (`StageCosts`),
equal stages for examples and closed forms (`uniform_costs`), and the checks every simulation
makes of them (`check_costs`). `plan.cost_table` builds them from a profile and the hardware;
`plan.simulate` times a schedule with them.

The split backward. Profiles measure a layer's backward whole (t_b); a zero-bubble schedule runs
it as I (the input's gradient, what the previous stage waits for) and W (the weights' gradient).
`StageCosts.backward_input_fraction` says how t_b divides: t_I = fraction × t_b, t_W = t_b − t_I.
Its default `BACKWARD_INPUT_FRACTION` = 1/2 is the zero-bubble paper's assumption for transformer
blocks (Qi et al., ICLR 2024, §2: T_F ≈ T_B ≈ T_W, each a pair of matrix products per weight); a
profile that ever carries the split should set the fraction from it. The zb-h1 line above is the
paper's Table 1 (ZB-H1's bubble (p − 1)(T_F + T_B − T_W) against 1F1B's (p − 1)(T_F + T_B + T_W),
its T_B being our t_I): with t_f = 1, t_I = t_W = 1 a step of p = 4, m = 8 takes 27 against 1F1B's 33.
It holds while each W fits the gap it fills (t_W ≤ t_f and t_W ≤ t_I); a longer W delays what
follows it and the step is longer than the formula (still shorter than 1F1B's on equal stages:
tests/plan/test_zero_bubble_timing.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipectl.errors import UserInputError

# The zero-bubble paper's split of a transformer block's backward (module docstring): t_I = t_W.
BACKWARD_INPUT_FRACTION = 0.5


@dataclass(frozen=True)
class StageCosts:
    """Costs of one step, per virtual stage s in 0..p*v-1 (rank = `Schedule.rank_of(s)`: s % p, a V for zbv). Seconds throughout."""

    forward_seconds: Sequence[float]  # len p*v, per micro-batch
    backward_seconds: Sequence[float]  # len p*v, per micro-batch
    recompute_seconds: Sequence[float]  # len p*v (used only by R actions)
    send_forward_seconds: Sequence[float]  # len p*v-1: activation s -> s+1 (latency + bytes/bw)
    send_backward_seconds: Sequence[float]  # len p*v-1: gradient s+1 -> s
    allreduce_seconds: Sequence[float]  # len p: data-parallel gradient all-reduce per rank (0 if d=1)
    optimizer_seconds: Sequence[float]  # len p
    jitter_seconds: float = 0.0  # std. dev. of a p2p transfer's extra delay
    seed: int = 0
    # Sends return only once the matching receive runs (gloo): timed by `simulate_rendezvous`.
    blocking_p2p: bool = False
    # Split backward (I, W actions): I takes this fraction of `backward_seconds`, W the rest.
    backward_input_fraction: float = BACKWARD_INPUT_FRACTION


def uniform_costs(
    pipeline_parallel: int,
    chunks: int,
    forward: float,
    backward: float,
    *,
    recompute: float | None = None,
    send: float = 0.0,
    allreduce: float = 0.0,
    optimizer: float = 0.0,
    jitter: float = 0.0,
    seed: int = 0,
) -> StageCosts:
    """Equal stages: `forward`/`backward` are one micro-batch through a rank's whole share of the
    model (t_f, t_b); each of its v chunks costs 1/v of that. `recompute` defaults to the chunk's
    forward time (recomputation re-runs the forward, Megatron's ×4/3 rule); `send` is the time of
    one p2p transfer at every boundary, in either direction.

    >>> uniform_costs(2, 2, 1.0, 2.0).forward_seconds
    (0.5, 0.5, 0.5, 0.5)
    """
    stages = pipeline_parallel * chunks
    forward_chunk = forward / chunks
    backward_chunk = backward / chunks
    recompute_chunk = forward_chunk if recompute is None else recompute / chunks
    return StageCosts(
        forward_seconds=(forward_chunk,) * stages,
        backward_seconds=(backward_chunk,) * stages,
        recompute_seconds=(recompute_chunk,) * stages,
        send_forward_seconds=(send,) * (stages - 1),
        send_backward_seconds=(send,) * (stages - 1),
        allreduce_seconds=(allreduce,) * pipeline_parallel,
        optimizer_seconds=(optimizer,) * pipeline_parallel,
        jitter_seconds=jitter,
        seed=seed,
    )


# --------------------------------------------------------------------------------- simulation


def check_costs(pipeline_parallel: int, stages: int, costs: StageCosts) -> None:
    p = pipeline_parallel
    expected = {
        "forward_seconds": stages,
        "backward_seconds": stages,
        "recompute_seconds": stages,
        "send_forward_seconds": stages - 1,
        "send_backward_seconds": stages - 1,
        "allreduce_seconds": p,
        "optimizer_seconds": p,
    }
    for name, length in expected.items():
        values = getattr(costs, name)
        if len(values) != length:
            raise UserInputError(
                f"costs.{name} has {len(values)} entries, expected {length} "
                f"(p={p}, {stages} virtual stages)"
            )
        if len(values) and not min(values) >= 0:
            raise UserInputError(f"costs.{name} must be >= 0, got {list(values)}")
    if not costs.jitter_seconds >= 0:
        raise UserInputError(f"costs.jitter_seconds must be >= 0, got {costs.jitter_seconds}")
    if not 0 <= costs.backward_input_fraction <= 1:
        raise UserInputError(
            f"costs.backward_input_fraction must be in [0, 1], got {costs.backward_input_fraction}"
        )


__all__ = [
    "BACKWARD_INPUT_FRACTION",
    "check_costs",
    "StageCosts",
    "uniform_costs",
]

"""pipectl's blocking pipeline against DeepSpeed's own instruction order.

Rows of DeepSpeed's pipeline engine (`blocking_p2p`) are timed by `simulate_rendezvous` on pipectl's
1F1B with sends and receives placed by `schedule.comm`, not by the parity arithmetic of DeepSpeed's
`TrainSchedule` (deepspeed/runtime/pipe/schedule.py), which defers each send to the start of the next
step. Replaying DeepSpeed's real instruction lists under the same rendezvous semantics (a send and its
receive start once both ranks reach them and hold both for the transfer) bounds what that difference
can explain: deep pipelines of uneven stages with slow transfers time within a few per cent, DeepSpeed's
order never slower. So a deep pipeline that ran much slower than predicted lost the time elsewhere.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipectl.plan.simulate import simulate
from pipectl.plan.stage_costs import uniform_costs
from pipectl.schedule import generate
from pipectl.schedule.ir import ScheduleKind

schedule = pytest.importorskip("deepspeed.runtime.pipe.schedule")

PEERS = {  # instruction: (the peer's stage offset, the peer's matching instruction)
    "SendActivation": (1, "RecvActivation"), "RecvActivation": (-1, "SendActivation"),
    "SendGrad": (-1, "RecvGrad"), "RecvGrad": (1, "SendGrad"),
}  # fmt: skip


def deepspeed_program(p: int, m: int) -> dict[int, list[str]]:
    """Each stage's computes and transfers, in the order DeepSpeed's TrainSchedule issues them."""
    kept = {"ForwardPass", "BackwardPass", *PEERS}
    return {
        stage: [type(c).__name__ for step in schedule.TrainSchedule(micro_batches=m, stages=p, stage_id=stage).steps()
                for c in step if type(c).__name__ in kept]
        for stage in range(p)
    }  # fmt: skip


def replay(program: dict[int, list[str]], forward: list[float], backward: list[float], transfer: float) -> float:
    """The step's makespan with every transfer a rendezvous of `transfer` seconds."""
    at = dict.fromkeys(program, 0)
    clock = dict.fromkeys(program, 0.0)
    while any(at[s] < len(program[s]) for s in program):
        moved = False
        for s, ops in program.items():
            while at[s] < len(ops):
                op = ops[at[s]]
                if op in ("ForwardPass", "BackwardPass"):
                    clock[s] += forward[s] if op == "ForwardPass" else backward[s]
                    at[s] += 1
                    moved = True
                    continue
                offset, matching = PEERS[op]
                peer = s + offset
                if at[peer] >= len(program[peer]) or program[peer][at[peer]] != matching:
                    break
                clock[s] = clock[peer] = max(clock[s], clock[peer]) + transfer
                at[s] += 1
                at[peer] += 1
                moved = True
        assert moved, "DeepSpeed's order deadlocked under rendezvous semantics"
    return max(clock.values())


@pytest.mark.parametrize("p, m", [(2, 8), (4, 16), (8, 16), (16, 32)])
@pytest.mark.parametrize("transfer", [0.0, 0.05, 0.2])
def test_deepspeeds_order_times_as_pipectls_blocking_1f1b(p, m, transfer):
    forward, backward = [1.0] * p, [3.0] * p  # backward with its recomputation
    forward[-1], backward[-1] = 1.5, 4.5  # the head and the loss on the last stage
    ours = simulate(generate(ScheduleKind.ONE_F_ONE_B, p, m), replace(
        uniform_costs(p, 1, 1.0, 3.0, send=transfer), forward_seconds=forward, backward_seconds=backward,
        blocking_p2p=True)).step_seconds  # fmt: skip
    theirs = replay(deepspeed_program(p, m), forward, backward, transfer)
    if transfer == 0.0:  # free transfers: nobody waits at a rendezvous in either order
        assert theirs == pytest.approx(ours)
    assert 0.97 * ours <= theirs <= ours * (1 + 1e-9)

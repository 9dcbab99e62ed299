"""Schedule generators: pure functions `(p, m, v) -> Schedule` with compute actions only.

Each generator returns, for every rank, the ordered forward (F), backward (B) and recompute (R)
actions of one optimizer step, followed by one all-reduce (AR) and one optimizer step (STEP).
Sends and receives are added by a separate pass (`pipectl.schedule.comm.add_communication`); timing
by the simulator (`pipectl.plan.simulate`). docs/design.md, 'Schedules and the bubble', describes every schedule here.

The AR and STEP actions carry the rank as their stage (the rank's chunk-0 virtual stage).

Worked example, 1F1B with flush on p=2 ranks and m=3 micro-batches (stage 0 warms up with
p - 0 - 1 = 1 forward, stage 1 with none):

    >>> print(one_f_one_b(2, 3).to_text(), end="")
    # 1f1b p=2 m=3 v=1
    0: 0F0 0F1 0B0 0F2 0B1 0B2 0AR 0STEP
    1: 1F0 1B0 1F1 1B1 1F2 1B2 1AR 1STEP

`generate` is the single dispatch everyone uses; it is cached, so the returned `Schedule` is shared:
treat it (and its `actions` mapping) as immutable.
"""

from __future__ import annotations

from functools import lru_cache

from pipectl.errors import ScheduleError
from pipectl.schedule.ir import Action, ActionKind, Schedule, ScheduleKind
from pipectl.schedule.varuna_order import varuna_order

F = ActionKind.FORWARD
B = ActionKind.BACKWARD
R = ActionKind.RECOMPUTE


def _check_degrees(pipeline_parallel: int, micro_batches: int, chunks: int = 1) -> None:
    for name, value in (
        ("pipeline-parallel degree p", pipeline_parallel),
        ("micro-batches per step m", micro_batches),
        ("chunks per rank v", chunks),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(f"{name} must be a whole number >= 1, got {value!r}")


def _finish(
    kind: ScheduleKind,
    pipeline_parallel: int,
    micro_batches: int,
    chunks: int,
    compute: list[list[Action]],
) -> Schedule:
    """Append AR and STEP to every rank's compute order and freeze it into a `Schedule`."""
    actions = {
        rank: tuple(order)
        + (Action(rank, ActionKind.ALL_REDUCE), Action(rank, ActionKind.OPTIMIZER_STEP))
        for rank, order in enumerate(compute)
    }
    return Schedule(kind, pipeline_parallel, micro_batches, chunks, actions)


def _insert_recompute(compute: list[list[Action]], last_stage: int) -> list[list[Action]]:
    """Put R(i) right before every B(i), except on the last (virtual) stage.

    The last stage runs its backward straight after its forward, so its activations are never
    dropped; recomputing them would only cost time (Varuna §3.2, Megatron's checkpointing).
    """
    out = []
    for order in compute:
        with_r: list[Action] = []
        for action in order:
            if action.kind is B and action.stage != last_stage:
                with_r.append(Action(action.stage, R, action.microbatch))
            with_r.append(action)
        out.append(with_r)
    return out


def _gpipe_order(p: int, m: int) -> list[list[Action]]:
    return [[Action(s, F, i) for i in range(m)] + [Action(s, B, i) for i in range(m)] for s in range(p)]


def _one_f_one_b_order(p: int, m: int) -> list[list[Action]]:
    """PipeDream-Flush: min(p - s - 1, m) warm-up forwards, then F/B pairs, then drain backwards."""
    compute = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        order = [Action(s, F, i) for i in range(warmup)]
        for i in range(m - warmup):
            order.append(Action(s, F, warmup + i))
            order.append(Action(s, B, i))
        order.extend(Action(s, B, i) for i in range(m - warmup, m))
        compute.append(order)
    return compute


def gpipe(pipeline_parallel: int, micro_batches: int, recompute: bool = False) -> Schedule:
    """GPipe: all m forwards, then all m backwards (in micro-batch order); flush; step.

    >>> print(gpipe(2, 2).to_text(), end="")
    # gpipe p=2 m=2 v=1
    0: 0F0 0F1 0B0 0B1 0AR 0STEP
    1: 1F0 1F1 1B0 1B1 1AR 1STEP
    """
    _check_degrees(pipeline_parallel, micro_batches)
    compute = _gpipe_order(pipeline_parallel, micro_batches)
    if recompute:
        compute = _insert_recompute(compute, pipeline_parallel - 1)
    return _finish(ScheduleKind.GPIPE, pipeline_parallel, micro_batches, 1, compute)


def one_f_one_b(pipeline_parallel: int, micro_batches: int, recompute: bool = False) -> Schedule:
    """1F1B with flush (PipeDream-Flush, Narayanan et al. 2021 §3.1); see the module docstring."""
    _check_degrees(pipeline_parallel, micro_batches)
    compute = _one_f_one_b_order(pipeline_parallel, micro_batches)
    if recompute:
        compute = _insert_recompute(compute, pipeline_parallel - 1)
    return _finish(ScheduleKind.ONE_F_ONE_B, pipeline_parallel, micro_batches, 1, compute)


def interleaved(
    pipeline_parallel: int, micro_batches: int, chunks: int, recompute: bool = False
) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021 §2.2), in Megatron-LM's order.

    Rank k holds chunks c = 0..v-1, i.e. virtual stages k, k+p, k+2p, ...; virtual stage
    s = c·p + k. The m·v "virtual micro-batches" of a rank are visited in groups of p: virtual
    micro-batch j runs chunk (j mod p·v) // p (reversed for backwards) on micro-batch
    (j // (p·v))·p + j mod p. Rank k warms up with 2(p-k-1) + (v-1)·p forwards (all of them when
    m == p, as Megatron does), then alternates one forward and one backward, then drains.
    Requires m to be a multiple of p when v > 1; with v == 1 this is plain 1F1B.

    >>> print(interleaved(2, 2, 2).to_text(), end="")
    # interleaved p=2 m=2 v=2
    0: 0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1 0AR 0STEP
    1: 1F0 1F1 3F0 3F1 3B0 3B1 1B0 1B1 1AR 1STEP
    """
    p, m, v = pipeline_parallel, micro_batches, chunks
    _check_degrees(p, m, v)
    if v == 1:
        compute = _one_f_one_b_order(p, m)
    else:
        if m % p != 0:
            raise ScheduleError(
                f"interleaved schedule needs micro-batches m={m} to be a multiple of the "
                f"pipeline-parallel degree p={p} (v={v} chunks)",
                hint=f"use m in {{{p}, {2 * p}, {3 * p}, ...}} or the 1f1b schedule",
            )
        compute = [_interleaved_rank_order(p, m, v, rank) for rank in range(p)]
    if recompute:
        compute = _insert_recompute(compute, p * v - 1)
    return _finish(ScheduleKind.INTERLEAVED, p, m, v, compute)


def _interleaved_rank_order(p: int, m: int, v: int, rank: int) -> list[Action]:
    total = m * v
    group = p * v

    def action(j: int, kind: ActionKind) -> Action:
        chunk = (j % group) // p
        if kind is B:
            chunk = v - 1 - chunk
        microbatch = (j // group) * p + j % p
        return Action(chunk * p + rank, kind, microbatch)

    if m == p:
        warmup = total
    else:
        warmup = min(2 * (p - rank - 1) + (v - 1) * p, total)
    order = [action(j, F) for j in range(warmup)]
    for j in range(total - warmup):
        order.append(action(warmup + j, F))
        order.append(action(j, B))
    order.extend(action(j, B) for j in range(total - warmup, total))
    return order


def pipedream_2bw(pipeline_parallel: int, micro_batches: int, recompute: bool = False) -> Schedule:
    """PipeDream-2BW (Narayanan et al. 2021 §3.1): 1F1B order, no flush, two weight versions.

    One step's representation is the 1F1B order; what differs is the semantics, which the runtime
    and the planner must honour: there is no pipeline flush between steps, and micro-batch k
    (1-based, counted over the whole run) uses weight version `weight_version(k, m)` =
    max(⌊(k−1)/m⌋ − 1, 0), so updates are 1-stale: W(t+1) = W(t) − ν·∇f(W(t−1)). This is a
    different optimizer: `ScheduleKind.PIPEDREAM_2BW.changes_optimizer_semantics` is True and it
    must never be chosen silently.
    """
    _check_degrees(pipeline_parallel, micro_batches)
    compute = _one_f_one_b_order(pipeline_parallel, micro_batches)
    if recompute:
        compute = _insert_recompute(compute, pipeline_parallel - 1)
    return _finish(ScheduleKind.PIPEDREAM_2BW, pipeline_parallel, micro_batches, 1, compute)


def weight_version(microbatch_number: int, micro_batches: int) -> int:
    """PipeDream-2BW: the weight version used by micro-batch k (1-based): max(⌊(k−1)/m⌋ − 1, 0).

    >>> [weight_version(k, 2) for k in range(1, 9)]
    [0, 0, 0, 0, 1, 1, 2, 2]
    """
    if microbatch_number < 1:
        raise ScheduleError(f"micro-batch numbers are 1-based, got {microbatch_number}")
    if micro_batches < 1:
        raise ScheduleError(f"micro-batches per step m must be >= 1, got {micro_batches}")
    return max((microbatch_number - 1) // micro_batches - 1, 0)


def varuna(
    pipeline_parallel: int,
    micro_batches: int,
    forward_seconds: float = 1.0,
    backward_seconds: float = 2.0,
) -> Schedule:
    """Varuna's rule-based schedule with recomputation (Athlur et al., EuroSys 2022, §3.2).

    Derived as Varuna does, from a simulation of one step with uniform stage times (one forward
    `forward_seconds` = T_f, one backward `backward_seconds`, one recompute = T_f, free
    communication) in which an idle stage runs a due recompute, then its backward, before its
    next forward: `pipectl.schedule.varuna_order` states the rules. The last stage does not
    recompute: it runs B(i) right after F(i).

    >>> print(varuna(2, 3).to_text(), end="")
    # varuna p=2 m=3 v=1
    0: 0F0 0F1 0F2 0R0 0B0 0R1 0B1 0R2 0B2 0AR 0STEP
    1: 1F0 1B0 1F1 1B1 1F2 1B2 1AR 1STEP
    """
    p, m = pipeline_parallel, micro_batches
    _check_degrees(p, m)
    if not (forward_seconds > 0 and backward_seconds > 0):
        raise ScheduleError(
            f"Varuna's schedule needs positive stage times, got forward {forward_seconds!r} s, "
            f"backward {backward_seconds!r} s"
        )
    return _finish(ScheduleKind.VARUNA, p, m, 1, varuna_order(p, m, forward_seconds, backward_seconds))


@lru_cache(maxsize=4096)
def generate(
    kind: ScheduleKind,
    pipeline_parallel: int,
    micro_batches: int,
    chunks: int = 1,
    recompute: bool = False,
    *,
    forward_seconds: float = 1.0,
    backward_seconds: float = 2.0,
) -> Schedule:
    """The one dispatch everyone uses: `generate(ScheduleKind.ONE_F_ONE_B, p, m)`.

    `chunks` (v) is only meaningful for the interleaved schedule, and must be 2 for zbv. Varuna always recomputes (it is
    defined with recomputation; `recompute` is ignored for it), zb-h1 never does (its W holds the
    activations until the drain; `recompute` is ignored for it too: the planner never pairs them), and its order is derived with
    uniform stage times `forward_seconds`/`backward_seconds` (only their ratio matters). The result
    is cached and shared: do not mutate it.

    >>> generate(ScheduleKind.GPIPE, 4, 8, recompute=True).actions[0][8]
    Action(stage=0, kind=<ActionKind.RECOMPUTE: 'R'>, microbatch=0)
    """
    try:
        kind = ScheduleKind(kind)
    except ValueError:
        known = ", ".join(k.value for k in ScheduleKind)
        raise ScheduleError(f"unknown schedule {kind!r}", hint=f"known schedules: {known}") from None
    _check_degrees(pipeline_parallel, micro_batches, chunks)
    if kind is ScheduleKind.ZBV:
        if chunks != 2:
            raise ScheduleError(
                f"the zbv schedule holds exactly 2 chunks per rank (a V), got v={chunks}",
                hint="pass v=2 (--chunks 2) with --schedule zbv",
            )
        return zbv(pipeline_parallel, micro_batches)
    if chunks != 1 and kind is not ScheduleKind.INTERLEAVED:
        raise ScheduleError(
            f"chunks v={chunks} needs the interleaved schedule, not {kind.value}",
            hint="pass --schedule interleaved, or v=1",
        )
    if kind is ScheduleKind.GPIPE:
        return gpipe(pipeline_parallel, micro_batches, recompute)
    if kind is ScheduleKind.ONE_F_ONE_B:
        return one_f_one_b(pipeline_parallel, micro_batches, recompute)
    if kind is ScheduleKind.INTERLEAVED:
        return interleaved(pipeline_parallel, micro_batches, chunks, recompute)
    if kind is ScheduleKind.VARUNA:
        return varuna(pipeline_parallel, micro_batches, forward_seconds, backward_seconds)
    if kind is ScheduleKind.ZB_H1:
        return zb_h1(pipeline_parallel, micro_batches)
    return pipedream_2bw(pipeline_parallel, micro_batches, recompute)


def generate_for_stage_times(
    kind: ScheduleKind, pipeline_parallel: int, micro_batches: int, chunks: int = 1, recompute: bool = False, *,
    forward_seconds: float, backward_seconds: float,
) -> Schedule:
    """`generate` for stages whose forward and backward take these times (a uniform pipeline).

    Varuna derives its order from the stage times it profiled, so here from these: another ratio
    of backward to forward gives another order. With a zero time there is no ratio to derive
    from, and Varuna keeps `generate`'s 1:2. No other schedule's order depends on the times.

    >>> generate_for_stage_times(ScheduleKind.VARUNA, 3, 6, forward_seconds=1.0, backward_seconds=3.0) == (
    ...     generate(ScheduleKind.VARUNA, 3, 6, forward_seconds=1.0, backward_seconds=3.0))
    True
    """
    if kind is ScheduleKind.VARUNA and forward_seconds > 0 and backward_seconds > 0:
        return generate(kind, pipeline_parallel, micro_batches, chunks, recompute,
                        forward_seconds=forward_seconds, backward_seconds=backward_seconds)  # fmt: skip
    return generate(kind, pipeline_parallel, micro_batches, chunks, recompute)


def zb_h1(pipeline_parallel: int, micro_batches: int) -> Schedule:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, §3): 1F1B with every
    backward split into I (input gradient, what the previous stage waits for) and W (weight
    gradient, which nothing downstream waits for), and W's postponed into the drain.

    Stage s runs 1F1B's w = min(p−s−1, m) warm-up forwards, then F/I pairs with I in B's place;
    it runs W(i) right after I(i + d), d = min(s, m) (the last stage postpones the most), and the d
    W's still due at the end close the step. At most w + 1 + d ≤ p micro-batches are in flight on
    any stage, 1F1B's peak: ZB-H1 trades no memory for its smaller bubble (with t_I = t_W the
    drain's idle time shrinks to about a third).

    Its kind is `ScheduleKind.ZB_H1` (`generate` dispatches it). Only the torch pipelining path
    runs it; DeepSpeed's engine cannot. The simulator times I and W (`pipectl.plan.simulate`:
    I = `backward_input_fraction` x B, W the rest); with t_f = 1, t_I = t_W = 1 and free
    communication the step is m (t_f + t_b) + (p − 1)(t_f + t_I − t_W) (m ≥ p; while t_W ≤ t_f, t_I), against 1F1B's
    (m + p − 1)(t_f + t_b) (the zero-bubble paper's Table 1 bubbles, t_b = t_I + t_W).

    >>> print(zb_h1(2, 3).to_text(), end="")
    # zb-h1 p=2 m=3 v=1
    0: 0F0 0F1 0I0 0W0 0F2 0I1 0W1 0I2 0W2 0AR 0STEP
    1: 1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1W2 1AR 1STEP
    """
    I, W = ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT
    p, m = pipeline_parallel, micro_batches
    _check_degrees(p, m)
    compute = []
    for s, order in enumerate(_one_f_one_b_order(p, m)):
        delay = min(s, m)
        out: list[Action] = []
        for action in order:
            if action.kind is not B:
                out.append(action)
                continue
            out.append(Action(s, I, action.microbatch))
            if action.microbatch >= delay:
                out.append(Action(s, W, action.microbatch - delay))
        out.extend(Action(s, W, i) for i in range(m - delay, m))
        compute.append(out)
    return _finish(ScheduleKind.ZB_H1, p, m, 1, compute)


def zbv(pipeline_parallel: int, micro_batches: int) -> Schedule:
    """ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, §4 and Fig. 5): two model
    chunks per rank placed as a V, every backward split into I then W.

    Rank k holds chunk 0 = virtual stage k and chunk 1 = virtual stage 2p − 1 − k
    (`pipectl.schedule.ir.stage_rank`), so a micro-batch's forward runs down the ranks and back up,
    and its backward the same way in reverse; the turn of the V (stages p − 1 and p, both on rank
    p − 1) sends nothing. Rank k's order, with F0/I0/W0 its chunk-0 actions and F1/I1/W1 its
    chunk-1 actions, each chunk taking its micro-batches in order:

    - warm-up: 2(p − k) − 1 × F0, then k × (F1 F0), then p − k × (F1 I1 W1);
    - steady: while chunk 0 or chunk 1 has a forward left: (F0 if any left) I0 W0 F1 I1 W1;
    - cool-down: k × (I0 I1), then p − k × (I0 W0), then the W1's and W0's still due.

    Rank 0 warms up with 2p − 1 chunk-0 forwards before its first backward, so the order needs
    m ≥ 2p − 1 micro-batches; fewer are refused. With T_F = T_B = T_W (per rank, so each chunk's
    F, I and W take half of that) and free communication, the step is m(T_F + T_B + T_W) − a
    zero bubble, as the paper's Table 3 gives ((p − 1)(T_F + T_B − 2T_W) for ZB-V), at the
    memory of 1F1B: at most 2p chunk activations, p full-stage ones, in flight on a rank.

    >>> print(zbv(2, 3).to_text(), end="")
    # zbv p=2 m=3 v=2
    0: 0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 3F2 3I2 3W2 0I1 0W1 0I2 0W2 0AR 0STEP
    1: 1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1I1 2I2 1I2 1W1 2W2 1W2 1AR 1STEP
    """
    I, W = ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT
    p, m = pipeline_parallel, micro_batches
    _check_degrees(p, m)
    if m < 2 * p - 1:
        raise ScheduleError(
            f"the zbv schedule needs micro-batches m >= 2p - 1 = {2 * p - 1} for p={p}, got m={m} "
            f"(rank 0 warms up with 2p - 1 forwards of its first chunk)",
            hint=f"use m >= {2 * p - 1}, or the zb-h1 schedule",
        )
    compute = []
    for rank in range(p):
        first, second = rank, 2 * p - 1 - rank
        order: list[Action] = []
        count = {(first, F): 0, (first, I): 0, (first, W): 0, (second, F): 0, (second, I): 0, (second, W): 0}

        def run(stage: int, kind: ActionKind) -> None:
            order.append(Action(stage, kind, count[(stage, kind)]))
            count[(stage, kind)] += 1

        for _ in range(2 * (p - rank) - 1):
            run(first, F)
        for _ in range(rank):
            run(second, F)
            run(first, F)
        for _ in range(p - rank):
            run(second, F)
            run(second, I)
            run(second, W)
        while count[(first, F)] < m or count[(second, F)] < m:
            if count[(first, F)] < m:
                run(first, F)
            run(first, I)
            run(first, W)
            run(second, F)
            run(second, I)
            run(second, W)
        for _ in range(rank):
            run(first, I)
            run(second, I)
        for _ in range(p - rank):
            run(first, I)
            run(first, W)
        while count[(second, W)] < m:
            run(second, W)
        while count[(first, W)] < m:
            run(first, W)
        compute.append(order)
    return _finish(ScheduleKind.ZBV, p, m, 2, compute)

"""Lower bounds on a spec's simulated step time, for pruning: what need not be timed at all.

**Chains** (`chain_bound_seconds`, every spec; `candidates.lower_bound_seconds`):

    LB = max over ranks k of  F-chain(k) + m * work(k) + max(AR(k) + opt(k), B-chain(k) + AR(0) + opt(0))

where work(k) is the rank's forward+backward(+recompute) time per micro-batch, F-chain(k) the
forwards (and transfers) of micro-batch 0 through the stages before k, which must precede rank k's
first action, and B-chain(k) the backwards through the stages before k, which must follow its
last one (then rank 0 still all-reduces and steps). Every schedule runs each rank's actions one
at a time and respects those dependencies, so no simulated step is shorter. With equal stages and
free communication it is exactly (m + p − 1)(t_f + t_b) (docs/design.md, 'Schedules and the bubble'), so pruning by it is tight.

**PipeDream-2BW** (`two_bw_bound_seconds`, every 2BW spec). A 2BW candidate is priced per
update in steady state (`pipectl.plan.timing.two_bw_summary_of`), not as a step with a fill and a
drain, so the chains do not bound it. Between its updates T and T + K each stage runs K m
forwards, backwards (and recomputes) and K updates, one at a time, so the mean interval is at
least

    LB = max over ranks k of  m * work(k) + AR(k) + opt(k)

and with equal stages and free communication it is exactly m (t_f + t_b) (+ the update).
The in-flight loops below bound the flushed step: they are not applied to 2BW.

**Zero bubble** (`zero_bubble_bound_seconds`, every zb-h1 spec). Its backward is split into I,
which the stage before waits for, and W, which nothing waits for: a rank's last actions are W's
that no other rank follows, so the B-chain after it does not bound the step. What does:

    LB = max over ranks k of  F-chain(k) + m * work(k) + AR(k) + opt(k)

(I + W take the profile's whole backward, so work(k) is unchanged). Lowered by 1e-12 relative:
I and W are the backward's two parts, whose sum may differ from it in the last bit.

**1F1B's in-flight loops** (`pair_loop_bound_seconds`, tighter, for the morph table). The chains
charge each rank its micro-batches' work plus the chains before and after it. 1F1B's step is
longer when its in-flight limit binds: rank k holds at most
p − k micro-batches, and a micro-batch it starts travels to some rank k + j and back before rank
k can start another (Narayanan et al. 2021 §2.2; PipeDream-Flush). Here that loop is a path in
the step's dependency graph (the simulator's longest-path model, `pipectl.plan.simulate`):

    B(k, i) → F(k, W_k + i + 1) → F(k + 1, ·) → … → F(k + j, ·) → B(k + j, i + j + 1)
            → B(k + j − 1, i + j + 1) → … → B(k, i + j + 1)

(W_k = p − 1 − k warm-up forwards; F(k + j, W_k + i + 1) is rank k + j's pair i + j + 1, so
B(k + j, i + j + 1) follows it on that rank). One loop weighs

    C(k, j) = Σ_{k≤s≤k+j} (f_s + b_s) + r_{k+j} + Σ_{k≤s<k+j} (c_s + c'_s)

and moves j + 1 micro-batches on, so a path that reaches B(k, 0), takes the loop N times while
its forwards exist, then runs rank k's remaining actions back to back and ends at a rank's
optimizer step bounds the step from below. Every term is a duration or a transfer the simulator
adds along that path, so the bound never exceeds the simulated step (checked by hypothesis on
random non-uniform costs against the event-driven simulator).

**Varuna's warm-up and cool-down** (`varuna_bound_seconds`, for the morph table). Varuna keeps
about 3(p − 1 − k) micro-batches in flight on rank k, so its loops rarely bind; what the chains
miss is where its order, derived for equal stages and free links, meets real ones. Rank k runs
W_k forwards, then R(k, 0) and B(k, 0), which also waits for the gradient of micro-batch 0 from
the last stage; after it, the rank's remaining actions run one at a time:

    B(k, 0) ≥ max(F-chain(p − 1) + b_{p−1} + Σ_{k≤s<p−1} (c'_s + b_s),  F-chain(k) + (W_k − 1) f_k + r_k + b_k)
    step    ≥ B(k, 0) + (m − W_k) f_k + (m − 1)(r_k + b_k) + the B-chain and step after rank k

and at the end, rank j's last forward F(j, m − 1) follows its other m − 1 forwards and the
m − T_j (recompute and) backwards before it (T_j: backwards after its last forward), and
micro-batch m − 1 then goes up to the last stage and back down:

    step ≥ F-chain(j) + (m − 1) f_j + (m − T_j)(r_j + b_j) + Σ_{j<s≤p−1} (c_{s−1} + f_s) + b_{p−1}
           + the B-chain and step after the last rank

W and T come from the order itself (`pipectl.plan.fast.varuna_flags.order_ends`). The paths
follow the simulator's dependencies as the chains' do, so the bound never exceeds the simulated
step (tests/plan/fast/test_bounds.py, by hypothesis against `simulate`); at GPT-1T scale it
equals the step for most Varuna candidates, where the chains fall short by 0.05–0.2 %.
"""

from __future__ import annotations

import numpy as np

from pipectl.schedule.ir import ScheduleKind

__all__ = [
    "chain_bound_seconds",
    "has_pair_loops",
    "pair_loop_bound_seconds",
    "two_bw_bound_seconds",
    "varuna_bound_seconds",
    "zero_bubble_bound_seconds",
]


def chain_bound_seconds(forward_chain, backward_chain, work, micro_batches, allreduce, optimizer):
    """LB of the module docstring, per rank k: F-chain, work per micro-batch, B-chain, all-reduce
    and optimizer seconds. One spec (arrays over the ranks, a float back) or a batch (one row per
    spec, `micro_batches` a column; an array back), with the same operations on every element.

    >>> float(chain_bound_seconds(np.array([0.0, 1.0]), np.array([0.0, 2.0]), np.array([3.0, 3.0]), 4,
    ...                           np.zeros(2), np.zeros(2)))  # (m + p − 1)(t_f + t_b), t_f = 1, t_b = 2
    15.0
    """
    tail = np.maximum(allreduce + optimizer, backward_chain + allreduce[..., :1] + optimizer[..., :1])
    return np.max(forward_chain + micro_batches * work + tail, axis=-1)


def two_bw_bound_seconds(work, micro_batches, allreduce, optimizer):
    """LB of PipeDream-2BW's steady state per update (module docstring), per rank k: work per
    micro-batch, all-reduce and optimizer seconds; one spec or a batch, as `chain_bound_seconds`.

    >>> float(two_bw_bound_seconds(np.array([3.0, 3.0]), 4, np.array([0.5, 0.0]), np.zeros(2)))
    12.5
    """
    return np.max(micro_batches * work + (allreduce + optimizer), axis=-1)


def zero_bubble_bound_seconds(forward_chain, work, micro_batches, allreduce, optimizer):
    """LB of the zero-bubble schedules (module docstring), per rank k: F-chain, work per
    micro-batch, all-reduce and optimizer seconds; one spec or a batch, as `chain_bound_seconds`.

    >>> bound = zero_bubble_bound_seconds(np.array([0.0, 1.0]), np.array([3.0, 3.0]), 4, np.zeros(2), np.zeros(2))
    >>> round(float(bound), 9)  # m (t_f + t_b) + the F-chain to the last rank; ZB-H1 takes 13 (p = 2, t_I = t_W)
    13.0
    """
    return np.max(forward_chain + micro_batches * work + (allreduce + optimizer), axis=-1) * (1 - 1e-12)


def has_pair_loops(kind: ScheduleKind, pipeline_parallel: int, micro_batches: int, chunks: int) -> bool:
    """Whether `pair_loop_bound_seconds` applies: 1F1B's order (1F1B, PipeDream-2BW, interleaved
    with one chunk) with every rank's warm-up shorter than its micro-batches."""
    ordered = kind in (ScheduleKind.ONE_F_ONE_B, ScheduleKind.PIPEDREAM_2BW) or (
        kind is ScheduleKind.INTERLEAVED and chunks == 1
    )
    return ordered and pipeline_parallel > 1 and micro_batches >= pipeline_parallel


def pair_loop_bound_seconds(micro_batches: int, recompute: bool, costs) -> float:
    """A lower bound on the simulated step of 1F1B's order under `costs` (see the module docstring).

    `costs` is a `pipectl.plan.stage_costs.StageCosts` for p = len(forward_seconds) stages, one chunk,
    with m ≥ p (`has_pair_loops`); `recompute` as the schedule runs it (R before every backward
    but the last stage's).

    >>> from pipectl.plan.stage_costs import uniform_costs
    >>> pair_loop_bound_seconds(8, False, uniform_costs(4, 1, 1.0, 2.0))  # (m + p - 1)(f + b)
    33.0
    """
    m = micro_batches
    f, b, r, c, c_back = _stage_arrays(costs, recompute)
    p = len(f)
    ranks = np.arange(p)
    warmup = p - 1 - ranks
    forward_chain, down_from_last, ends_after = _chains(f, b, c, c_back, costs)
    # F(k, 0) ends no earlier than the forward chain to k; B(p−1, 0) follows F(p−1, 0) on the
    # last rank; B(k, 0) no earlier than that plus the backward chain down to k, nor than rank
    # k's own warm-up forwards, its first pair's forward, recompute and backward.
    first_backward = np.maximum(
        forward_chain[-1] + b[-1] + down_from_last,
        forward_chain + warmup * f + r + b,
    )

    # Loop weights C(k, j) for j = 0..p−1−k, as prefix sums over stages.
    work = np.concatenate(([0.0], np.cumsum(f + b)))
    links = np.concatenate(([0.0], np.cumsum(c + c_back)))
    k = ranks[:, None]
    j = ranks[None, :]
    top = k + j
    valid = top <= p - 1
    top_clipped = np.minimum(top, p - 1)
    loop = (work[top_clipped + 1] - work[k]) + r[top_clipped] + (links[top_clipped] - links[k])
    # Loops start at i = 0, j + 1, … while i ≤ m − 2 − W_k (pair i + 1 exists on rank k).
    room = m - 2 - warmup[:, None]
    loops = np.where(room >= 0, room // (j + 1) + 1, 0)
    reached = loops * (j + 1)
    forwards_left = np.maximum(m - 1 - warmup[:, None] - reached, 0)
    backwards_left = m - 1 - reached
    rest = forwards_left * f[:, None] + backwards_left * (r + b)[:, None]
    paths = first_backward[:, None] + loops * loop + rest + ends_after[:, None]
    return float(np.max(np.where(valid, paths, -np.inf)))


def varuna_bound_seconds(micro_batches: int, warm_up, cool_down, costs) -> float:
    """A lower bound on the simulated step of Varuna's order under `costs` (see the module docstring).

    `warm_up[k]` and `cool_down[k]`: rank k's forwards before its first backward and backwards
    after its last forward (`varuna_flags.order_ends`); `costs` for p = len(warm_up) ≥ 2 stages,
    one chunk, recomputing on every rank but the last (as Varuna does).

    >>> from pipectl.plan.fast import varuna_flags
    >>> from pipectl.plan.simulate import simulate
    >>> from pipectl.plan.stage_costs import uniform_costs
    >>> from pipectl.schedule import ScheduleKind, generate
    >>> costs = uniform_costs(4, 1, 1.0, 2.0)  # the chains: 2 (f + b) + 16 (f + r + b) = 70
    >>> varuna_bound_seconds(16, *varuna_flags.order_ends(4, 16), costs)
    72.0
    >>> simulate(generate(ScheduleKind.VARUNA, 4, 16), costs).step_seconds
    72.0
    """
    m = micro_batches
    f, b, r, c, c_back = _stage_arrays(costs, True)
    warm_up = np.asarray(warm_up)
    cool_down = np.asarray(cool_down)
    forward_chain, down_from_last, ends_after = _chains(f, b, c, c_back, costs)
    first_backward = np.maximum(
        forward_chain[-1] + b[-1] + down_from_last,
        forward_chain + (warm_up - 1) * f + r + b,
    )
    warm = first_backward + (m - warm_up) * f + (m - 1) * (r + b) + ends_after
    last_forward = forward_chain + (m - 1) * f + (m - cool_down) * (r + b)
    cool = last_forward + (forward_chain[-1] - forward_chain) + b[-1] + ends_after[-1]
    return float(max(warm.max(), cool.max()))


def _stage_arrays(costs, recompute: bool):
    """f, b, r, c, c': per stage forward, backward, recompute (0 where none runs: the last stage,
    or everywhere without recomputation), and per boundary the two transfers."""
    f = np.asarray(costs.forward_seconds, dtype=float)
    b = np.asarray(costs.backward_seconds, dtype=float)
    p = len(f)
    r = np.zeros(p)
    if recompute:
        r[: p - 1] = np.asarray(costs.recompute_seconds, dtype=float)[: p - 1]
    c = np.asarray(costs.send_forward_seconds, dtype=float)
    c_back = np.asarray(costs.send_backward_seconds, dtype=float)
    return f, b, r, c, c_back


def _chains(f, b, c, c_back, costs):
    """(F-chain(k): the forwards of micro-batch 0 up to rank k; Σ_{k≤s<p−1} (c'_s + b_s): the
    backwards from the last rank down to k; the least time from the end of rank k's last
    backward to the end of the step: the chain down to any rank s ≤ k, then its all-reduce and
    optimizer step), each per rank k."""
    end_cost = np.asarray(costs.allreduce_seconds, dtype=float) + np.asarray(costs.optimizer_seconds, dtype=float)
    forward_chain = np.cumsum(f) + np.concatenate(([0.0], np.cumsum(c)))
    hop_down = np.concatenate((c_back + b[:-1], [0.0]))  # hop_down[s] = c'_s + b_s (s < p − 1)
    down_from_last = np.cumsum(hop_down[::-1])[::-1] - hop_down[-1]  # Σ_{k≤s<p−1} (c'_s + b_s)
    down_prefix = np.concatenate(([0.0], np.cumsum(hop_down[:-1])))  # Σ_{s'<s} (c'_{s'} + b_{s'})
    ends_after = np.maximum.accumulate(end_cost - down_prefix) + down_prefix  # max_{s≤k} [Σ_{s≤s'<k} + end_s]
    return forward_chain, down_from_last, ends_after

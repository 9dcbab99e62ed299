"""Memory model: state bytes, in-flight counts per schedule, recomputation, tied copies."""

from __future__ import annotations

import pytest

from pipectl.plan.layer_table import layer_table
from pipectl.plan.memory import GIB, MemoryEstimate, StageMemory, in_flight_units, peak_in_flight_units, MemoryBudget, state_bytes_per_parameter, step_bytes_per_parameter
from pipectl.testing.profiles import synthetic_profile
from pipectl.schedule import ScheduleKind, generate
from pipectl.plan.twobw_steady_state import simulate_two_bw_run


def test_state_bytes_mixed_precision_and_zero():
    assert state_bytes_per_parameter("bfloat16", 0, 1) == 16
    assert state_bytes_per_parameter("float32", 0, 1) == 16
    # ZeRO-1 shards only the 12 optimizer bytes over d.
    assert state_bytes_per_parameter("bfloat16", 1, 8) == pytest.approx(2 + 2 + 12 / 8)
    assert state_bytes_per_parameter("float32", 1, 4) == pytest.approx(4 + 4 + 8 / 4)
    # Without data parallelism ZeRO-1 saves nothing.
    assert state_bytes_per_parameter("bfloat16", 1, 1) == 16


def test_optimizer_step_bytes_match_the_h100_measurement():
    # DeepSpeed's bf16 engine with torch AdamW at d = 1 (ZeRO-0 and ZeRO-1 alike): 14 bytes per
    # parameter held between steps (weights 2 + fp32 master, momentum, variance 12), 22-24 at the
    # step; the model takes the upper end.
    assert step_bytes_per_parameter("bfloat16", 0, 1) == 24
    assert step_bytes_per_parameter("bfloat16", 1, 1) == 24
    # ZeRO-1 shards the step's fp32 gradient copy and Adam temporaries with the optimizer state.
    assert step_bytes_per_parameter("bfloat16", 1, 8) == pytest.approx(2 + 2 + 20 / 8)
    assert step_bytes_per_parameter("bfloat16", 0, 8) == 24
    # fp32 training: no gradient copy, Adam's temporaries only.
    assert step_bytes_per_parameter("float32", 0, 1) == 20
    # The step is never lighter than training.
    for dtype in ("bfloat16", "float16", "float32"):
        for zero, d in ((0, 1), (1, 2), (1, 64)):
            assert step_bytes_per_parameter(dtype, zero, d) > state_bytes_per_parameter(dtype, zero, d)


def test_a_rank_peaks_at_training_or_at_the_optimizer_step_whichever_is_larger():
    table = _table()
    memory = StageMemory.build(table, [(0, table.layers)], tensor_parallel=1, recompute=False)
    parameters = table.parameters(0, table.layers)
    activations = 2 * table.saved(0, table.layers)
    training = 16 * parameters + activations
    assert memory.per_rank_bytes(16.0, 24.0, (2,))[0] == pytest.approx(max(training, 24 * parameters))
    # Activations larger than the step's extra 8 bytes per parameter: training is the peak.
    many = memory.per_rank_bytes(16.0, 24.0, (10**6,))[0]
    assert many == pytest.approx(16 * parameters + 10**6 / 2 * activations)
    # None: the step is.
    assert memory.per_rank_bytes(16.0, 24.0, (0,))[0] == pytest.approx(24 * parameters)


def test_the_largest_working_memory_of_a_stage_is_added_once_and_not_split_over_t():
    profile = synthetic_profile(blocks=4, micro_batch_sizes=[1, 2], head_working_per_logit=8.0)
    table = layer_table(profile, 2)
    head = table.layers - 1
    logits = table.output_activation_bytes[head]
    assert table.working_bytes[head] == pytest.approx(8 * logits)
    assert profile.layers[head].working_memory_bytes(profile.layers[head].cost(2)) == 8 * logits
    assert all(working == 0 for working in table.working_bytes[:head])
    stages = [(0, 3), (3, table.layers)]
    for t in (1, 4):
        plain = StageMemory.build(table, stages, tensor_parallel=t, recompute=False)
        assert plain.working_bytes.tolist() == [0.0, 8 * logits]
        without = StageMemory.build(
            layer_table(synthetic_profile(blocks=4, micro_batch_sizes=[1, 2]), 2), stages, tensor_parallel=t,
            recompute=False,
        )
        added = plain.per_rank_bytes(16.0, 0.0, (2, 1)) - without.per_rank_bytes(16.0, 0.0, (2, 1))
        assert added.tolist() == pytest.approx([0.0, 8 * logits])


def test_a_profile_whose_peak_is_only_what_it_holds_has_no_working_memory():
    # CPU measurements record peak = 2 x parameters + saved + output.
    layer = synthetic_profile(blocks=1, micro_batch_sizes=[4]).layers[1]
    assert layer.working_memory_bytes(layer.cost(4)) == 0
    shrunk = layer.cost(4).model_copy(update={"peak_memory_bytes": 0})
    assert layer.working_memory_bytes(shrunk) == 0  # never negative


def test_memory_budget_on_an_h100():
    from pipectl.catalog import get_device

    h100 = get_device("h100-80gb")
    budget = MemoryBudget(
        h100.memory_bytes, int(h100.outside_allocator_gib * GIB), h100.allocator_overhead, headroom=0.05
    )
    assert h100.memory_bytes / GIB == pytest.approx(79.18)  # what torch reports, not the datasheet's 80
    assert budget.usable_bytes == pytest.approx(79.18 * GIB * 0.95 - h100.outside_allocator_gib * GIB)
    assert budget.allocatable_bytes == pytest.approx(budget.usable_bytes / 1.06)
    # A rank fits when its allocator's reserve fits what is usable.
    assert budget.reserved(budget.allocatable_bytes) == pytest.approx(budget.usable_bytes)


@pytest.mark.parametrize("kind", [ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B])
@pytest.mark.parametrize("p,m", [(1, 1), (2, 1), (3, 5), (4, 4), (4, 9), (6, 2)])
def test_closed_form_in_flight_matches_the_generated_schedule(kind, p, m):
    assert in_flight_units(kind, p, m) == peak_in_flight_units(generate(kind, p, m))


@pytest.mark.parametrize("p,m", [(1, 1), (2, 1), (3, 2), (3, 5), (4, 3), (4, 4), (4, 9), (6, 5), (6, 13)])
def test_2bw_in_flight_matches_its_run_without_a_flush(p, m):
    # Not one generated (flushed) step: 2BW never drains between updates, so stage s holds p - s
    # (tests/plan/test_twobw_pricing.py checks the planner's memory with it too).
    run = simulate_two_bw_run(p, m, 4, forward_seconds=1.0, backward_seconds=2.0)
    assert in_flight_units(ScheduleKind.PIPEDREAM_2BW, p, m) == run.peak_in_flight == tuple(range(p, 0, -1))


@pytest.mark.parametrize("p,m,v", [(2, 2, 2), (2, 4, 2), (4, 8, 2), (4, 4, 4), (3, 6, 2), (4, 12, 4)])
def test_interleaved_in_flight_matches_the_generated_schedule(p, m, v):
    assert in_flight_units(ScheduleKind.INTERLEAVED, p, m, v) == peak_in_flight_units(
        generate(ScheduleKind.INTERLEAVED, p, m, v)
    )


@pytest.mark.parametrize("p", [1, 2, 3, 5, 8, 13])
@pytest.mark.parametrize("m", [1, 2, 4, 7, 16, 40])
def test_varuna_in_flight_matches_the_generated_schedule(p, m):
    assert in_flight_units(ScheduleKind.VARUNA, p, m) == peak_in_flight_units(generate(ScheduleKind.VARUNA, p, m))


def test_one_f_one_b_holds_fewer_than_gpipe():
    gpipe = in_flight_units(ScheduleKind.GPIPE, 4, 16)
    one_f_one_b = in_flight_units(ScheduleKind.ONE_F_ONE_B, 4, 16)
    assert one_f_one_b == (4, 3, 2, 1)
    assert all(a < b for a, b in zip(one_f_one_b, gpipe))


def _table(blocks=4, **kwargs):
    return layer_table(synthetic_profile(blocks=blocks, micro_batch_sizes=[1, 2], **kwargs), 2)


def test_stage_bytes_are_state_plus_in_flight_activations():
    table = _table()
    stages = [(0, 3), (3, 7)]
    memory = StageMemory.build(table, stages, tensor_parallel=1, recompute=False)
    units = (2, 1)
    per_rank = memory.per_rank_bytes(16.0, 0.0, units)
    for rank, (start, end) in enumerate(stages):
        expected = 16 * table.parameters(start, end) + units[rank] * table.saved(start, end)
        assert per_rank[rank] == pytest.approx(expected)


def test_tied_embedding_has_a_copy_on_first_and_last_stage():
    table = _table()
    whole = table.parameters(0, table.layers)
    split = table.parameters(0, 3) + table.parameters(3, table.layers)
    tied = table.shared_parameter_count[0]
    assert tied > 0
    assert split == whole + tied  # two holders, two copies
    untied = _table(tied=False)
    assert untied.parameters(0, 3) + untied.parameters(3, untied.layers) == untied.parameters(0, untied.layers)


def test_recompute_keeps_only_stage_inputs_plus_one_full_micro_batch():
    table = _table(blocks=6)
    stages = [(0, 4), (4, 9)]
    plain = StageMemory.build(table, stages, tensor_parallel=1, recompute=False)
    recompute = StageMemory.build(table, stages, tensor_parallel=1, recompute=True)
    units = (8, 8)
    plain_bytes = plain.per_rank_bytes(16.0, 0.0, units)
    recompute_bytes = recompute.per_rank_bytes(16.0, 0.0, units)
    # Stage 1 input is block 2's output; stage 0's input is tokens (not counted).
    expected_first = 16 * table.parameters(4, 9) + 8 * table.output_activation_bytes[3] + table.saved(4, 9)
    # The last stage never recomputes: it keeps its full activations.
    assert recompute_bytes[1] == pytest.approx(plain_bytes[1])
    assert recompute_bytes[0] == pytest.approx(16 * table.parameters(0, 4) + table.saved(0, 4))
    assert recompute_bytes[0] < plain_bytes[0]
    # A stage that does not start the pipeline keeps its input: the previous stage's output.
    middle = StageMemory.build(table, [(0, 4), (4, 9), (9, table.layers)], tensor_parallel=1, recompute=True)
    assert middle.per_rank_bytes(16.0, 0.0, (8, 8, 8))[1] == pytest.approx(expected_first)


def test_tensor_parallel_divides_state_and_activations():
    table = _table()
    one = StageMemory.build(table, [(0, 7)], tensor_parallel=1, recompute=False).per_rank_bytes(16, 0.0, (3,))
    four = StageMemory.build(table, [(0, 7)], tensor_parallel=4, recompute=False).per_rank_bytes(16, 0.0, (3,))
    assert four[0] == pytest.approx(one[0] / 4)


def test_interleaved_rank_holds_all_its_chunks():
    table = _table(blocks=6)
    virtual = [(0, 2), (2, 4), (4, 6), (6, 9)]  # p=2, v=2: rank 0 holds stages 0 and 2
    memory = StageMemory.build(table, virtual, tensor_parallel=1, recompute=False, pipeline_parallel=2)
    assert memory.parameters[0] == table.parameters(0, 2) + table.parameters(4, 6)
    assert memory.unit_bytes[0] == max(table.saved(0, 2), table.saved(4, 6))


def test_infeasible_reason_names_the_stage_and_sizes():
    estimate = MemoryEstimate((int(21.3 * GIB), int(3 * GIB)), int(16 * GIB))
    assert not estimate.feasible
    assert estimate.reason == "stage 0 needs 21.3 GiB > 16.0 GiB"
    assert MemoryEstimate((1, 2), 10).reason is None


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("t", [1, 2, 4])
def test_range_rows_give_the_stage_memory_of_a_cut_exactly(tied, t):
    # The partitioner's per-range test (`RangeMemory.stage_bytes`) against a cut's per-rank bytes
    # from the table's own range queries (`StageMemory.build` without rows), every stage alone
    # on its rank: a stage in the middle, first or last, recomputing or not.
    from pipectl.plan.memory_ranges import RangeMemory

    table = layer_table(
        synthetic_profile(blocks=6, micro_batch_sizes=[1, 2], tied=tied, hidden=96, head_working_per_logit=8.0), 2
    )
    rows = RangeMemory.build(table, t)
    layers = table.layers
    steps = set()
    for start in range(layers):
        for end in range(start + 1, layers + 1):
            before = [(0, start)] if start > 0 else []
            cut = before + [(start, end)] + ([(end, layers)] if end < layers else [])
            last = end == layers
            for recompute in (True, False):
                memory = StageMemory.build(table, cut, tensor_parallel=t, recompute=recompute)
                # A step's bytes per parameter high enough to be the peak of some stages.
                expected = memory.per_rank_bytes(12.5, 60.0, (3,) * len(cut))[len(before)]
                got = rows.stage_bytes(
                    start, end, state_bytes=12.5, step_bytes=60.0, units=3, recompute=recompute and not last
                )
                assert got == expected, (start, end, recompute, last)
                steps.add(got == rows.parameters[start][end] * 60.0)
    assert steps == {True, False}  # both peaks were the larger somewhere


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("t", [1, 4])
def test_stage_memory_from_range_rows_is_the_same(recompute, t):
    from pipectl.plan.memory_ranges import RangeMemory

    table = layer_table(synthetic_profile(blocks=7, micro_batch_sizes=[1, 2], hidden=80, head_working_per_logit=8.0), 1)
    rows = RangeMemory.build(table, t)
    layers = table.layers
    for cuts in (((0, layers),), ((0, 1), (1, layers)), ((0, 3), (3, 4), (4, 8), (8, layers))):
        slow = StageMemory.build(table, cuts, tensor_parallel=t, recompute=recompute)
        fast = StageMemory.build(table, cuts, tensor_parallel=t, recompute=recompute, rows=rows)
        for mine, theirs in zip(
            (fast.parameters, fast.unit_bytes, fast.recompute_buffer_bytes, fast.working_bytes),
            (slow.parameters, slow.unit_bytes, slow.recompute_buffer_bytes, slow.working_bytes),
        ):
            assert mine.tolist() == theirs.tolist()


@pytest.mark.parametrize("seed", range(6))
def test_interleaved_stage_memory_from_range_rows_is_the_same(seed):
    """Several chunks per rank, tied embeddings or not, one rank holding both tied layers or not."""
    import random

    from pipectl.plan.memory_ranges import RangeMemory

    rng = random.Random(seed)
    table = layer_table(
        synthetic_profile(
            blocks=rng.randint(6, 14), micro_batch_sizes=[1], hidden=80, tied=rng.random() < 0.7,
            head_working_per_logit=rng.choice((0.0, 8.0)),
        ),
        1,
    )
    layers = table.layers
    for _ in range(20):
        t, recompute = rng.choice((1, 2, 4)), rng.random() < 0.5
        p = rng.randint(1, 3)
        stages = p * rng.randint(2, max(2, layers // p))
        if stages > layers:
            continue
        ends = sorted(rng.sample(range(1, layers), stages - 1)) + [layers]
        cuts = tuple(zip([0] + ends[:-1], ends))
        rows = RangeMemory.build(table, t)
        slow = StageMemory.build(table, cuts, tensor_parallel=t, recompute=recompute, pipeline_parallel=p)
        fast = StageMemory.build(table, cuts, tensor_parallel=t, recompute=recompute, pipeline_parallel=p, rows=rows)
        for mine, theirs in zip(
            (fast.parameters, fast.unit_bytes, fast.recompute_buffer_bytes, fast.working_bytes),
            (slow.parameters, slow.unit_bytes, slow.recompute_buffer_bytes, slow.working_bytes),
        ):
            assert mine.tolist() == theirs.tolist()

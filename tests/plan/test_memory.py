"""Memory model: state bytes, in-flight counts per schedule, recomputation, tied copies."""

from __future__ import annotations

import pytest

from pipectl.plan.layer_table import layer_table
from pipectl.plan.memory import (
    GIB,
    MemoryEstimate,
    StageMemory,
    in_flight_units,
    peak_in_flight_units,
    state_bytes_per_parameter,
)
from pipectl.plan.synthetic import synthetic_profile
from pipectl.schedule import ScheduleKind, generate


def test_state_bytes_mixed_precision_and_zero():
    assert state_bytes_per_parameter("bfloat16", 0, 1) == 16
    assert state_bytes_per_parameter("float32", 0, 1) == 16
    # ZeRO-1 shards only the 12 optimizer bytes over d.
    assert state_bytes_per_parameter("bfloat16", 1, 8) == pytest.approx(2 + 2 + 12 / 8)
    assert state_bytes_per_parameter("float32", 1, 4) == pytest.approx(4 + 4 + 8 / 4)
    # Without data parallelism ZeRO-1 saves nothing.
    assert state_bytes_per_parameter("bfloat16", 1, 1) == 16


@pytest.mark.parametrize("kind", [ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B, ScheduleKind.PIPEDREAM_2BW])
@pytest.mark.parametrize("p,m", [(1, 1), (2, 1), (3, 5), (4, 4), (4, 9), (6, 2)])
def test_closed_form_in_flight_matches_the_generated_schedule(kind, p, m):
    assert in_flight_units(kind, p, m) == peak_in_flight_units(generate(kind, p, m))


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
    per_rank = memory.per_rank_bytes(16.0, units)
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
    plain_bytes = plain.per_rank_bytes(16.0, units)
    recompute_bytes = recompute.per_rank_bytes(16.0, units)
    # Stage 1 input is block 2's output; stage 0's input is tokens (not counted).
    expected_first = 16 * table.parameters(4, 9) + 8 * table.output_activation_bytes[3] + table.saved(4, 9)
    # The last stage never recomputes: it keeps its full activations.
    assert recompute_bytes[1] == pytest.approx(plain_bytes[1])
    assert recompute_bytes[0] == pytest.approx(16 * table.parameters(0, 4) + table.saved(0, 4))
    assert recompute_bytes[0] < plain_bytes[0]
    # A stage that does not start the pipeline keeps its input: the previous stage's output.
    middle = StageMemory.build(table, [(0, 4), (4, 9), (9, table.layers)], tensor_parallel=1, recompute=True)
    assert middle.per_rank_bytes(16.0, (8, 8, 8))[1] == pytest.approx(expected_first)


def test_tensor_parallel_divides_state_and_activations():
    table = _table()
    one = StageMemory.build(table, [(0, 7)], tensor_parallel=1, recompute=False).per_rank_bytes(16, (3,))
    four = StageMemory.build(table, [(0, 7)], tensor_parallel=4, recompute=False).per_rank_bytes(16, (3,))
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
    from pipectl.plan.memory import RangeMemory

    table = layer_table(synthetic_profile(blocks=6, micro_batch_sizes=[1, 2], tied=tied, hidden=96), 2)
    rows = RangeMemory.build(table, t)
    layers = table.layers
    for start in range(layers):
        for end in range(start + 1, layers + 1):
            before = [(0, start)] if start > 0 else []
            cut = before + [(start, end)] + ([(end, layers)] if end < layers else [])
            last = end == layers
            for recompute in (True, False):
                memory = StageMemory.build(table, cut, tensor_parallel=t, recompute=recompute)
                expected = memory.per_rank_bytes(12.5, (3,) * len(cut))[len(before)]
                got = rows.stage_bytes(start, end, state_bytes=12.5, units=3, recompute=recompute and not last)
                assert got == expected, (start, end, recompute, last)


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("t", [1, 4])
def test_stage_memory_from_range_rows_is_the_same(recompute, t):
    from pipectl.plan.memory import RangeMemory

    table = layer_table(synthetic_profile(blocks=7, micro_batch_sizes=[1, 2], hidden=80), 1)
    rows = RangeMemory.build(table, t)
    layers = table.layers
    for cuts in (((0, layers),), ((0, 1), (1, layers)), ((0, 3), (3, 4), (4, 8), (8, layers))):
        slow = StageMemory.build(table, cuts, tensor_parallel=t, recompute=recompute)
        fast = StageMemory.build(table, cuts, tensor_parallel=t, recompute=recompute, rows=rows)
        for mine, theirs in zip(
            (fast.parameters, fast.unit_bytes, fast.recompute_buffer_bytes),
            (slow.parameters, slow.unit_bytes, slow.recompute_buffer_bytes),
        ):
            assert mine.tolist() == theirs.tolist()


@pytest.mark.parametrize("seed", range(6))
def test_interleaved_stage_memory_from_range_rows_is_the_same(seed):
    """Several chunks per rank, tied embeddings or not, one rank holding both tied layers or not."""
    import random

    from pipectl.plan.memory import RangeMemory

    rng = random.Random(seed)
    table = layer_table(
        synthetic_profile(blocks=rng.randint(6, 14), micro_batch_sizes=[1], hidden=80, tied=rng.random() < 0.7), 1
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
            (fast.parameters, fast.unit_bytes, fast.recompute_buffer_bytes),
            (slow.parameters, slow.unit_bytes, slow.recompute_buffer_bytes),
        ):
            assert mine.tolist() == theirs.tolist()

"""Selective recomputation (the attention core only) in the planner: its saved bytes, its time,
and when the search takes it (Korthikanti et al. 2022, §5)."""

from __future__ import annotations

import random

import pytest

from pipectl.artifacts.model import ModelConfig
from pipectl.artifacts.plan import PlanRequest, Recompute, RecomputeChoice, recompute_granularities
from pipectl.artifacts.profile import LayerCost, LayerProfile, ModelProfile, ProfileSource
from pipectl.cluster import load_cluster, local_cluster
from pipectl.errors import InfeasibleError, UserInputError
from pipectl.plan.candidates import ShapeBuilder
from pipectl.plan.costs import hardware_for
from pipectl.plan.cost_table import stage_costs_for
from pipectl.plan.layer_table import layer_table, offered_granularities, selective_frees_little
from pipectl.plan.memory_ranges import FurthestFittingEnds, RangeMemory
from pipectl.plan.memory import StageMemory
from pipectl.plan.search import plan
from pipectl.plan.simulate import simulate
from pipectl.testing.profiles import synthetic_profile
from pipectl.profile.block_memory import attention_core_saved_bytes, block_saved_bytes
from pipectl.profile.compute_model import Attention, BlockShape
from pipectl.profile.derive import derive_profile
from pipectl.schedule import ScheduleKind, generate
from tests.plan.test_memory_h100 import _one_h100

SAVED = (100, 300, 200, 50)
CORE = (0, 120, 40, 0)  # the embedding and the head have no attention core
CORE_SECONDS = (0.0, 0.25, 0.5, 0.0)


def _hand_made() -> ModelProfile:
    """Four layers with round figures at b = 1: outputs 10, 20, 30, 40 bytes; saved 100, 300, 200,
    50 bytes, of which the attention cores keep 0, 120, 40, 0; forwards 1, 2, 3, 4 s, of which
    the cores take 0, 0.25, 0.5, 0; parameters 1000 each."""
    layers = [
        LayerProfile(
            index=i, name=f"layer.{i}", kind="transformer_block" if CORE[i] else "linear", parameter_count=1000,
            parameter_bytes=4000,
            costs=[LayerCost(micro_batch_size=1, forward_seconds=1.0 + i, backward_seconds=2.0 * (1.0 + i),
                             output_activation_bytes=10 * (i + 1), saved_activation_bytes=SAVED[i],
                             peak_memory_bytes=4000 + SAVED[i] + 10 * (i + 1), attention_core_saved_bytes=CORE[i],
                             attention_core_forward_seconds=CORE_SECONDS[i])],
        )
        for i in range(4)
    ]  # fmt: skip
    return ModelProfile(model="hand", source=ProfileSource.MEASURED, device="cpu", dtype="float32",
                        micro_batch_sizes=[1], layers=layers)


# --- saved bytes -----------------------------------------------------------------------------------


def test_unfused_attention_frees_exactly_korthikantis_s_squared_term():
    # Korthikanti et al. 2022, eq. 1 and §5: a layer keeps s b h (34 + 5 a s / h) bytes in 16-bit
    # with dropout; selective recomputation frees the 5 a s^2 b (softmax output 2, dropout mask 1,
    # dropout output 2 bytes per score), and what is left has no s^2 term.
    a, h, s, b = 16, 1024, 2048, 2
    shape = BlockShape(hidden=h, heads=a, seq_len=s, micro_batch_size=b, attention=Attention.UNFUSED, dropout=True)
    assert attention_core_saved_bytes(shape, 2) == 5 * a * s * s * b
    # Same tokens (b s), twice the sequence: the saved bytes grow by the s^2 term only, what
    # selective recomputation keeps not at all.
    longer = BlockShape(hidden=h, heads=a, seq_len=2 * s, micro_batch_size=b // 2, attention=Attention.UNFUSED,
                        dropout=True)  # fmt: skip
    kept = block_saved_bytes(shape, 2) - attention_core_saved_bytes(shape, 2)
    assert block_saved_bytes(longer, 2) - attention_core_saved_bytes(longer, 2) == kept
    assert block_saved_bytes(longer, 2) - block_saved_bytes(shape, 2) == 5 * a * b * s * s
    # The rest is linear in s b h: Korthikanti's 34 s b h (the context once, as proj's input) + the
    # LayerNorms' fp32 statistics.
    assert kept == 34 * s * b * h + 2 * 2 * 4 * s * b


def test_flash_attention_frees_only_its_log_sum_exp():
    a, h, s, b = 16, 1024, 2048, 2
    shape = BlockShape(hidden=h, heads=a, seq_len=s, micro_batch_size=b, attention=Attention.FLASH)
    assert attention_core_saved_bytes(shape, 2) == 4 * a * s * b  # fp32 per token and head
    assert attention_core_saved_bytes(shape, 2) / block_saved_bytes(shape, 2) < 0.01


def test_a_derived_profile_records_the_core_for_pipectls_block_and_not_for_a_hugging_face_one():
    gpt = ModelConfig(name="g", family="gpt", layers=2, hidden=256, heads=4, seq_len=512, vocab=1000)
    unfused = derive_profile(gpt, "h100-80gb", [1], attention="unfused", tensor_parallel=(2,))
    block = unfused.layers[1]
    assert block.costs[0].attention_core_saved_bytes == 4 * 512 * 512 * 2  # the bf16 softmax output
    assert 0 < block.costs[0].attention_core_forward_seconds < block.costs[0].forward_seconds
    assert block.shards[0].costs[0].attention_core_saved_bytes == 2 * 512 * 512 * 2  # half the heads per rank
    assert unfused.layers[0].costs[0].attention_core_saved_bytes is None  # the embedding
    llama = gpt.model_copy(update={"kv_heads": 2, "activation": "swiglu", "norm": "rms", "rotary": True,
                                   "linear_bias": False})  # fmt: skip
    assert not derive_profile(llama, "h100-80gb", [1], tensor_parallel=()).records_attention_core


def test_selective_recomputation_keeps_saved_less_the_cores_and_one_core_on_top():
    table = layer_table(_hand_made(), 1)
    cut = [(0, 2), (2, 4)]
    memory = StageMemory.build(table, cut, tensor_parallel=1, recompute=Recompute.SELECTIVE)
    # Stage 0: 100 + (300 - 120); stage 1, the last, too: (200 - 40) + 50. One core on top.
    assert memory.unit_bytes.tolist() == [280.0, 210.0]
    assert memory.recompute_buffer_bytes.tolist() == [120.0, 40.0]
    none = StageMemory.build(table, cut, tensor_parallel=1, recompute=Recompute.NONE)
    assert none.unit_bytes.tolist() == [400.0, 250.0]
    halved = StageMemory.build(table, [(0, 4)], tensor_parallel=2, recompute=Recompute.SELECTIVE)
    assert halved.unit_bytes.tolist() == [245.0] and halved.recompute_buffer_bytes.tolist() == [60.0]


@pytest.mark.parametrize("seed", range(2))
def test_the_range_rows_and_the_furthest_ends_agree_with_the_stage_memory(seed):
    rng = random.Random(seed)
    profile = synthetic_profile(blocks=7, micro_batch_sizes=[1, 2], hidden=128, seq_len=256,
                                block_forward_seconds=[rng.uniform(0.5, 2.0) for _ in range(7)],
                                head_working_per_logit=rng.choice((0.0, 8.0)), attention_core=(0.4, 0.1))
    for t in (1, 2):
        table = layer_table(profile, 2, t)
        rows = RangeMemory.build(table, t)
        layers = table.layers
        for start in range(layers):
            for end in range(start + 1, layers + 1):
                alone = StageMemory.build(table, [(start, end)], tensor_parallel=t, recompute=Recompute.SELECTIVE)
                got = rows.stage_bytes(start, end, state_bytes=16.0, step_bytes=24.0, units=3,
                                       recompute=Recompute.SELECTIVE)  # fmt: skip
                assert got == alone.per_rank_bytes(16.0, 24.0, (3,))[0]
        cuts = [(0, 3), (3, 5), (5, layers)]
        fast = StageMemory.build(table, cuts, tensor_parallel=t, recompute=Recompute.SELECTIVE, rows=rows)
        slow = StageMemory.build(table, cuts, tensor_parallel=t, recompute=Recompute.SELECTIVE)
        assert fast.unit_bytes.tolist() == slow.unit_bytes.tolist()
        assert fast.recompute_buffer_bytes.tolist() == slow.recompute_buffer_bytes.tolist()
        capacity = rows.stage_bytes(0, 4, state_bytes=16.0, step_bytes=24.0, units=3, recompute=Recompute.SELECTIVE)
        ends = FurthestFittingEnds(rows, capacity)
        for start in range(layers):
            fitting = [end for end in range(start + 1, layers + 1)
                       if rows.stage_bytes(start, end, state_bytes=16.0, step_bytes=24.0, units=3,
                                           recompute=Recompute.SELECTIVE) <= capacity]  # fmt: skip
            assert ends.end(start, 16.0, 24.0, 3, Recompute.SELECTIVE) == max(fitting, default=start)
        assert ends.end(0, 16.0, 24.0, 3, Recompute.NONE) < ends.end(0, 16.0, 24.0, 3, Recompute.SELECTIVE)


# --- time ----------------------------------------------------------------------------------------


def test_each_backward_costs_its_attention_cores_forward_once_more():
    profile = _hand_made()
    builder = ShapeBuilder(profile, hardware_for(local_cluster(2), profile))
    plain = builder.shape_from_cuts(1, 1, Recompute.NONE, 2, 1, [(0, 2), (2, 4)])
    selective = builder.shape_from_cuts(1, 1, Recompute.SELECTIVE, 2, 1, [(0, 2), (2, 4)])
    assert selective.forward.tolist() == plain.forward.tolist()
    seconds = builder.seconds(1, 1)
    scale = seconds.forward[1] / 2.0  # the layers' compute scale on this cluster
    assert (selective.backward - plain.backward).tolist() == pytest.approx([0.25 * scale, 0.5 * scale])
    assert seconds.work(Recompute.SELECTIVE)[1] == pytest.approx(seconds.work(Recompute.NONE)[1] + 0.25 * scale)


def _core_profile():
    return synthetic_profile(blocks=6, micro_batch_sizes=[1, 2], device="a100-80gb", attention_core=(0.5, 0.1))


@pytest.mark.parametrize("schedule", [ScheduleKind.ONE_F_ONE_B, ScheduleKind.GPIPE, ScheduleKind.INTERLEAVED,
                                      ScheduleKind.PIPEDREAM_2BW])
def test_a_selective_candidate_resimulates_to_its_own_step(schedule):
    # The planner's fast paths price the step; `pipectl simulate` re-simulates the candidate from
    # `stage_costs_for` with the event simulator. They agree, and the cost table's backwards carry
    # the attention cores' forwards.
    profile, cluster = _core_profile(), load_cluster("a100-8x8")
    request = PlanRequest(global_batch=16, devices=8, schedules=[schedule], recompute=RecomputeChoice.SELECTIVE,
                          include_all=True, morph=False, engine="any")  # fmt: skip
    selective = [c for c in plan(profile, cluster, request).candidates if c.selective_recompute]
    assert selective
    for candidate in selective[:6]:
        costs = stage_costs_for(candidate, profile, cluster)
        schedule_of = generate(candidate.schedule, candidate.pipeline_parallel, candidate.micro_batches,
                               candidate.chunks, candidate.recompute)  # fmt: skip
        if candidate.schedule is not ScheduleKind.PIPEDREAM_2BW:
            assert simulate(schedule_of, costs).step_seconds == pytest.approx(candidate.predicted_step_seconds, rel=1e-9)
        plain = stage_costs_for(candidate.model_copy(update={"selective_recompute": False}), profile, cluster)
        seconds = ShapeBuilder(profile, hardware_for(cluster, profile)).seconds(candidate.micro_batch_size,
                                                                                candidate.tensor_parallel)
        extra = [b - a for a, b in zip(plain.backward_seconds, costs.backward_seconds)]
        assert extra == pytest.approx([seconds.recomputed_attention(*stage) for stage in candidate.stage_layers],
                                      rel=1e-9)  # fmt: skip
        # A stage without a block (the embedding or the head alone) recomputes nothing.
        assert all(e >= 0 for e in extra) and sum(extra) > 0 and costs.forward_seconds == plain.forward_seconds


# --- the search ------------------------------------------------------------------------------------


def _gpt_1_3b_unfused() -> ModelProfile:
    config = ModelConfig(name="gpt-1.3b", family="gpt", layers=24, hidden=2048, heads=16, seq_len=2048, vocab=50304)
    return derive_profile(config, "h100-80gb", [8], attention="unfused", tensor_parallel=())


def _one_h100_plan(profile, recompute):
    request = PlanRequest(global_batch=64, schedules=[ScheduleKind.ONE_F_ONE_B], micro_batch_size=8,
                          recompute=recompute, morph=False, include_all=True)  # fmt: skip
    return plan(profile, _one_h100(), request)


def test_memory_binds_and_selective_recomputation_suffices_so_the_search_takes_it_over_full():
    # GPT 1.3 B with unfused attention on one H100 at b = 8: keeping everything needs 83 GiB; freeing
    # the s x s softmax outputs fits, and costs less time than recomputing every layer.
    profile = _gpt_1_3b_unfused()
    with pytest.raises(InfeasibleError, match="does not fit"):
        _one_h100_plan(profile, RecomputeChoice.NEVER)
    result = _one_h100_plan(profile, RecomputeChoice.AUTO)
    by_granularity = {c.recompute_granularity: c for c in result.candidates}
    assert set(by_granularity) == {Recompute.SELECTIVE, Recompute.LAYER}
    assert result.chosen.recompute_granularity is Recompute.SELECTIVE and result.chosen.selective_recompute
    selective, full = by_granularity[Recompute.SELECTIVE], by_granularity[Recompute.LAYER]
    assert selective.predicted_step_seconds < full.predicted_step_seconds
    assert max(full.peak_memory_bytes) < max(selective.peak_memory_bytes) <= _one_h100_plan(
        profile, RecomputeChoice.SELECTIVE).chosen.peak_memory_bytes[0]
    assert _one_h100_plan(profile, RecomputeChoice.ALWAYS).chosen.recompute_granularity is Recompute.SELECTIVE


def test_with_flash_attention_selective_recomputation_saves_little_and_is_not_taken():
    config = ModelConfig(name="gpt-1.3b", family="gpt", layers=24, hidden=2048, heads=16, seq_len=2048, vocab=50304)
    profile = derive_profile(config, "h100-80gb", [4], attention="flash", tensor_parallel=())
    # Beside full recomputation it is not searched at all: it frees under 1 % of a block's bytes.
    assert selective_frees_little(profile)
    assert offered_granularities(recompute_granularities(RecomputeChoice.AUTO), profile) == (
        Recompute.NONE, Recompute.STAGE, Recompute.LAYER)
    # Asked for alone, it is, and loses to keeping everything.
    request = PlanRequest(global_batch=64, schedules=[ScheduleKind.ONE_F_ONE_B], micro_batch_size=4, morph=False,
                          include_all=True, recompute=RecomputeChoice.SELECTIVE)  # fmt: skip
    result = plan(profile, _one_h100(), request)
    by_granularity = {c.recompute_granularity: c for c in result.candidates}
    none, selective = by_granularity[Recompute.NONE], by_granularity[Recompute.SELECTIVE]
    assert result.chosen.recompute_granularity is Recompute.NONE
    saved = max(none.peak_memory_bytes) - max(selective.peak_memory_bytes)
    assert 0 < saved < 0.001 * max(none.peak_memory_bytes)  # the log-sum-exp of 24 blocks
    assert selective.predicted_step_seconds > none.predicted_step_seconds


def test_a_profile_without_the_core_is_not_searched_selectively_and_asking_for_it_alone_says_why():
    profile = synthetic_profile(blocks=2)
    assert not profile.records_attention_core
    everything = (Recompute.NONE, Recompute.STAGE, Recompute.LAYER, Recompute.SELECTIVE)
    assert offered_granularities(everything, profile) == everything[:3]
    assert offered_granularities((Recompute.STAGE, Recompute.LAYER, Recompute.SELECTIVE), profile) == (
        Recompute.STAGE, Recompute.LAYER)
    with pytest.raises(UserInputError, match="records no attention core"):
        offered_granularities((Recompute.NONE, Recompute.SELECTIVE), profile)
    assert offered_granularities(everything, _core_profile()) == everything


def test_the_chosen_line_and_the_candidate_say_selective_recompute():
    result = _one_h100_plan(_gpt_1_3b_unfused(), RecomputeChoice.SELECTIVE)
    chosen = result.chosen
    assert "selective_recompute" in chosen.model_dump() and chosen.model_dump()["selective_recompute"] is True
    from pipectl.artifacts.layout import Layout

    assert "+sel" in Layout.from_candidate(chosen).label()

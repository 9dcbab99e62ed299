"""The engine a plan is for: DeepSpeed's pipeline engine (the default, what `pipectl launch` runs),
PyTorch's pipelining runtime (`--engine torch`: 1f1b, gpipe, interleaved, zb-h1; no recompute,
t = 1, d = 1), or any. zb-h1 is searched only when the plan is not for DeepSpeed, and chosen
only where something runs it."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pipectl.artifacts.plan import Candidate, Engine, PlanRequest
from pipectl.cluster import load_cluster
from pipectl.plan.search import plan
from pipectl.testing.profiles import synthetic_profile
from pipectl.schedule import ScheduleKind

ZB, INTERLEAVED, ONE_F_ONE_B = ScheduleKind.ZB_H1, ScheduleKind.INTERLEAVED, ScheduleKind.ONE_F_ONE_B


@pytest.fixture(scope="module")
def profile():
    return synthetic_profile(blocks=16, micro_batch_sizes=[1, 2, 4])


@pytest.fixture(scope="module")
def cluster():
    return load_cluster("a100-8x8")


def _request(**extra):
    return PlanRequest(global_batch=64, devices=8, morph=False, workers=1, **extra)


@pytest.fixture(scope="module")
def torch_plan(profile, cluster):
    return plan(profile, cluster, _request(engine=Engine.TORCH))


def test_engine_torch_chooses_a_schedule_deepspeed_cannot_run_when_it_is_faster(profile, cluster, torch_plan):
    chosen = torch_plan.chosen
    assert chosen.schedule in (ZB, INTERLEAVED) and chosen.engine is Engine.TORCH
    assert not chosen.deepspeed_runnable and chosen.data_parallel == chosen.tensor_parallel == 1 and not chosen.recompute
    # faster than the best 1F1B the same runtime runs
    one_f_one_b = plan(profile, cluster, _request(engine=Engine.TORCH, schedule=ONE_F_ONE_B)).chosen
    assert one_f_one_b.engine is Engine.TORCH
    assert chosen.predicted_step_seconds < one_f_one_b.predicted_step_seconds
    assert any("engine torch" in note for note in chosen.notes)
    # every candidate names what would run it: torch for d = 1, t = 1 and no recompute of either
    # kind (PyTorch's runtime runs no per-layer checkpointing either), else none
    every = plan(profile, cluster, _request(engine=Engine.TORCH, include_all=True)).candidates
    assert any(candidate.checkpoint_layers for candidate in every)
    for candidate in every:
        runs = (candidate.data_parallel == 1 and candidate.tensor_parallel == 1 and not candidate.recompute
                and not candidate.checkpoint_layers)  # fmt: skip
        assert candidate.engine is (Engine.TORCH if runs else None), candidate


def test_zb_h1_beats_1f1b_for_the_same_pipeline(profile, cluster):
    pinned = dict(pipeline_parallel=4, data_parallel=1, micro_batch_size=1, allow_recompute=False)
    zb = plan(profile, cluster, _request(engine=Engine.TORCH, schedule=ZB, **pinned)).chosen
    one_f_one_b = plan(profile, cluster, _request(engine=Engine.TORCH, schedule=ONE_F_ONE_B, **pinned)).chosen
    assert zb.stage_layers == one_f_one_b.stage_layers
    assert zb.predicted_step_seconds < one_f_one_b.predicted_step_seconds
    assert zb.bubble_fraction < one_f_one_b.bubble_fraction
    # it holds each micro-batch until its W: min(p, m) on every stage, 1F1B's stage-0 peak
    assert zb.peak_memory_bytes[0] == one_f_one_b.peak_memory_bytes[0]
    assert zb.peak_memory_bytes[-1] >= one_f_one_b.peak_memory_bytes[-1]


def test_the_memory_model_holds_zb_h1s_activations_until_w(profile):
    from pipectl.plan.layer_table import layer_table
    from pipectl.plan.memory import StageMemory, in_flight_units

    table = layer_table(profile, 1)
    cuts = [(0, 5), (5, 9), (9, 13), (13, len(profile.layers))]
    stages = StageMemory.build(table, cuts, tensor_parallel=1, recompute=False)
    activations = {
        kind: stages.estimate(0.0, 0.0, in_flight_units(kind, 4, 8), capacity_bytes=10**12).per_rank_bytes
        for kind in (ZB, ONE_F_ONE_B)
    }
    assert in_flight_units(ZB, 4, 8) == (4, 4, 4, 4) and in_flight_units(ONE_F_ONE_B, 4, 8) == (4, 3, 2, 1)
    assert activations[ZB][0] == activations[ONE_F_ONE_B][0]
    assert all(z > o for z, o in zip(activations[ZB][1:], activations[ONE_F_ONE_B][1:]))


def test_the_default_engine_never_searches_zb_h1_and_never_chooses_it(profile, cluster, torch_plan):
    default = plan(profile, cluster, _request())
    assert default.request.engine is Engine.DEEPSPEED
    assert all(c.schedule is not ZB for c in default.candidates)
    assert default.chosen.engine is Engine.DEEPSPEED and default.chosen.deepspeed_runnable
    # listed explicitly, zb-h1 is priced but not chosen: nothing the plan is for runs it
    listed = plan(profile, cluster, _request(schedules=[ONE_F_ONE_B, ZB]))
    assert listed.chosen.schedule is ONE_F_ONE_B and listed.chosen.engine is Engine.DEEPSPEED
    zb = [c for c in listed.candidates if c.schedule is ZB]
    assert zb and all(c.engine is None and not c.deepspeed_runnable for c in zb)
    assert any(c.schedule is ZB for c in torch_plan.candidates)


def test_engine_any_prices_zb_h1_when_listed_and_names_the_engine_of_each(profile, cluster):
    # not by default: zb-h1 has no fast path yet, and any searches every layout
    assert all(c.schedule is not ZB for c in plan(profile, cluster, _request(engine=Engine.ANY)).candidates)
    anything = plan(profile, cluster, _request(engine=Engine.ANY, schedules=[ONE_F_ONE_B, INTERLEAVED, ZB]))
    assert any(c.schedule is ZB for c in anything.candidates)
    for candidate in anything.candidates:
        if candidate.deepspeed_runnable:
            assert candidate.engine is Engine.DEEPSPEED
        elif candidate.engine is Engine.TORCH:
            assert candidate.data_parallel == 1 and not candidate.recompute


def test_request_engine_and_for_deepspeed_agree():
    assert PlanRequest(global_batch=8).engine is Engine.DEEPSPEED
    old_any_engine = PlanRequest.model_validate({"global_batch": 8, "for_deepspeed": False})
    assert old_any_engine.engine is Engine.ANY and old_any_engine.target_engine is Engine.ANY
    assert PlanRequest(global_batch=8, engine="torch").for_deepspeed is False
    with pytest.raises(ValidationError, match="engine torch with for_deepspeed True"):
        PlanRequest(global_batch=8, engine="torch", for_deepspeed=True)
    copied = PlanRequest(global_batch=8).model_copy(update={"for_deepspeed": False})  # no validator runs
    assert copied.target_engine is Engine.ANY


def test_old_candidates_load_with_the_engine_their_flag_implies(torch_plan):
    fields = torch_plan.chosen.model_dump(mode="json")
    del fields["engine"]
    fields["deepspeed_runnable"] = True
    assert Candidate.model_validate(fields).engine is Engine.DEEPSPEED
    fields["deepspeed_runnable"] = False
    assert Candidate.model_validate(fields).engine is None
    with pytest.raises(ValidationError, match="'any' is for requests"):
        Candidate.model_validate({**fields, "engine": "any"})


def test_a_zb_h1_steps_phases_count_i_and_w_as_its_backward(profile, cluster):
    from pipectl.plan.phases import simulated_phases

    pinned = dict(pipeline_parallel=4, data_parallel=1, micro_batch_size=1, allow_recompute=False)
    zb = plan(profile, cluster, _request(engine=Engine.TORCH, schedule=ZB, **pinned)).chosen
    one_f_one_b = plan(profile, cluster, _request(engine=Engine.TORCH, schedule=ONE_F_ONE_B, **pinned)).chosen
    phases, step = simulated_phases(zb, profile, cluster)
    reference, _ = simulated_phases(one_f_one_b, profile, cluster)
    for (forward, backward, waits, reductions, optimizer, _), (_, backward_1f1b, waits_1f1b, *_) in zip(phases, reference):
        assert backward == pytest.approx(backward_1f1b)  # the same work, split in two
        assert waits <= waits_1f1b + 1e-12
        assert forward + backward + waits + reductions + optimizer == pytest.approx(step)


def test_engine_torch_on_two_device_kinds_keeps_to_one_kind_and_says_why(profile):
    mixed = plan(profile, load_cluster("mixed-v100-p100"),
                 PlanRequest(global_batch=64, morph=False, workers=1, engine=Engine.TORCH))
    assert mixed.chosen.engine is Engine.TORCH and mixed.chosen.replicas is None and mixed.chosen.device != "mixed"
    assert any("PyTorch's pipelining runtime does not have" in note for note in mixed.notes)

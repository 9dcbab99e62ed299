import pytest
from pydantic import ValidationError

from pipectl.artifacts.plan import Candidate, ModelShape, MorphEntry, Plan, PlanRequest
from pipectl.schedule.ir import ScheduleKind

SHAPE = ModelShape(parameter_count=90, layer_parameter_counts=[10] * 9)


def candidate(**overrides):
    fields = dict(
        devices=4,
        device="cpu",
        tensor_parallel=1,
        pipeline_parallel=2,
        data_parallel=2,
        micro_batch_size=2,
        micro_batches=4,
        schedule=ScheduleKind.ONE_F_ONE_B,
        recompute=False,
        zero_stage=1,
        stage_layers=[(0, 5), (5, 9)],
        predicted_step_seconds=0.5,
        samples_per_second=32.0,
        tflops_per_device=0.1,
        peak_memory_bytes=[1, 2],
        bubble_fraction=0.2,
        communication_fraction=0.1,
        cost_per_million_samples=0.0,
    )
    fields.update(overrides)
    return Candidate(**fields)


def test_candidate_covers_global_batch():
    assert candidate().global_batch == 16


def test_devices_must_equal_product_of_degrees():
    with pytest.raises(ValidationError, match="devices 3"):
        candidate(devices=3)


def test_stage_layers_must_be_contiguous_and_match_p():
    with pytest.raises(ValidationError, match="contiguous"):
        candidate(stage_layers=[(0, 4), (5, 9)])
    with pytest.raises(ValidationError, match="expected p\\*v = 2"):
        candidate(stage_layers=[(0, 9)])


def test_plan_rejects_a_candidate_that_changes_the_global_batch():
    good = candidate()
    with pytest.raises(ValidationError, match="not the global batch 16"):
        Plan(
            model="gpt-tiny",
            model_shape=SHAPE,
            cluster="local",
            request=PlanRequest(global_batch=16),
            chosen=good,
            morph_table=[MorphEntry(devices=2, candidate=candidate(devices=2, data_parallel=1))],
        )


def test_plan_round_trips_through_json():
    plan = Plan(
        model="gpt-tiny", model_shape=SHAPE, cluster="local", request=PlanRequest(global_batch=16, workers=2),
        chosen=candidate(),
    )  # fmt: skip
    assert Plan.model_validate_json(plan.model_dump_json()) == plan.model_copy(
        update={"request": PlanRequest(global_batch=16)}
    )
    assert plan.for_devices(4) is None
    assert (plan.global_batch, plan.layers) == (16, 9)


def test_a_plan_does_not_record_how_many_processes_searched():
    plan = Plan(
        model="gpt-tiny", model_shape=SHAPE, cluster="local", request=PlanRequest(global_batch=16, workers=3),
        chosen=candidate(),
    )  # fmt: skip
    assert "workers" not in plan.model_dump_json()


def test_plan_rejects_a_candidate_that_cuts_another_layer_count():
    shape = ModelShape(parameter_count=100, layer_parameter_counts=[10] * 10)
    with pytest.raises(ValidationError, match="cuts 9 layers, the model has 10"):
        Plan(model="gpt-tiny", model_shape=shape, cluster="local", request=PlanRequest(global_batch=16), chosen=candidate())

"""DeepSpeed config emission: the numbers come from the plan, DeepSpeed's parser accepts them, and
plans DeepSpeed cannot run (or would silently misread) are rejected with the values named."""

from __future__ import annotations

import pytest

from pipectl.artifacts.plan import Candidate, Plan, PlanRequest
from pipectl.artifacts.run import Precision, TrainingSettings
from pipectl.runtime.engines.dsconfig import DeepSpeedConfigRejected, check_pipeline_section, deepspeed_config, parse_with_deepspeed, stage_partition, validated_config
from pipectl.errors import UserInputError
from pipectl.schedule.ir import ScheduleKind
from builders import model_shape


def make_candidate(p=2, d=1, b=2, m=4, cuts=None, **extra) -> Candidate:
    cuts = cuts or [(0, 4), (4, 9)] if p == 2 else cuts or [(0, 9)]
    fields = dict(
        devices=p * d, device="cpu", tensor_parallel=1, pipeline_parallel=p, data_parallel=d,
        micro_batch_size=b, micro_batches=m, schedule=ScheduleKind.ONE_F_ONE_B, recompute=False,
        zero_stage=1, stage_layers=cuts, predicted_step_seconds=0.05, samples_per_second=100.0,
        tflops_per_device=0.0, peak_memory_bytes=[1] * len(cuts), bubble_fraction=0.1,
        communication_fraction=0.0, cost_per_million_samples=0.0,
    )  # fmt: skip
    fields.update(extra)
    return Candidate(**fields)


def make_plan(candidate: Candidate, global_batch: int | None = None, *, unchecked: bool = False) -> Plan:
    batch = global_batch or candidate.global_batch
    # model_construct: skip the artifact's own checks to reach launch's checks with a bad plan.
    builder = Plan if global_batch is None and not unchecked else Plan.model_construct
    return builder(
        model="gpt-tiny", model_shape=model_shape(), cluster="local", request=PlanRequest(global_batch=batch),
        chosen=candidate, candidates=[], infeasible={}, morph_table=[], notes=[],
    )  # fmt: skip


@pytest.mark.parametrize("p,d,b,m", [(2, 1, 2, 4), (1, 2, 4, 3), (2, 2, 1, 8), (1, 1, 8, 1)])
def test_batch_numbers_follow_the_plan_and_deepspeed_accepts_them(p, d, b, m):
    cuts = [(0, 4), (4, 9)] if p == 2 else [(0, 9)]
    candidate = make_candidate(p=p, d=d, b=b, m=m, cuts=cuts)
    config = validated_config(make_plan(candidate))
    assert config["train_batch_size"] == b * m * d
    assert config["train_micro_batch_size_per_gpu"] == b
    assert config["gradient_accumulation_steps"] == m
    assert config["pipeline"]["stages"] == p
    assert config["pipeline"]["partition"] == stage_partition(cuts)
    parsed = parse_with_deepspeed(config, data_parallel=d)
    assert (parsed.train_batch_size, parsed.gradient_accumulation_steps) == (b * m * d, m)


def test_checkpoint_prerequisites_are_always_set():
    config = deepspeed_config(make_candidate())
    assert config["zero_optimization"]["stage"] == 1  # checkpoints hold ZeRO-1's optimizer partitions
    assert config["optimizer"]["params"]["torch_adam"] is True
    assert "bf16" not in config
    assert deepspeed_config(make_candidate(), precision=Precision.BF16)["bf16"] == {"enabled": True}


def test_deepspeed_parser_rejects_a_batch_that_does_not_multiply_out():
    config = deepspeed_config(make_candidate(d=2, b=2, m=4, devices=4))
    config["train_batch_size"] = 20  # 2 x 4 x 2 = 16
    with pytest.raises(DeepSpeedConfigRejected, match=r"20 != 2 \* 4 \* 2"):
        parse_with_deepspeed(config, data_parallel=2)


def test_parser_sees_the_data_parallel_degree_not_world_size_one():
    config = deepspeed_config(make_candidate(d=1, b=2, m=4))
    parse_with_deepspeed(config, data_parallel=1)
    with pytest.raises(DeepSpeedConfigRejected, match=r"8 != 2 \* 4 \* 3"):
        parse_with_deepspeed(config, data_parallel=3)


def test_plan_whose_global_batch_disagrees_is_rejected_before_deepspeed():
    candidate = make_candidate(b=2, m=4)
    with pytest.raises(DeepSpeedConfigRejected, match=r"train_batch_size 12 != micro-batch 2 x accumulation 4"):
        validated_config(make_plan(candidate, global_batch=12))


def test_unknown_optimizer_is_rejected():
    config = deepspeed_config(make_candidate())
    config["optimizer"]["type"] = "SuperAdam"
    with pytest.raises(DeepSpeedConfigRejected, match="SuperAdam"):
        parse_with_deepspeed(config, data_parallel=1)


@pytest.mark.parametrize(
    "extra,message",
    [
        ({"zero_stage": 2}, "ZeRO stage 2 for t1 p2"),
        ({"zero_stage": 0}, "ZeRO stage 0 for t1 p2; pipectl trains with ZeRO-1"),
        ({"zero_stage": 3}, "ZeRO stage 3 for t1 p2; pipectl trains with ZeRO-1, and with ZeRO-2 or ZeRO-3 when"),
        ({"deepspeed_runnable": False}, "cannot run in DeepSpeed"),
    ],
)
def test_plans_deepspeed_cannot_run_are_rejected(extra, message):
    with pytest.raises(DeepSpeedConfigRejected, match=message):
        validated_config(make_plan(make_candidate(**extra)))


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_zero2_and_3_with_uneven_replicas_are_rejected(zero_stage):
    from pipectl.artifacts.plan import replica_shares

    candidate = make_candidate(p=1, d=2, m=2, zero_stage=zero_stage, replicas=replica_shares(6, 2, 2, "cpu"))
    with pytest.raises(DeepSpeedConfigRejected, match=f"uneven replicas .*ZeRO-{zero_stage} reduces gradients after every"):
        validated_config(make_plan(candidate, global_batch=6))


def test_uneven_replicas_write_the_global_batch_beside_the_largest_replicas_batch_keys():
    """B = 10 over d = 3 replicas of b = 2: 2, 2 and 1 micro-batches. The file's top-level keys are the
    largest replica's (2 x 2 x 3 = 12, each rank takes its own), so the global batch and the replicas
    are written in the pipeline section, where a reader of the file finds them; an elastic restart
    onto an even layout drops them."""
    from pipectl.artifacts.plan import replica_shares
    from pipectl.runtime.elastic.world_size import ds_config_for_candidate

    candidate = make_candidate(p=1, d=3, m=2, replicas=replica_shares(10, 3, 2, "cpu"))
    config = validated_config(make_plan(candidate, global_batch=10))
    assert config["train_batch_size"] == 12
    uneven = config["pipeline"]["uneven_replicas"]
    assert uneven["global_batch"] == 10
    assert sorted((r["micro_batches"], r["count"]) for r in uneven["replicas"]) == [(1, 1), (2, 2)]
    assert sum(r["micro_batch_size"] * r["micro_batches"] * r["count"] for r in uneven["replicas"]) == 10
    even = ds_config_for_candidate(config, make_candidate(p=1, d=1, m=5), 10)
    assert even["train_batch_size"] == 10 and "uneven_replicas" not in even["pipeline"]


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_a_one_stage_zero2_or_3_plan_is_a_valid_deepspeed_config(zero_stage):
    """DeepSpeed's ordinary engine runs it (`runtime/engines/plain.py`); its parser accepts the config."""
    config = validated_config(make_plan(make_candidate(p=1, d=2, m=2, zero_stage=zero_stage)))
    assert config["zero_optimization"]["stage"] == zero_stage


def test_zero3_with_per_layer_checkpointing_is_rejected():
    """DeepSpeed 0.19.8's ordinary engine fails its recomputed forwards under ZeRO-3 (measured)."""
    candidate = make_candidate(p=1, d=2, m=2, zero_stage=3, checkpoint_layers=True)
    with pytest.raises(DeepSpeedConfigRejected, match="ZeRO stage 3 with per-layer activation checkpointing"):
        validated_config(make_plan(candidate))


def test_zero3_with_a_tensor_split_is_rejected_without_blaming_the_pipeline():
    candidate = make_candidate(p=1, d=1, m=8, zero_stage=3, tensor_parallel=2, devices=2)
    with pytest.raises(DeepSpeedConfigRejected, match="ZeRO stage 3 for t2 p1") as raised:
        validated_config(make_plan(candidate))
    assert "pipeline parallelism" not in str(raised.value)


def test_interleaved_chunks_are_rejected():
    candidate = make_candidate(
        p=2, chunks=2, schedule=ScheduleKind.INTERLEAVED, cuts=[(0, 2), (2, 4), (4, 6), (6, 9)]
    )
    with pytest.raises(DeepSpeedConfigRejected, match="v=2"):
        validated_config(make_plan(candidate))


def test_cut_that_does_not_cover_the_model_is_rejected():
    candidate = make_candidate(cuts=[(0, 4), (4, 8)])
    with pytest.raises(DeepSpeedConfigRejected, match=r"the model has 9"):
        validated_config(make_plan(candidate, unchecked=True))


def test_pipeline_section_that_deepspeed_would_ignore_is_checked():
    candidate = make_candidate()
    config = deepspeed_config(candidate)
    config["pipeline"]["stages"] = 4  # DeepSpeed itself would accept this silently
    with pytest.raises(DeepSpeedConfigRejected, match="pipeline.stages 4"):
        check_pipeline_section(config, candidate)
    config = deepspeed_config(candidate)
    config["pipeline"]["partition"] = [0, 5, 9]
    with pytest.raises(DeepSpeedConfigRejected, match=r"\[0, 5, 9\]"):
        check_pipeline_section(config, candidate)


def test_uneven_replica_shares_are_validated_per_replica():
    from pipectl.artifacts.plan import ReplicaShare

    def share(replica, b, m):
        return ReplicaShare(replica=replica, device="cpu", micro_batch_size=b, micro_batches=m, samples=b * m,
                            gradient_weight=b * m / 8)  # fmt: skip

    candidate = make_candidate(p=1, d=2, b=2, m=2, devices=2, cuts=[(0, 9)], replicas=[share(0, 3, 2), share(1, 1, 2)])
    config = validated_config(make_plan(candidate))  # B = 6 + 2 = 8, not b*m*d
    assert config["train_batch_size"] == 8 and config["gradient_accumulation_steps"] == 2
    short = make_candidate(p=1, d=2, b=2, m=2, devices=2, cuts=[(0, 9)], replicas=[share(0, 3, 2), share(1, 1, 1)])
    with pytest.raises(DeepSpeedConfigRejected, match="2 replica shares covering 7 samples for data-parallel 2"):
        validated_config(make_plan(short, global_batch=8))


# --------------------------------------------------------------------------- training settings


def test_each_learning_rate_schedule_is_a_deepspeed_scheduler_its_parser_accepts():
    from pipectl.artifacts.run import LrSchedule, TrainingSettings

    plan = make_plan(make_candidate())
    constant = validated_config(plan, training=TrainingSettings(learning_rate=3e-4, weight_decay=0.1), total_steps=10)
    assert "scheduler" not in constant
    assert constant["optimizer"]["params"] == {
        "lr": 3e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1, "torch_adam": True,
    }  # fmt: skip
    warm = validated_config(plan, training=TrainingSettings(warmup_steps=5), total_steps=10)
    assert warm["scheduler"]["type"] == "WarmupLR" and warm["scheduler"]["params"]["warmup_num_steps"] == 5
    decay = validated_config(plan, training=TrainingSettings(lr_schedule=LrSchedule.WARMUP_DECAY, warmup_steps=2), total_steps=10)
    assert decay["scheduler"] == {
        "type": "WarmupDecayLR",
        "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "total_num_steps": 10, "warmup_num_steps": 2,
                   "warmup_type": "linear"},
    }  # fmt: skip
    cosine = TrainingSettings(lr_schedule=LrSchedule.WARMUP_COSINE, warmup_steps=2, min_lr_ratio=0.1, gradient_clipping=0.5)
    config = validated_config(plan, training=cosine, total_steps=10)
    assert config["scheduler"]["type"] == "WarmupCosineLR" and config["scheduler"]["params"]["cos_min_ratio"] == 0.1
    assert config["gradient_clipping"] == 0.5


def test_a_decaying_schedule_needs_steps_after_its_warm_up():
    from pipectl.artifacts.run import LrSchedule, TrainingSettings

    with pytest.raises(UserInputError, match="warmup-decay decays after 10 warm-up steps, but the run has 10 steps"):
        validated_config(
            make_plan(make_candidate()), training=TrainingSettings(lr_schedule=LrSchedule.WARMUP_DECAY, warmup_steps=10), total_steps=10
        )


def test_an_overlay_is_merged_section_by_section_and_validated_by_deepspeed(tmp_path):
    overlay = {
        "optimizer": {"params": {"betas": [0.9, 0.95]}},
        "csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "demo"},
        "zero_optimization": {"reduce_bucket_size": 50_000_000},
    }
    config = validated_config(make_plan(make_candidate()), overlay=overlay)
    assert config["optimizer"]["params"]["betas"] == [0.9, 0.95] and config["optimizer"]["params"]["torch_adam"]
    assert config["csv_monitor"]["enabled"] and config["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 50_000_000}
    with pytest.raises(DeepSpeedConfigRejected, match="not one of DeepSpeed's"):
        validated_config(make_plan(make_candidate()), overlay={"optimizer": {"type": "SuperAdam"}})
    with pytest.raises(DeepSpeedConfigRejected, match="DeepSpeed rejected the config"):
        validated_config(make_plan(make_candidate()), overlay={"zero_optimization": {"reduce_bucket_size": "lots"}})


@pytest.mark.parametrize(
    "overlay, message, hint",
    [
        ({"optimiser": {"params": {"betas": [0.9, 0.95]}}}, "sets 'optimiser', which DeepSpeed's config parser does "
         "not read", "did you mean 'optimizer'?"),
        ({"tensorbord": {"enabled": True}}, "sets 'tensorbord'", "did you mean 'tensorboard'?"),
        ({"overlay": {"gradient_clipping": 0.5}}, "sets 'overlay'", "config reference"),
        ({"optimizer": {"params": {"betaz": [0.9, 0.95]}}}, "sets optimizer.params.betaz, which AdamW does not take",
         "did you mean 'betas'?"),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 5}}},
         "sets scheduler.params.warmup_num_step, which WarmupLR does not take", "did you mean 'warmup_num_steps'?"),
        # The default constant rate has no scheduler: DeepSpeed builds none without a type, whatever the params.
        ({"scheduler": {"params": {"warmup_num_steps": 5}}}, "sets scheduler.params, but the run has no learning-rate "
         "scheduler", "--lr-schedule or --warmup-steps"),
    ],
)
def test_an_overlay_key_deepspeed_would_ignore_or_fail_on_in_the_ranks_is_refused(overlay, message, hint):
    """DeepSpeed's parser passes over a top-level key it does not know, and hands optimizer and
    scheduler params to their constructors as they are (a TypeError in every rank, after start)."""
    with pytest.raises(DeepSpeedConfigRejected) as info:
        validated_config(make_plan(make_candidate()), overlay=overlay)
    assert message in info.value.message and hint in info.value.hint


@pytest.mark.parametrize(
    "overlay, message",
    [
        # Not a mapping where DeepSpeed reads one: an AttributeError traceback, or DeepSpeed's words without the key.
        ({"optimizer": 5}, "sets optimizer to 5, where DeepSpeed reads a mapping"),
        ({"scheduler": 5}, "sets scheduler to 5, where DeepSpeed reads a mapping"),
        ({"optimizer": {"params": 5}}, "sets optimizer.params to 5, where DeepSpeed reads a mapping"),
        ({"zero_optimization": [1]}, "sets zero_optimization to [1], where DeepSpeed reads a mapping"),
        # What a launch option sets: the run would train with the overlay's value and keep the option's.
        ({"optimizer": {"params": {"lr": 0.5}}}, "sets optimizer.params.lr, which launch's --lr sets"),
        ({"gradient_clipping": "abc"}, "sets gradient_clipping, which launch's --gradient-clipping sets"),
        ({"optimizer": {"params": {"weight_decay": 0.1}}}, "sets optimizer.params.weight_decay, which launch's --weight-decay"),
    ],
)
def test_an_overlay_of_the_wrong_shape_or_of_an_options_key_is_refused_naming_it(overlay, message):
    with pytest.raises(DeepSpeedConfigRejected) as info:
        validated_config(make_plan(make_candidate()), overlay=overlay)
    assert message in info.value.message, info.value.message


def test_the_betas_and_eps_an_overlay_sets_are_checked_and_recorded_as_the_runs():
    """job.json's training settings said betas (0.9, 0.999) while the overlay trained with 0.95; a
    betas torch's AdamW refuses failed in every rank after the start."""
    from pipectl.runtime.engines.dsconfig import overlay_adam

    assert overlay_adam({"optimizer": {"params": {"betas": [0.9, 0.95], "eps": 1e-6}}}) == {"betas": [0.9, 0.95], "eps": 1e-6}
    assert overlay_adam({"tensorboard": {"enabled": True}}) == {} and overlay_adam({"optimizer": 5}) == {}
    with pytest.raises(DeepSpeedConfigRejected, match=r"sets optimizer.params.betas to \[0.9, 1.5\]: AdamW betas must lie"):
        overlay_adam({"optimizer": {"params": {"betas": [0.9, 1.5]}}})


def test_a_runs_stored_overlay_keeps_an_options_key_it_set_before_they_were_refused():
    """A resume or a resize merges the overlay the run stored: one written before option keys were
    refused still merges (a new overlay with the key is refused, above)."""
    stored = {"gradient_clipping": 0.3, "optimizer": {"params": {"lr": 0.5}}}
    config = validated_config(make_plan(make_candidate()), overlay=stored, stored_overlay=dict(stored))
    assert config["gradient_clipping"] == 0.3 and config["optimizer"]["params"]["lr"] == 0.5


def test_an_overlay_may_not_set_what_pipectls_own_schedule_takes_from_an_option():
    warm = TrainingSettings(warmup_steps=2)
    with pytest.raises(DeepSpeedConfigRejected, match="sets scheduler.params.warmup_num_steps, which launch's --warmup-steps"):
        validated_config(make_plan(make_candidate()), training=warm, overlay={"scheduler": {"params": {"warmup_num_steps": 4}}})


def test_every_key_of_pipectls_own_config_and_its_documented_overlays_is_read_by_deepspeed(tmp_path):
    overlay = {
        "optimizer": {"params": {"betas": [0.9, 0.95], "foreach": False, "amsgrad": False}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_type": "linear"}},
        "tensorboard": {"enabled": True, "output_path": str(tmp_path)},
        "comms_logger": {"enabled": False}, "flops_profiler": {"enabled": False}, "communication_data_type": "fp32",
    }  # fmt: skip
    config = validated_config(make_plan(make_candidate()), overlay=overlay)
    assert config["tensorboard"]["enabled"] and config["scheduler"]["params"]["warmup_num_steps"] == 3


@pytest.mark.parametrize(
    "overlay, key",
    [
        ({"train_batch_size": 64}, "train_batch_size"),
        ({"gradient_accumulation_steps": 1}, "gradient_accumulation_steps"),
        ({"pipeline": {"stages": 4}}, "pipeline"),
        ({"zero_optimization": {"stage": 3}}, "zero_optimization.stage"),
        ({"bf16": {"enabled": True}}, "bf16.enabled"),
        ({"fp16": {"enabled": True}}, "fp16.enabled"),
    ],
)
def test_an_overlay_cannot_set_what_the_plan_owns(overlay, key):
    with pytest.raises(DeepSpeedConfigRejected, match=f"sets {key}, which the plan owns"):
        validated_config(make_plan(make_candidate()), overlay=overlay)


@pytest.mark.parametrize("p, zero_stage", [(2, 1), (1, 2)])
def test_per_layer_checkpointing_is_recorded_and_deepspeed_accepts_it(p, zero_stage):
    # Both engines: the pipeline engine (p = 2) and the ordinary one of a one-stage ZeRO-2 plan.
    d = 2 if zero_stage == 2 else 1
    candidate = make_candidate(p=p, d=d, m=2 if d == 2 else 4, zero_stage=zero_stage, checkpoint_layers=True)
    pipeline = validated_config(make_plan(candidate))["pipeline"]
    assert pipeline["activation_checkpoint_interval"] == 1 and pipeline["use_reentrant"] is False
    plain = validated_config(make_plan(candidate.model_copy(update={"checkpoint_layers": False})))["pipeline"]
    assert plain["activation_checkpoint_interval"] == 0 and "use_reentrant" not in plain


def test_a_zb_h1_plan_is_refused_naming_the_split_backward():
    """Even written by hand (deepspeed_runnable left at its default): DeepSpeed has one backward."""
    with pytest.raises(DeepSpeedConfigRejected, match="schedule zb-h1 splits each backward"):
        validated_config(make_plan(make_candidate(schedule=ScheduleKind.ZB_H1)))


def test_zbv_on_a_torch_older_than_its_runtime_needs_is_refused_naming_both_versions(monkeypatch):
    """torch 2.11's pipelining runtime fails at a V's first step on gloo (measured): a zbv plan is
    refused before any rank starts, naming the torch found and the one needed; 2.12 runs it."""
    from pipectl.artifacts.plan import Engine
    from pipectl.runtime.engines import dsconfig

    zbv = make_candidate(schedule=ScheduleKind.ZBV, chunks=2, engine=Engine.TORCH, deepspeed_runnable=False,
                         cuts=[(0, 2), (2, 4), (4, 6), (6, 9)], peak_memory_bytes=[1, 1])  # fmt: skip
    monkeypatch.setattr(dsconfig, "installed_torch", lambda: (2, 11))
    with pytest.raises(DeepSpeedConfigRejected, match=r"schedule zbv needs torch 2\.12 or later .* has torch 2\.11"):
        validated_config(make_plan(zbv))
    monkeypatch.setattr(dsconfig, "installed_torch", lambda: (2, 12))
    validated_config(make_plan(zbv))


def test_a_plan_for_engine_torch_is_checked_against_what_that_runtime_runs():
    """The torch engine runs 1f1b, gpipe, interleaved and zb-h1 on one pipeline in fp32; its cut has
    p x v ranges. Anything else is refused naming the value."""
    from pipectl.artifacts.plan import Engine
    from pipectl.artifacts.run import Precision

    interleaved = make_candidate(
        schedule=ScheduleKind.INTERLEAVED, chunks=2, engine=Engine.TORCH, deepspeed_runnable=False,
        cuts=[(0, 2), (2, 4), (4, 6), (6, 9)], peak_memory_bytes=[1, 1],
    )  # fmt: skip
    config = validated_config(make_plan(interleaved))
    assert config["pipeline"]["partition"] == [0, 2, 4, 6, 9] and config["pipeline"]["stages"] == 2
    validated_config(make_plan(make_candidate(schedule=ScheduleKind.ZB_H1, engine=Engine.TORCH, deepspeed_runnable=False)))
    with pytest.raises(DeepSpeedConfigRejected, match="precision bf16: the torch engine .* fp32 only"):
        validated_config(make_plan(interleaved), precision=Precision.BF16)
    with pytest.raises(DeepSpeedConfigRejected, match=r"engine torch .* cannot run: t1 d2"):
        validated_config(make_plan(make_candidate(d=2, m=2, engine=Engine.TORCH)))
    with pytest.raises(DeepSpeedConfigRejected, match="schedule 1f1b with whole-stage recomputation"):
        validated_config(make_plan(make_candidate(recompute=True, engine=Engine.TORCH)))
    with pytest.raises(UserInputError, match=r"AdamW settings \['amsgrad'\] are not read by the torch engine"):
        validated_config(make_plan(interleaved), overlay={"optimizer": {"params": {"amsgrad": True}}})
    with pytest.raises(DeepSpeedConfigRejected, match="2 stage ranges for pipeline degree 2 x 2 chunks"):
        validated_config(make_plan(interleaved.model_copy(update={"stage_layers": [(0, 4), (4, 9)]}), unchecked=True))
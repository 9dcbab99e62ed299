"""Engine calibration arithmetic: raw one-rank timings -> the profile's scale-invariant terms."""

from __future__ import annotations

import pytest

from pipectl.testing.profiles import synthetic_profile
from pipectl.profile.runtime_calibration import MINIMUM_COMPUTE_RATIO, runtime_costs
from pipectl.profile.engine_timing import EngineTimings, null_model


def _profile():
    return synthetic_profile(blocks=2, micro_batch_sizes=[1, 4], device="cpu", dtype="float32")


def _sums(profile, size):
    costs = [layer.cost(size) for layer in profile.layers]
    return sum(c.forward_seconds for c in costs), sum(c.backward_seconds for c in costs)


def test_terms_come_from_the_null_model_and_the_difference_to_the_real_one():
    profile = _profile()
    null = EngineTimings(1, 2, forward_seconds=0.001, backward_seconds=0.002, step_end_seconds=0.003, step_seconds=0.01)
    forward_1, backward_1 = _sums(profile, 1)
    forward_4, backward_4 = _sums(profile, 4)
    timings = [
        EngineTimings(1, 1_000_002, 0.001 + 1.5 * forward_1, 0.002 + 1.2 * backward_1, 0.013, 0.1),
        EngineTimings(4, 1_000_002, 0.001 + 1.1 * forward_4, 0.002 + 1.0 * backward_4, 0.015, 0.2),
    ]
    runtime = runtime_costs(profile, null, timings, "test engine")
    assert runtime.forward_overhead_seconds == 0.001
    assert runtime.backward_overhead_seconds == 0.002
    assert runtime.step_fixed_seconds == 0.003
    # Median end of step 14 ms, 11 ms more than the null model, over 1e6 more parameters.
    assert runtime.step_seconds_per_parameter == pytest.approx(0.011 / 1_000_000)
    assert [(r.micro_batch_size, round(r.forward_ratio, 6), round(r.backward_ratio, 6)) for r in runtime.compute_ratios] == [
        (1, 1.5, 1.2),
        (4, 1.1, 1.0),
    ]
    assert runtime.calibration_parameter_count == 1_000_002


def test_noise_cannot_make_compute_vanish_or_the_slope_negative():
    profile = _profile()
    null = EngineTimings(1, 2, forward_seconds=1.0, backward_seconds=1.0, step_end_seconds=0.02, step_seconds=3.0)
    timings = [EngineTimings(1, 1000, 0.5, 0.5, 0.01, 1.0)]  # faster than the null model: noise
    runtime = runtime_costs(profile, null, timings, "test engine")
    assert runtime.compute_ratios[0].forward_ratio == MINIMUM_COMPUTE_RATIO
    assert runtime.compute_ratios[0].backward_ratio == MINIMUM_COMPUTE_RATIO
    assert runtime.step_seconds_per_parameter == 0.0


def test_null_model_is_one_cheap_layer_with_a_loss():
    import torch

    model = null_model()
    assert [layer.name for layer in model.layers] == ["null"]
    inputs, labels = model.make_batch(3, torch.Generator().manual_seed(0))
    module = model.layers[0].build()
    assert sum(p.numel() for p in module.parameters()) == 2
    loss = model.loss_fn(model.layers[0].forward(module, inputs), labels)
    assert loss.ndim == 0


def test_trimmed_mean_drops_the_extremes():
    from pipectl.profile.host_sharing import trimmed_mean

    assert trimmed_mean([0.0] + [1.0] * 8 + [100.0]) == 1.0
    assert trimmed_mean([2.0, 4.0]) == 3.0  # too few values to drop any


def test_wall_over_cpu_is_never_below_one():
    from pipectl.profile.host_sharing import wall_over_cpu

    assert wall_over_cpu([(0.004, 0.002), (0.002, 0.002)]) == 1.5
    assert wall_over_cpu([(0.002, 0.002)] * 9 + [(0.022, 0.002)]) == pytest.approx(2.0)  # a preempted round counts
    assert wall_over_cpu([(0.001, 0.002)]) == 1.0  # clock granularity: never faster than the CPU
    assert wall_over_cpu([]) == 1.0


@pytest.mark.multiprocess
def test_two_ranks_measure_how_they_share_the_host():
    from pipectl.profile.host_sharing import measure_host_sharing

    sharing = measure_host_sharing(rounds=5, timeout_seconds=60)
    assert sharing.ranks == 2
    assert 0.0 <= sharing.busy_handoff_seconds < 0.5
    assert 1.0 <= sharing.alone_compute_slowdown < 10.0
    assert 1.0 <= sharing.concurrent_compute_slowdown < 10.0
    # Without a gradient size only the small all-reduce is timed: a latency, no bandwidth.
    assert 0.0 < sharing.busy_allreduce_latency_seconds < 0.5
    assert sharing.busy_allreduce_bandwidth_bytes_per_second == 0.0


@pytest.mark.multiprocess
def test_host_sharing_runs_the_model_and_times_a_gradient_sized_all_reduce():
    from pipectl.models import build_model
    from pipectl.profile.host_sharing import measure_host_sharing, model_compute

    compute = model_compute(build_model("gpt-tiny"), 1)
    sharing = measure_host_sharing(compute, compute_seconds=0.05, gradient_bytes=1 << 20, rounds=4, timeout_seconds=60)
    assert 1.0 <= sharing.concurrent_compute_slowdown < 10.0
    assert 0.0 < sharing.busy_allreduce_latency_seconds < 0.5
    # A 1 MiB all-reduce over loopback: between 1 MB/s and 1 TB/s whatever the load.
    assert 1e6 < sharing.busy_allreduce_bandwidth_bytes_per_second < 1e12


def test_model_compute_runs_a_forward_and_backward_and_leaves_no_gradients():
    from pipectl.models import build_model
    from pipectl.profile.host_sharing import host_plan, model_compute

    compute = model_compute(build_model("mlp-tiny"), 2)
    compute()
    compute()  # twice: gradients are cleared, nothing accumulates or breaks
    # Round counts follow the compute's length, within their bounds.
    assert host_plan(0.001, 4096).compute_rounds == 100
    assert host_plan(10.0, 4096).compute_rounds == 5 and host_plan(10.0, 4096).message_rounds == 8
    assert host_plan(0.04, 4096).compute_rounds == 10


def test_children_fork_only_where_there_is_no_cuda_and_cpu_children_see_no_gpu(monkeypatch):
    import torch

    from pipectl.profile.engine_timing import child_environment, start_method

    # Where CUDA exists, a forked child could not run autograd after this process did: spawn.
    assert start_method() == ("spawn" if torch.cuda.is_available() else "fork")
    assert child_environment("cpu") == {"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert child_environment("cuda") == {"CUDA_VISIBLE_DEVICES": "0", "DS_ACCELERATOR": "cuda"}
    assert child_environment("cuda:1")["CUDA_VISIBLE_DEVICES"] == "1"
    # The parent's own numbering: its cuda:1 is physical GPU 5.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    assert child_environment("cuda:1")["CUDA_VISIBLE_DEVICES"] == "5"


@pytest.mark.multiprocess
def test_the_calibration_runs_in_spawned_children_as_on_a_host_with_cuda():
    """What a host with a GPU does for a CPU calibration: fresh interpreters (the model, the
    compute and the pipes are sent to them), pinned to the CPU; and this process's environment
    is left as it was."""
    import os

    from pipectl.models import build_model
    from pipectl.models.base import shape_of
    from pipectl.profile.host_sharing import measure_host_sharing, model_compute
    from pipectl.profile.engine_timing import run_engine_calibration

    before = {key: os.environ.get(key) for key in ("CUDA_VISIBLE_DEVICES", "DS_ACCELERATOR")}
    model = build_model("gpt-tiny")
    null, timings = run_engine_calibration(model, [1], warmup=0, steps=1, start="spawn", timeout_seconds=180)
    assert null.parameter_count == 2 and timings[0].parameter_count == shape_of(model).parameter_count
    assert timings[0].forward_seconds > 0 and timings[0].step_seconds > 0
    sharing = measure_host_sharing(model_compute(build_model("mlp-tiny"), 1), compute_seconds=0.01, rounds=2,
                                   start="spawn", timeout_seconds=180)  # fmt: skip
    assert sharing.alone_compute_slowdown >= 1.0 and sharing.busy_allreduce_latency_seconds > 0
    assert {key: os.environ.get(key) for key in before} == before


@pytest.mark.multiprocess
def test_a_bf16_profile_is_calibrated_on_deepspeeds_bf16_engine():
    """A GPU user profiles in bf16 and trains in bf16: the calibration runs that engine (its fp32
    master copy and casts are part of every step), the near-free model included."""
    from pipectl.artifacts.run import Precision
    from pipectl.models import build_model
    from pipectl.profile.runtime_calibration import engine_description
    from pipectl.profile.engine_timing import run_engine_calibration

    null, timings = run_engine_calibration(build_model("gpt-tiny"), [1, 2], warmup=0, steps=1, timeout_seconds=180,
                                           precision=Precision.BF16)  # fmt: skip
    assert [t.micro_batch_size for t in timings] == [1, 2]
    assert null.step_seconds > 0 and all(t.forward_seconds > 0 and t.backward_seconds > 0 for t in timings)
    assert "bf16" in engine_description("cpu", Precision.BF16)


def test_the_profile_says_when_the_calibration_stopped_short_and_which_precision_ran(monkeypatch):
    import torch

    from pipectl.artifacts.profile import EngineComputeRatio, RuntimeCosts
    from pipectl.artifacts.run import Precision
    from pipectl.models import build_model
    from pipectl.profile import measure

    asked = {}

    def calibrate(model, profile, **kwargs):
        asked.update(kwargs)
        return RuntimeCosts(engine="e", forward_overhead_seconds=0, backward_overhead_seconds=0, step_fixed_seconds=0,
                            step_seconds_per_parameter=0,
                            compute_ratios=[EngineComputeRatio(micro_batch_size=1, forward_ratio=1, backward_ratio=1)])  # fmt: skip

    monkeypatch.setattr(measure, "calibrate_runtime", calibrate)
    profile = measure.with_runtime_costs(_profile(), build_model("gpt-tiny"), torch.device("cpu"), torch.bfloat16, 0)
    assert asked["precision"] is Precision.BF16 and profile.runtime is not None
    assert any("stopped after micro-batch size 1" in note for note in profile.notes), profile.notes

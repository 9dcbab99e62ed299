"""Launch's checks before anything starts: the plan's precision, a GPU for every rank of a node."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from pipectl.artifacts.run import Precision
from pipectl.cli.main import app
from pipectl.errors import UserInputError
from pipectl.launch import check_gpus_for_ranks, planned_precision

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_the_precision_is_the_plans_unless_none_was_recorded():
    assert planned_precision("bfloat16", None) is Precision.BF16
    assert planned_precision("float32", None) is Precision.FP32
    assert planned_precision("bfloat16", Precision.BF16) is Precision.BF16
    assert planned_precision(None, None) is Precision.FP32  # a plan made in memory, no profile
    assert planned_precision(None, Precision.BF16) is Precision.BF16


def test_another_precision_than_the_plans_is_refused_with_both_named():
    with pytest.raises(UserInputError, match=r"--precision fp32: the plan was made for bfloat16") as error:
        planned_precision("bfloat16", Precision.FP32)
    assert "--dtype float32" in error.value.hint
    with pytest.raises(UserInputError, match=r"^job.toml \[training\] precision = 'fp32': the plan was made"):
        planned_precision("bfloat16", Precision.FP32, "job.toml [training] precision = 'fp32'")  # named as given
    with pytest.raises(UserInputError, match="pipectl's runtime does not train in yet"):
        planned_precision("float64", None)  # said before anything starts


@pytest.mark.parametrize("ranks, gpus, fits", [(1, 1, True), (8, 8, True), (2, 1, False), (8, 0, False)])
def test_a_node_needs_a_gpu_for_each_of_its_ranks(ranks, gpus, fits):
    if fits:
        check_gpus_for_ranks(ranks, gpus)
    else:
        with pytest.raises(UserInputError, match=f"runs {ranks} ranks on this node but it has {gpus} visible GPU"):
            check_gpus_for_ranks(ranks, gpus)


@pytest.fixture(scope="module")
def bf16_plan(tmp_path_factory):
    """A plan made from a derived (bfloat16) profile of gpt-tiny on two CPU ranks."""
    folder = tmp_path_factory.mktemp("bf16")
    profile, plan = folder / "profile.json", folder / "plan.json"
    made = invoke("profile", "gpt-tiny", "--derive", "--device", "cpu", "--micro-batch-sizes", "1,2", "-o", profile)
    assert made.exit_code == 0, made.output
    assert json.loads(profile.read_text())["dtype"] == "bfloat16"
    planned = invoke(
        "plan", "--profile", profile, "--cluster", "local", "--devices", "2", "--global-batch", "8", "-o", plan,
        "--no-morph",
    )
    assert planned.exit_code == 0, planned.output
    return plan


def test_launch_trains_in_the_plans_precision_by_default(bf16_plan, tmp_path):
    result = invoke("launch", bf16_plan, "--run-dir", tmp_path / "run", "--dry-run", "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output)
    assert payload["job"]["precision"] == "bf16"
    assert payload["ds_config"]["bf16"] == {"enabled": True}


def test_launch_refuses_another_precision_with_exit_2_and_writes_nothing(bf16_plan, tmp_path):
    result = invoke("launch", bf16_plan, "--run-dir", tmp_path / "run", "--precision", "fp32")
    assert result.exit_code == 2, result.output
    assert "--precision fp32" in result.output and "bfloat16" in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "run").exists()
    contradiction = invoke("launch", bf16_plan, "--run-dir", tmp_path / "run", "--bf16", "--precision", "fp32")
    assert contradiction.exit_code == 2 and "--bf16 contradicts --precision fp32" in contradiction.output


def test_the_launch_modules_worked_examples_hold():
    import doctest

    import pipectl.launch
    import pipectl.launch.engines
    import pipectl.launch.placement
    import pipectl.paths

    for module in (pipectl.launch, pipectl.launch.engines, pipectl.launch.placement, pipectl.paths):
        assert doctest.testmod(module).failed == 0, module.__name__


def test_a_model_profiled_from_a_yaml_path_launches_without_naming_it_again(tmp_path, monkeypatch):
    # The YAML's name is not a shipped model: launch must build the path the profile was made from.
    from pipectl.paths import configs_dir

    monkeypatch.chdir(tmp_path)
    config = (configs_dir() / "models" / "gpt-tiny.yaml").read_text().replace("name: gpt-tiny", "name: my-gpt")
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "my-gpt.yaml").write_text(config)
    made = invoke("profile", "models/my-gpt.yaml", "--derive", "--device", "cpu", "-b", "1,2", "-o", "profile.json")
    assert made.exit_code == 0, made.output
    # Recorded absolute, once, when given: ranks start in the run directory, resize and resume anywhere.
    absolute = str((tmp_path / "models" / "my-gpt.yaml").resolve())
    assert json.loads((tmp_path / "profile.json").read_text())["model_reference"] == absolute
    planned = invoke("plan", "--profile", "profile.json", "--cluster", "local", "--devices", "2", "--global-batch", "8",
                     "-o", "plan.json", "--no-morph")  # fmt: skip
    assert planned.exit_code == 0, planned.output
    launched = invoke("launch", "plan.json", "--run-dir", "run", "--dry-run", "--json")
    assert launched.exit_code == 0, launched.output
    assert json.loads(launched.output)["job"]["model"] == absolute


def test_a_host_much_busier_than_when_profiled_is_named_before_the_job_starts(tmp_path, monkeypatch):
    """A profile measured on an idle host predicts an idle host: a launch onto a loaded one says so
    (how much busier, the loads, what to do), rather than leaving the user with a large error."""
    import pipectl.launch
    from pipectl.artifacts.plan import Plan
    from pipectl.artifacts.profile import HostState, ModelProfile
    from pipectl.io import load_model, write_json_atomic
    from pipectl.launch import LaunchOptions, prepare_launch

    monkeypatch.chdir(tmp_path)
    assert invoke("profile", "gpt-tiny", "--derive", "--device", "cpu", "-b", "1,2", "-o", "derived.json").exit_code == 0
    profile = load_model(ModelProfile, tmp_path / "derived.json")
    write_json_atomic(tmp_path / "profile.json",
                      profile.model_copy(update={"host": HostState(cores=2, load_average=0.3, timing_spread=0.05)}))
    planned = invoke("plan", "--profile", "profile.json", "--cluster", "local", "--devices", "2", "--global-batch", "8",
                     "-o", "plan.json", "--no-morph")  # fmt: skip
    assert planned.exit_code == 0, planned.output
    plan = load_model(Plan, tmp_path / "plan.json")

    monkeypatch.setattr(pipectl.launch, "host_state", lambda: HostState(cores=2, load_average=0.5))
    assert prepare_launch(plan, tmp_path / "run", LaunchOptions(), plan_dir=tmp_path, write=False).busier is None
    monkeypatch.setattr(pipectl.launch, "host_state", lambda: HostState(cores=2, load_average=6.0))
    busier = prepare_launch(plan, tmp_path / "run", LaunchOptions(), plan_dir=tmp_path, write=False).busier
    assert busier.startswith("the host is 3.0x busier than when profiled: 3 runnable tasks a core now (load 6 on 2 cores), "
                             "1 then (load 0.3)")
    assert "re-profile" in busier


def test_a_measured_profile_records_how_busy_the_host_was():
    from pipectl.models import build_model
    from pipectl.profile.measure import profile_model

    profile = profile_model(build_model("gpt-tiny"), [1], warmup=1, repeats=3, runtime=False)
    assert profile.host is not None and profile.host.cores >= 1 and profile.host.load_average >= 0
    assert profile.host.timing_spread is not None and profile.host.timing_spread >= 0


def test_force_with_the_runs_own_plan_is_refused_and_deletes_nothing(tmp_path, monkeypatch):
    """`launch RUN/plan.json --run-dir RUN --force` emptied the run (checkpoints, metrics, the plan
    itself), then failed for want of the plan's profile; it is refused first, dry run or not."""
    from pipectl.artifacts.plan import Plan
    from pipectl.io import load_model
    from pipectl.launch import LaunchOptions, prepare_launch

    monkeypatch.chdir(tmp_path)
    assert invoke("profile", "gpt-tiny", "--derive", "--device", "cpu", "-b", "1,2", "-o", "profile.json").exit_code == 0
    assert invoke("plan", "--profile", "profile.json", "--cluster", "local", "--devices", "2", "--global-batch", "8",
                  "-o", "plan.json", "--no-morph").exit_code == 0  # fmt: skip
    run = tmp_path / "run"
    prepared = prepare_launch(load_model(Plan, tmp_path / "plan.json"), run, LaunchOptions(steps=2), plan_dir=tmp_path)
    prepared.lock.release()
    before = sorted(p.name for p in run.iterdir())
    own = load_model(Plan, run / "plan.json")
    for write in (False, True):
        with pytest.raises(UserInputError, match="--force would delete the plan this launch reads"):
            prepare_launch(own, run, LaunchOptions(steps=2, force=True), plan_dir=run, write=write)
    assert sorted(p.name for p in run.iterdir()) == before

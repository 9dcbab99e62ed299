"""A pipectl file of one kind given where another is expected is named for what it is, exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipectl.artifacts.plan import ModelShape
from pipectl.artifacts.profile import LinkClass, LinkClassFit, LinksProfile
from pipectl.catalog import DeviceCatalog
from pipectl.cli.main import app
from pipectl.io import ARTIFACT_KINDS, artifact_kind, read_mapping, write_json_atomic
from pipectl.paths import configs_dir
from pipectl.testing.profiles import synthetic_profile
from pipectl.planfile import write_plan
from builders import gpt_tiny_candidate, plan_of

runner = CliRunner()


@pytest.fixture()
def files(tmp_path: Path) -> dict[str, Path]:
    profile = synthetic_profile(blocks=6, micro_batch_sizes=[1, 2])  # 9 layers, as gpt-tiny
    profile_path = write_json_atomic(tmp_path / "profile.json", profile)
    plan_path = tmp_path / "plan.json"
    write_plan(plan_path, plan_of(gpt_tiny_candidate(p=2), model=profile.model, shape=ModelShape.of_profile(profile)),
               profile_file=profile_path)
    links = LinksProfile(backend="gloo", device="cpu", fits=[LinkClassFit(
        link_class=LinkClass.INTRA_NODE, p2p_latency_seconds=5e-5, p2p_bandwidth_bytes_per_second=3e9,
        allreduce_latency_seconds=7e-5, allreduce_bandwidth_bytes_per_second=1.5e9)])  # fmt: skip
    return {
        "profile": profile_path,
        "plan": plan_path,
        "links": write_json_atomic(tmp_path / "links.json", links),
        "cluster": configs_dir() / "clusters" / "a100-8x8.yaml",
        "ds_config": write_json_atomic(tmp_path / "ds_config.json", {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
                                                                     "gradient_accumulation_steps": 4}),
    }


@pytest.mark.parametrize(
    "given, args, message",
    [
        ("profile", ["simulate", "{file}"], "is a profile (pipectl profile), not a plan (pipectl plan)"),
        ("plan", ["plan", "--profile", "{file}", "--cluster", "local", "--global-batch", "4", "-o", "{out}"],
         "is a plan (pipectl plan), not a profile (pipectl profile)"),
        ("links", ["plan", "--profile", "{profile}", "--cluster", "{file}", "--global-batch", "4", "-o", "{out}"],
         "is a links calibration (pipectl profile links), not a cluster"),
        ("plan", ["profile", "gpt-tiny", "--derive", "--device", "a100-80gb", "--links", "{file}", "-o", "{out}"],
         "is a plan (pipectl plan), not a links calibration (pipectl profile links)"),
        ("cluster", ["simulate", "{plan}", "--profile", "{file}"],
         "is a cluster (configs/clusters/*.yaml), not a profile (pipectl profile)"),
        ("plan", ["profile", "show", "{file}"], "is a plan (pipectl plan), not a profile (pipectl profile)"),
        ("ds_config", ["simulate", "{file}"], "is a DeepSpeed config (a run's ds_config.json), not a plan (pipectl plan)"),
    ],
)
def test_the_wrong_kind_of_file_is_named(files, tmp_path, given, args, message):
    values = {"file": str(files[given]), "out": str(tmp_path / "out.json"), "profile": str(files["profile"]),
              "plan": str(files["plan"])}
    result = runner.invoke(app, [arg.format(**values) for arg in args])
    assert result.exit_code == 2, result.output
    assert f"{files[given]} {message}" in " ".join(result.output.split())
    assert "Field required" not in result.output and "Extra inputs" not in result.output
    assert not (tmp_path / "out.json").exists()


def test_a_damaged_file_of_the_right_kind_still_names_the_field(files, tmp_path):
    data = read_mapping(files["profile"])
    data["micro_batch_sizes"] = "many"
    damaged = write_json_atomic(tmp_path / "damaged.json", data)
    result = runner.invoke(app, ["plan", "--profile", str(damaged), "--cluster", "local", "--global-batch", "4",
                                 "-o", str(tmp_path / "out.json")])
    assert result.exit_code == 2 and "micro_batch_sizes" in result.output and "not a" not in result.output


def test_each_kind_is_told_by_required_keys_no_other_kind_has():
    import pipectl.artifacts.cluster, pipectl.artifacts.model, pipectl.artifacts.morph  # noqa: F401, E401
    import pipectl.artifacts.plan, pipectl.artifacts.profile, pipectl.artifacts.run  # noqa: F401, E401
    from pipectl.artifacts.base import Artifact
    from pipectl.measured.runs import RunConditions  # a conditions file: data of the user's, not pipectl's

    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    models = {cls.__name__: cls for cls in [*subclasses(Artifact), DeviceCatalog, RunConditions]}
    for name, (_, keys) in ARTIFACT_KINDS.items():
        if name in models:  # (DeepSpeed's config is no model of pipectl's)
            fields = models[name].model_fields
            assert all(fields[key].is_required() for key in keys), name
        for other, cls in models.items():
            if other != name:
                assert not keys <= cls.model_fields.keys(), f"{other} could pass for {name}"


def test_shipped_configs_are_told_apart():
    assert artifact_kind(read_mapping(configs_dir() / "devices.yaml")) == "DeviceCatalog"
    assert artifact_kind(read_mapping(configs_dir() / "models" / "gpt-tiny.yaml")) == "ModelConfig"
    for cluster in (configs_dir() / "clusters").glob("*.yaml"):
        assert artifact_kind(read_mapping(cluster)) == "ClusterSpec", cluster


def test_docstring_examples():
    import doctest

    import pipectl.io

    assert doctest.testmod(pipectl.io).failed == 0


def test_a_file_of_no_kind_of_ours_is_said_to_be_none_in_one_line(files, tmp_path):
    """A user hands a benchmark's JSON (or any other) as a calibration, a plan or a cluster: one line
    saying it is not one, not a field-by-field list of everything it lacks and has."""
    from cli_process import pipectl

    other = {"machine": "2 cores", "command": "x", "date": "today", "runtime_seconds": 1.0, "steps": 24, "repeats": 2}
    write_json_atomic(tmp_path / "results.json", other)
    (tmp_path / "profile.json").write_bytes(files["profile"].read_bytes())
    cases = [
        (["simulate", "results.json"], "a plan (pipectl plan)"),
        (["plan", "--profile", "profile.json", "--cluster", "results.json", "--global-batch", "4", "-o", "out.json"],
         "a cluster (configs/clusters/*.yaml)"),
        (["plan", "--profile", "profile.json", "--cluster", "local", "--global-batch", "4", "--calibration",
          "results.json", "-o", "out.json"], "a calibration (pipectl calibrate MEASURED.csv)"),
    ]
    for args, kind in cases:
        result = pipectl(*args, cwd=tmp_path)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2, result.stderr
        assert len(lines) == 1 and lines[0].startswith(f"error: results.json is not {kind}: it has no "), lines
        assert "6 keys one does not have (command, date, machine, repeats, ...)" in lines[0], lines[0]
        assert "Traceback" not in result.stderr and not (tmp_path / "out.json").exists()


def test_a_file_given_for_a_run_directory_is_named_by_export_and_calibrate(files, tmp_path):
    """export and calibrate said 'no run directory at plan.json (it holds no job.json)' of a plan,
    where status and resize name it for what it is."""
    from cli_process import pipectl

    exported = pipectl("export", "plan.json", "-o", "hf", cwd=tmp_path)
    assert exported.returncode == 2 and "plan.json is a plan (pipectl plan), not a run directory" in exported.stderr
    calibrated = pipectl("calibrate", "plan.json", "-o", "c.json", cwd=tmp_path)
    assert calibrated.returncode == 2, calibrated.stderr
    assert "plan.json is a plan (pipectl plan), neither a run directory nor a CSV of measured runs" in calibrated.stderr

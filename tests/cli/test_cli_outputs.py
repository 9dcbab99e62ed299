"""What a command writes never replaces what a run, or its model, reads: a run's files anywhere
below its folder, the model config or Hugging Face folder it trains, a run nested in a run."""

from __future__ import annotations

import json
import shutil

from typer.testing import CliRunner

from pipectl.artifacts.run import StepMetrics
from pipectl.cli.main import app
from pipectl.io import write_json_atomic
from pipectl.testing.profiles import synthetic_profile
from tests.cli.test_cli_status import make_run

runner = CliRunner()


def test_calibrate_does_not_write_over_the_runs_model_or_its_files(tmp_path):
    """`calibrate RUN -o mine.yaml` replaced the model config the run resumes from (it then refused
    to resume); `-o RUN/checkpoints/.../file` broke a verified checkpoint."""
    run = make_run(tmp_path)
    model = tmp_path / "mine.yaml"
    model.write_text("name: mine\n")
    job = json.loads((run / "job.json").read_text())
    (run / "job.json").write_text(json.dumps({**job, "model": str(model)}))
    result = runner.invoke(app, ["calibrate", str(run), "-o", str(model)])
    assert result.exit_code == 2 and f"-o {model} is the model {run} trains" in result.output, result.output
    assert model.read_text() == "name: mine\n"
    # The run is named without the '..' of the path given (`elsewhere/../run/...`).
    (tmp_path / "elsewhere").mkdir()
    inside = tmp_path / "elsewhere" / ".." / "run" / "logs" / "x.json"
    result = runner.invoke(app, ["calibrate", str(run), "-o", str(inside)])
    assert result.exit_code == 2 and f"is a file of the run in {run}; write" in " ".join(result.output.split()), result.output
    inside = run / "checkpoints" / "step00000004" / "fp32.pt"
    before = inside.read_bytes()
    result = runner.invoke(app, ["calibrate", str(run), "-o", str(inside)])
    assert result.exit_code == 2 and f"is a file of the run in {run}" in result.output, result.output
    assert inside.read_bytes() == before


def test_plan_does_not_write_into_a_runs_folders_nor_the_hf_model_it_was_profiled_from(tmp_path):
    run = make_run(tmp_path)
    profile = tmp_path / "p.json"
    hf = tmp_path / "tiny-llama"
    hf.mkdir()
    (hf / "model.safetensors").write_bytes(b"weights")
    write_json_atomic(profile, {**synthetic_profile(blocks=4, micro_batch_sizes=[1, 2], device="cpu").model_dump(mode="json"),
                                "model_reference": f"hf:{hf}"})  # fmt: skip
    args = ["plan", "--profile", str(profile), "--cluster", "local", "--global-batch", "4", "-o"]
    result = runner.invoke(app, [*args, str(run / "logs" / "resume.json")])
    assert result.exit_code == 2 and f"is a file of the run in {run}" in result.output, result.output
    result = runner.invoke(app, [*args, str(hf / "model.safetensors")])
    assert result.exit_code == 2 and f"is in the model {profile} was profiled from" in result.output, result.output
    assert (hf / "model.safetensors").read_bytes() == b"weights"
    assert runner.invoke(app, [*args, str(run / "another-plan.json")]).exit_code == 0  # beside a run: its own file


def test_a_run_is_not_made_inside_a_run_nor_exported_into_one(tmp_path):
    """A run inside a run reads as the outer one's files (and --force of that one deletes it); a
    folder exported into a run's checkpoints/ reads as a checkpoint that never committed."""
    run = make_run(tmp_path)
    result = runner.invoke(app, ["launch", str(run / "plan.json"), "--run-dir", str(run / "sub"), "--dry-run"])
    assert result.exit_code == 2 and f"lies inside the run in {run}" in result.output, result.output
    job = json.loads((run / "job.json").read_text())  # export writes an hf: run's model
    (run / "job.json").write_text(json.dumps({**job, "model": f"hf:{tmp_path / 'tiny-llama'}"}))
    result = runner.invoke(app, ["export", str(run), "-o", str(run / "checkpoints" / "step00000099")])
    assert result.exit_code == 2 and f"lies inside the run in {run}" in result.output, result.output
    assert not (run / "sub").exists() and not (run / "checkpoints" / "step00000099").exists()
    (tmp_path / "mine.yaml").write_text("name: mine\n")
    result = runner.invoke(app, ["export", str(run), "-o", str(tmp_path / "mine.yaml" / "sub")])
    assert result.exit_code == 2 and "mine.yaml is not a folder" in result.output and ".partial" not in result.output


def test_a_dry_run_refuses_what_the_command_would_refuse(tmp_path):
    """`resize --dry-run` of a run that trained steps but wrote no checkpoint said all was well; the
    resize itself refuses it. `status --follow` of a file waited a minute for a run to appear."""
    from pipectl.rundir.metrics import MetricsWriter
    from tests.cli.test_cli_resize import make_run as resizable_run

    resizable = resizable_run(tmp_path / "resizable")
    shutil.rmtree(resizable / "checkpoints")  # 3 steps trained, no checkpoint
    writer = MetricsWriter(resizable, rank=0)
    for step in (1, 2, 3):
        writer.write(StepMetrics(step=step, loss=5.0, step_seconds=0.1, predicted_step_seconds=0.1,
                                 samples_per_second=80.0, global_batch=8, world_size=2))  # fmt: skip
    result = runner.invoke(app, ["resize", str(resizable), "--devices", "1", "--steps", "12", "--dry-run"])
    assert result.exit_code == 2 and "wrote no checkpoint" in result.output, result.output
    run = make_run(tmp_path, steps_done=3)
    result = runner.invoke(app, ["status", str(run / "plan.json"), "--follow"])
    assert result.exit_code == 2 and "is a plan" in result.output and "waiting for" not in result.output, result.output


def test_an_output_ending_in_a_slash_is_a_folder_to_write_into(tmp_path):
    """`-o plans/` wrote a file named `plans` (the path lost its slash): it is the folder, and the
    command's file is written in it under its usual name; where that name depends on the input
    (calibrate), a folder is refused."""
    from cli_process import pipectl

    assert pipectl("profile", "gpt-tiny", "--derive", "--device", "a100-80gb", "-o", "out/", cwd=tmp_path).returncode == 0
    assert (tmp_path / "out" / "profile.json").is_file()
    planned = pipectl("plan", "--profile", "out/profile.json", "--cluster", "a100-8x8", "--global-batch", "64",
                      "--no-morph", "-o", "plans/", cwd=tmp_path)  # fmt: skip
    assert planned.returncode == 0 and "wrote plans/plan.json" in planned.stdout, planned.stderr
    assert (tmp_path / "plans" / "plan.json").is_file()
    refused = pipectl("calibrate", "runs.csv", "-c", "conditions.yaml", "-o", "cal/", cwd=tmp_path)
    assert refused.returncode == 2 and "-o 'cal/': names a folder; give the path of the file to write" in refused.stderr
    assert not (tmp_path / "cal").exists()


def test_an_output_that_is_a_pipectl_file_of_another_kind_is_not_replaced(tmp_path):
    """`profile links -o profile.json` replaced a measured profile (minutes of measuring) with links,
    without a word; a file of the kind the command writes is still replaced, as a command run again."""
    from cli_process import pipectl

    assert pipectl("profile", "gpt-tiny", "--derive", "--device", "a100-80gb", "-o", "profile.json", cwd=tmp_path).returncode == 0
    assert pipectl("profile", "gpt-tiny", "--derive", "--device", "a100-80gb", "-o", "other.json", cwd=tmp_path).returncode == 0
    kept = (tmp_path / "profile.json").read_bytes()
    for args, writes in [
        (["profile", "links", "-o", "profile.json"], "a links calibration (pipectl profile links)"),
        (["plan", "--profile", "other.json", "--cluster", "a100-8x8", "--global-batch", "64", "-o", "profile.json"],
         "a plan (pipectl plan)"),
    ]:
        done = pipectl(*args, cwd=tmp_path)
        assert done.returncode == 2, done.stdout + done.stderr
        assert f"-o profile.json is a profile (pipectl profile), and this writes {writes}" in done.stderr, done.stderr
        assert (tmp_path / "profile.json").read_bytes() == kept
    again = pipectl("profile", "gpt-tiny", "--derive", "--device", "h100-80gb", "-o", "profile.json", cwd=tmp_path)
    assert again.returncode == 0 and (tmp_path / "profile.json").read_bytes() != kept, again.stderr

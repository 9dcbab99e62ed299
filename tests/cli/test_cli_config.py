"""`--config FILE`: one file of sections that `plan` and `launch` read, flags over it, refusals that
name the file, section and key; `launch --print-config` writes the effective options back."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from builders import write_plan
from pipectl.testing.profiles import synthetic_profile
from pipectl.cli.main import app
from pipectl.config import option_fields
from pipectl.io import write_json_atomic
from pipectl.launch.options import LaunchOptions
from pipectl.plan.options import PlanOptions


runner = CliRunner()


def invoke(*args: object):
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})


def dry_job(plan: Path, run: Path, *args: object) -> dict:
    result = invoke("launch", plan, "--run-dir", run, "--dry-run", "--json", *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)["job"]


def same_job(a: dict, b: dict) -> None:
    """Two dry runs' jobs, but for what each launch picks anew (a free port, the host's load)."""
    drop = ("master_port", "host_at_launch")
    assert {k: v for k, v in a.items() if k not in drop} == {k: v for k, v in b.items() if k not in drop}


def test_a_config_file_sets_options_flags_win_and_the_printed_config_reads_back_the_same(tmp_path):
    plan = write_plan(tmp_path / "plan.json")
    config = tmp_path / "job.toml"
    config.write_text('[training]\nsteps = 8\nlr = 0.002\nlr_schedule = "warmup-cosine"\n'
                      '[checkpoint]\nevery = "15m"\nkeep = 2\n[slurm]\nqos = "high"\n')  # fmt: skip
    from_file = dry_job(plan, tmp_path / "run", "--config", config)
    assert from_file["steps"] == 8 and from_file["training"]["learning_rate"] == 0.002
    assert from_file["checkpoint_every_seconds"] == 900.0 and from_file["keep_checkpoints"] == 2
    assert from_file["options"]["slurm"] == {"qos": "high"}
    assert dry_job(plan, tmp_path / "run", "--config", config, "--steps", "5")["steps"] == 5  # the flag wins
    (tmp_path / "qos.toml").write_text('[slurm]\nqos = "high"\n')
    by_flags = dry_job(plan, tmp_path / "run", "--steps", "8", "--lr", "0.002", "--lr-schedule", "warmup-cosine",
                       "--checkpoint-every", "15m", "--keep-checkpoints", "2", "--config", tmp_path / "qos.toml")
    same_job(from_file, by_flags)

    printed = invoke("launch", plan, "--run-dir", tmp_path / "run", "--config", config, "--print-config")
    assert printed.exit_code == 0, printed.output
    assert tomllib.loads(printed.output)["training"]["lr"] == 0.002
    assert "# AdamW (peak) learning rate (default 0.001).\nlr = 0.002" in printed.output  # each key under its help text
    (tmp_path / "printed.toml").write_text(printed.output)
    same_job(from_file, dry_job(plan, tmp_path / "run", "--config", tmp_path / "printed.toml"))


def test_a_yaml_config_and_paths_relative_to_the_file(tmp_path, monkeypatch):
    plan = write_plan(tmp_path / "plan.json")
    (tmp_path / "conf").mkdir()
    (tmp_path / "corpus.txt").write_text("hello pipectl " * 400)
    (tmp_path / "conf" / "job.yaml").write_text("data:\n  source: ../corpus.txt\ntraining:\n  seed: 7\n")
    monkeypatch.chdir(tmp_path / "conf")  # the path is the file's, wherever the command runs
    job = dry_job(plan, tmp_path / "run", "--config", tmp_path / "conf" / "job.yaml")
    assert job["data"]["path"] == str(tmp_path / "corpus.txt") and job["seed"] == 7


def test_a_home_folder_path_in_a_config_file_is_the_users_home(tmp_path, monkeypatch):
    """`source = "~/corpus.txt"`, as on the command line; it used to be taken as a folder named '~'
    beside the file."""
    plan = write_plan(tmp_path / "plan.json")
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "corpus.txt").write_text("hello pipectl " * 400)
    (tmp_path / "job.toml").write_text('[data]\nsource = "~/corpus.txt"\n')
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert dry_job(plan, tmp_path / "run", "--config", "job.toml")["data"]["path"] == str(tmp_path / "home" / "corpus.txt")
    (tmp_path / "job.toml").write_text('[data]\nsource = "~nosuchuser-pipectl/corpus.txt"\n')  # no such user: a path
    result = invoke("launch", plan, "--run-dir", "run", "--dry-run", "--config", "job.toml")
    assert result.exit_code == 2 and "Traceback" not in result.output and "nosuchuser-pipectl" in result.output, result.output


def test_a_path_missing_beside_the_file_is_not_taken_from_where_the_command_runs(tmp_path, monkeypatch):
    """A file of the same name in the current directory used to be taken silently in its place."""
    plan = write_plan(tmp_path / "plan.json")
    (tmp_path / "conf").mkdir()
    (tmp_path / "corpus.txt").write_text("hello pipectl " * 400)  # here, not beside the file
    (tmp_path / "overlay.json").write_text('{"wall_clock_breakdown": false}')
    monkeypatch.chdir(tmp_path)
    for text, key, value, looked in [
        ('[data]\nsource = "corpus.txt"\n', "[data] source", "corpus.txt", "corpus.txt"),
        ('[deepspeed]\noverlay = "overlay.json"\n', "[deepspeed] overlay", "overlay.json", "overlay.json"),
        ('[model]\nreference = "sub/mine.yaml"\n', "[model] reference", "sub/mine.yaml", "sub/mine.yaml"),
    ]:
        (tmp_path / "conf" / "job.toml").write_text(text)
        result = invoke("launch", plan, "--run-dir", "run", "--dry-run", "--config", "conf/job.toml")
        message = f"conf/job.toml {key} = '{value}': no such file (looked for {tmp_path / 'conf' / looked})"
        assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output
    # Names that are no paths stay names: a shipped model, a dataset function.
    (tmp_path / "conf" / "job.toml").write_text('[model]\nreference = "gpt-tiny"\n[data]\nsource = "synthetic"\n')
    assert dry_job(plan, tmp_path / "run", "--config", "conf/job.toml")["model"] == "gpt-tiny"


@pytest.mark.parametrize(
    "text, message",
    [
        ("[trainig]\nsteps = 3\n", "unknown section [trainig] hint: did you mean [training]?"),
        ("[training]\nstep = 3\n", "[training] has no key 'step' hint: did you mean 'steps'?"),
        ("[plan]\nzzz = 3\n", "[plan] has no key 'zzz' hint: [plan] keys:"),
        ("[training]\nsteps = \n", "is not valid TOML"),
        ("[training]\nlr = 20\n", "[training] lr = 20: Input should be less than or equal to 10"),
        ("[checkpoint]\nevery = \"soon\"\n", "[checkpoint] every = 'soon': not a step count"),
        ("[slurm]\ntime = \"banana\"\n", "[slurm] time = 'banana': 'banana' is not a Slurm time"),
        ("steps = 3\n", "steps = 3 is outside any section"),
        ("training = 3\n", "section training holds 3, not keys"),
        # '' was no value (a path's '' was '.', "is a directory"), as on the command line.
        ('[data]\nsource = ""\n', "[data] source = '': empty; give a value, or leave the key out"),
        ('[cluster]\nhosts = ["n1", ""]\n', "[cluster] hosts = '': empty"),
        ("[data]\nsource = {}\n", "[data] source = {}: the data is named by a string"),  # it read as builtin
    ],
)
def test_a_bad_config_file_is_refused_naming_the_file_section_and_key(tmp_path, text, message):
    plan = write_plan(tmp_path / "plan.json")
    config = tmp_path / "job.toml"
    config.write_text(text)
    result = invoke("launch", plan, "--run-dir", tmp_path / "run", "--config", config, "--dry-run")
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert message in " ".join(result.output.split()) and "job.toml" in result.output, result.output
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "text, flags, message",
    [
        ("[training]\nsteps = 2\n[checkpoint]\nevery = 4\n", [],
         "job.toml [checkpoint] every = 4 exceeds job.toml [training] steps = 2"),
        ("[checkpoint]\nevery = 4\n", ["--steps", "3"], "job.toml [checkpoint] every = 4 exceeds --steps 3"),
        ("[training]\nsteps = 3\n", ["--checkpoint-every", "4"], "--checkpoint-every 4 exceeds job.toml [training] steps = 3"),
        ("[checkpoint]\nrecover_in_memory = true\n", [], "job.toml [checkpoint] recover_in_memory = true needs data-parallel"),
        # Only `auto` reads the failure rate: given beside another interval it would change nothing.
        ("[checkpoint]\nmtbf_hours = 5\n", ["--checkpoint-every", "2"],
         "job.toml [checkpoint] mtbf_hours = 5 chooses the interval of --checkpoint-every auto, but the interval is "
         "--checkpoint-every 2"),
        ("", ["--mtbf-hours", "5"], "but the interval is --checkpoint-every 0 (the default here)"),
    ],
)
def test_a_check_of_two_values_names_each_as_it_was_given(tmp_path, text, flags, message):
    """A value refused beside another (after both were read) is named where it came from: the file
    and its key, or the flag; a new user who wrote only a config file is not told of flags."""
    plan = write_plan(tmp_path / "plan.json")
    (tmp_path / "job.toml").write_text(text)
    result = invoke("launch", plan, "--run-dir", tmp_path / "run", "--config", tmp_path / "job.toml", *flags, "--dry-run")
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert message in " ".join(result.output.replace(str(tmp_path) + "/", "").split()), result.output
    assert not (tmp_path / "run").exists()


def test_a_warm_up_longer_than_the_run_is_noted_not_refused(tmp_path):
    """A first launch may be short and resumed with more steps (the warm-up counts from step 0)."""
    plan = write_plan(tmp_path / "plan.json")
    result = invoke("launch", plan, "--run-dir", tmp_path / "run", "--steps", "4", "--warmup-steps", "50", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "note: the warm-up (50 steps) outlasts the 4 steps to train" in " ".join(result.output.split())
    result = invoke("launch", plan, "--run-dir", tmp_path / "run", "--steps", "4", "--warmup-steps", "3", "--dry-run")
    assert result.exit_code == 0 and "outlasts" not in result.output, result.output


def test_a_cluster_without_the_plans_devices_is_refused_not_recorded(tmp_path):
    """launch --cluster used to record a GPU cluster's name for a CPU plan and run it locally anyway."""
    plan = write_plan(tmp_path / "plan.json")
    result = invoke("launch", plan, "--run-dir", tmp_path / "run", "--cluster", "a100-8x8", "--dry-run")
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "--cluster a100-8x8: cluster 'a100-8x8' has no cpu devices, which the plan runs on" in " ".join(
        result.output.split()), result.output
    assert dry_job(plan, tmp_path / "run", "--cluster", "local")["engine"] == "local"


def test_a_cluster_too_small_for_the_plan_is_refused_not_written(tmp_path, monkeypatch):
    """A plan for 128 A100s launched with --cluster a100-8x8 (64) wrote a Slurm script for 16 nodes."""
    monkeypatch.chdir(tmp_path)
    assert invoke("profile", "gpt-tiny", "--derive", "--device", "a100-80gb", "-o", "p.json").exit_code == 0
    planned = invoke("plan", "--profile", "p.json", "--cluster", "a100-384x8", "--devices", "128", "--global-batch", "256",
                     "--no-morph", "-o", "plan.json")  # fmt: skip
    assert planned.exit_code == 0, planned.output
    result = invoke("launch", "plan.json", "--run-dir", "run", "--engine", "slurm", "--steps", "10", "--cluster",
                    "a100-8x8", "--dry-run")  # fmt: skip
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "--cluster a100-8x8: cluster 'a100-8x8' has 64 a100-80gb devices, and the plan runs on 128" in " ".join(
        result.output.split()), result.output
    assert not (tmp_path / "run").exists()


def test_a_refused_path_flag_is_named_as_typed(tmp_path, monkeypatch):
    plan = write_plan(tmp_path / "plan.json")
    monkeypatch.chdir(tmp_path)
    result = invoke("launch", plan, "--run-dir", "run", "--ds-config-overlay", "nope.json", "--dry-run")
    assert result.exit_code == 2 and "--ds-config-overlay 'nope.json': file not found" in result.output, result.output


def test_plan_reads_its_sections_of_the_same_file(tmp_path):
    write_json_atomic(tmp_path / "profile.json", synthetic_profile(blocks=6, micro_batch_sizes=[1, 2, 4], device="cpu"))
    config = tmp_path / "job.toml"
    config.write_text('[model]\nprofile = "profile.json"\n[cluster]\nname = "local"\ndevices = 2\n'
                      '[training]\nglobal_batch = 16\nsteps = 4\n[plan]\npipeline_parallel = 2\nschedules = ["1f1b"]\n'
                      'morph = false\n')  # fmt: skip
    result = invoke("plan", "--config", config, "-o", tmp_path / "plan.json", "--json")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["request"]["global_batch"] == 16 and plan["chosen"]["pipeline_parallel"] == 2
    assert plan["chosen"]["schedule"] == "1f1b" and plan["morph_table"] == []
    missing = invoke("plan", "--profile", tmp_path / "profile.json", "--cluster", "local")
    assert missing.exit_code == 2 and "missing --global-batch (or [training] global_batch" in missing.output


@pytest.mark.parametrize(
    "text",
    ["[plan]\npipeline_parallel = 0", "[cluster]\ndevices = -1", "[training]\nglobal_batch = 0",
     "[plan]\nmicro_batch_size = 0", "[plan]\ndeadline_hours = 0"],
)
def test_a_plan_value_out_of_range_is_named_where_the_file_set_it(tmp_path, text):
    """Not as a flag the user never typed (`--pipeline-parallel 0`), nor without a name at all."""
    write_json_atomic(tmp_path / "profile.json", synthetic_profile(blocks=6, micro_batch_sizes=[1, 2], device="cpu"))
    (tmp_path / "job.toml").write_text(text + "\n")
    flags = [] if "global_batch" in text else ["--global-batch", "16"]
    result = invoke("plan", "--profile", tmp_path / "profile.json", "--cluster", "local", *flags,
                    "--config", tmp_path / "job.toml", "-o", tmp_path / "plan.json")  # fmt: skip
    section, assignment = text.split("\n")
    assert result.exit_code == 2 and f"job.toml {section} {assignment}: Input should be greater than 0" in result.output, \
        result.output  # fmt: skip
    assert not (tmp_path / "plan.json").exists()


def test_a_config_naming_no_profile_is_refused_in_one_line(tmp_path):
    """`[model] profile = []` crashed the plan's check of its profiles with a traceback."""
    (tmp_path / "job.toml").write_text('[model]\nprofile = []\n[cluster]\nname = "local"\n[training]\nglobal_batch = 16\n')
    result = invoke("plan", "--config", tmp_path / "job.toml", "-o", tmp_path / "plan.json")
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "job.toml [model] profile = []: is empty: name at least one" in result.output, result.output


def test_the_printed_config_re_plans_the_same_plan_and_launch_keeps_its_global_batch(tmp_path, monkeypatch):
    """`launch --print-config` (no run directory needed) writes the plan's own keys too: `plan
    --config` from another folder makes the same request and the same choice; a file whose global
    batch is not the plan's is refused by launch, nothing written."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    write_json_atomic(tmp_path / "a" / "profile.json", synthetic_profile(blocks=6, micro_batch_sizes=[1, 2, 4], device="cpu"))
    monkeypatch.chdir(tmp_path / "a")
    made = invoke("plan", "--profile", "profile.json", "--cluster", "local", "--devices", "2", "--global-batch", "16",
                  "--schedules", "1f1b,gpipe", "--zero-stages", "0,1", "--recompute", "layer", "--micro-batch-size", "2",
                  "--morph-counts", "1-2", "-o", "plan.json")  # fmt: skip
    assert made.exit_code == 0, made.output
    printed = invoke("launch", "plan.json", "--print-config")
    assert printed.exit_code == 0, printed.output
    monkeypatch.chdir(tmp_path / "b")
    (tmp_path / "b" / "job.toml").write_text(printed.output)
    again = invoke("plan", "--config", "job.toml", "-o", "plan.json")
    assert again.exit_code == 0, again.output
    first, second = (json.loads((tmp_path / d / "plan.json").read_text()) for d in ("a", "b"))
    assert second["request"] == first["request"] and second["chosen"] == first["chosen"]

    (tmp_path / "b" / "other.toml").write_text(printed.output.replace("global_batch = 16", "global_batch = 32"))
    refused = invoke("launch", tmp_path / "a" / "plan.json", "--run-dir", "run", "--config", "other.toml")
    assert refused.exit_code == 2 and "Traceback" not in refused.output, refused.output
    assert "other.toml [training] global_batch = 32" in refused.output and "global batch of 16" in refused.output
    assert not (tmp_path / "b" / "run").exists()
    # The plan's own keys, from another folder: nothing differs, and the launch goes on to the model
    # (this synthetic profile's, which no launch builds).
    past_the_file = "model 'synthetic' is neither a file nor a shipped name"
    same = invoke("launch", tmp_path / "a" / "plan.json", "--run-dir", "run", "--config", "job.toml", "--dry-run")
    assert past_the_file in same.output, same.output

    # A launch runs the plan it is given: a file asking for another layout is refused, not ignored.
    (tmp_path / "b" / "mine.toml").write_text('[plan]\npipeline_parallel = 1\nschedules = ["gpipe"]\n'
                                              '[training]\nsteps = 2\n')  # fmt: skip
    refused = invoke("launch", tmp_path / "a" / "plan.json", "--run-dir", "run", "--config", "mine.toml")
    assert refused.exit_code == 2 and "Traceback" not in refused.output, refused.output
    shown = " ".join(refused.output.split())
    assert 'mine.toml [plan] schedules = ["gpipe"], but' in shown, shown
    assert 'was planned with "1f1b,gpipe" (and 1 other key)' in shown, shown
    (tmp_path / "b" / "mine.toml").write_text('[plan]\nschedules = ["1f1b", "gpipe"]\nzero_stages = [0, 1]\n'
                                              '[cluster]\ndevices = 2\n')  # fmt: skip
    same = invoke("launch", tmp_path / "a" / "plan.json", "--run-dir", "run", "--config", "mine.toml", "--dry-run")
    assert past_the_file in same.output, same.output  # the plan's values, written as lists


@pytest.mark.parametrize("model, command", [(LaunchOptions, "launch"), (PlanOptions, "plan")])
def test_every_option_is_one_flag_whose_help_is_the_fields_description(model, command):
    """The options model is the only declaration: each field's flag is in the help, with the
    field's own description as its text."""
    shown = " ".join(invoke(command, "-h").output.replace("│", " ").split())
    for field in option_fields(model):
        flags = [flag for _, flag in field.flags] if field.submodel else [field.flag]
        for flag in flags:
            assert f" {flag} " in shown or f" {flag}/" in shown, flag
        if not field.submodel:
            assert " ".join(field.description.split()[:6]) in shown, field.name


def test_a_config_files_other_global_batch_is_refused_with_a_re_plan_command_that_runs(tmp_path):
    """The refusal's hint is a command a user can paste: a file with only [training] global_batch
    re-plans with the plan's profile copy, cluster and device count, into a new file beside the plan
    and the plan's search options (it used to say `pipectl plan --config FILE -o plan.json`: no profile
    or cluster, and the user's plan overwritten). The new plan then takes the file."""
    import re
    import shlex

    from cli_process import pipectl, said

    write_json_atomic(tmp_path / "profile.json", synthetic_profile(blocks=6, micro_batch_sizes=[1, 2, 4], device="cpu"))
    made = pipectl("plan", "--profile", "profile.json", "--cluster", "local", "--devices", "2", "--global-batch", "16",
                   "--pipeline-parallel", "2", "--schedules", "1f1b,gpipe", "--zero-stages", "1", "--even-replicas",
                   "-o", "plan.json", cwd=tmp_path)
    assert made.returncode == 0, said(made)
    before = (tmp_path / "plan.json").read_bytes()
    (tmp_path / "job.toml").write_text("[training]\nglobal_batch = 32\n")
    refused = pipectl("launch", "plan.json", "--run-dir", "run", "--config", "job.toml", cwd=tmp_path, columns=400)
    assert refused.returncode == 2 and not (tmp_path / "run").exists(), said(refused)
    command = re.search(r"re-plan with the file \((pipectl plan .*?)\), then launch", refused.stderr).group(1)
    assert command.endswith("-o plan-replanned.json"), command
    replanned = pipectl(*shlex.split(command)[1:], cwd=tmp_path)
    assert replanned.returncode == 0, said(replanned)
    request = json.loads((tmp_path / "plan-replanned.json").read_text())["request"]
    planned = json.loads(before)["request"]
    assert request == {**planned, "global_batch": 32}  # the search that made the plan, with the file's batch
    assert (tmp_path / "plan.json").read_bytes() == before
    taken = pipectl("launch", "plan-replanned.json", "--run-dir", "run", "--config", "job.toml", "--dry-run", cwd=tmp_path)
    assert "model 'synthetic' is neither a file nor a shipped name" in taken.stderr, said(taken)


def test_a_config_file_is_never_replaced_nor_mistaken_and_its_missing_paths_name_the_key(tmp_path):
    """From a working directory, as a user types it: `-o` naming the config file is refused (it was
    replaced by plan.json); another kind of file as the config is named as what it is (not its first
    key 'outside any section'); a relative path in the file that names nothing there names the key."""
    from cli_process import pipectl

    write_json_atomic(tmp_path / "profile.json", synthetic_profile(blocks=2, micro_batch_sizes=[1, 2], device="cpu"))
    config = '[model]\nprofile = "profile.json"\n[cluster]\nname = "local"\ndevices = 2\n[training]\nglobal_batch = 8\n'
    (tmp_path / "job.toml").write_text(config)
    replaced = pipectl("plan", "--config", "job.toml", "-o", "job.toml", cwd=tmp_path)
    assert replaced.returncode == 2, replaced.stdout + replaced.stderr
    assert "-o job.toml is the --config file this command reads" in replaced.stderr
    assert (tmp_path / "job.toml").read_text() == config

    mistaken = pipectl("plan", "--config", "profile.json", cwd=tmp_path)
    assert mistaken.returncode == 2 and "profile.json is a profile (pipectl profile), not a config file" in mistaken.stderr
    # A config whose key slipped above its section is still one (`devices` also tells a device catalog).
    (tmp_path / "top.toml").write_text("devices = 4\n[training]\nglobal_batch = 8\n")
    slipped = pipectl("plan", "--config", "top.toml", cwd=tmp_path)
    assert slipped.returncode == 2 and "top.toml: devices = 4 is outside any section" in slipped.stderr, slipped.stderr
    # A bare name stays a name even where the working directory holds a folder of that name.
    (tmp_path / "local").mkdir()
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "named.toml").write_text(config.replace('"profile.json"', '"../profile.json"'))
    named = pipectl("plan", "--config", "conf/named.toml", "-o", "named.json", cwd=tmp_path)
    assert "no such file" not in named.stderr, named.stderr

    (tmp_path / "conf" / "job.toml").write_text(config.replace('"profile.json"', '"../nosuch.json"'))
    missing = pipectl("plan", "--config", "conf/job.toml", "-o", "plan.json", cwd=tmp_path)
    said = " ".join(missing.stderr.split())
    assert missing.returncode == 2 and "Traceback" not in said, said
    assert f"conf/job.toml [model] profile = '../nosuch.json': no such file (looked for {tmp_path / 'nosuch.json'})" in said
    assert not (tmp_path / "plan.json").exists()


def test_a_printed_config_saved_as_yaml_is_said_to_be_toml(tmp_path):
    """`launch --print-config > job.yaml` writes TOML under a YAML name: read back, the YAML error
    alone left the user guessing."""
    from cli_process import pipectl

    write_plan(tmp_path / "plan.json")
    printed = pipectl("launch", "plan.json", "--print-config", cwd=tmp_path)
    assert printed.returncode == 0, printed.stderr
    (tmp_path / "job.yaml").write_text(printed.stdout)
    read = pipectl("plan", "--config", "job.yaml", cwd=tmp_path)
    assert read.returncode == 2 and "job.yaml is not valid YAML" in read.stderr, read.stderr
    assert "hint: it reads as TOML (what launch --print-config writes): name it job.toml" in read.stderr


def test_every_path_key_a_printed_config_names_is_checked_for_being_gone(tmp_path):
    """`launch --print-config` warned of three hard-coded keys; every key that may name a file does
    now, each with the command that will read it (a model reference or `synthetic` is no file)."""
    from pipectl.config import files_gone

    there = tmp_path / "there.csv"
    there.write_text("x\n")
    sections = {
        "model": {"profile": [str(tmp_path / "gone-profile.json")], "reference": "mypkg.models:build"},
        "cluster": {"name": "a100-8x8", "calibration": str(there), "hostfile": str(tmp_path / "gone-hosts")},
        "data": {"source": str(tmp_path / "gone-data.bin")},
        "deepspeed": {"overlay": str(tmp_path / "gone-overlay.json")},
    }
    gone = {text: model for text, model in files_gone(sections, [PlanOptions, LaunchOptions])}
    assert gone == {
        f"[model] profile {tmp_path / 'gone-profile.json'}": PlanOptions,
        f"[cluster] hostfile {tmp_path / 'gone-hosts'}": LaunchOptions,
        f"[data] source {tmp_path / 'gone-data.bin'}": LaunchOptions,
        f"[deepspeed] overlay {tmp_path / 'gone-overlay.json'}": LaunchOptions,
    }, gone


def test_a_printed_config_shows_the_cluster_files_slurm_values_it_takes(tmp_path, monkeypatch):
    """The cluster file's `slurm:` values (and a node type's partition over them) were printed as
    `# partition =`, as if unset, though the job script takes them: each now shows its value and
    where it comes from, commented, and a key given to launch is written as set."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cl.yaml").write_text(
        "name: mycl\nnode_types:\n  - name: cpu-nodes\n    device: cpu\n    devices_per_node: 2\n    nodes: 2\n"
        "    slurm:\n      partition: cpu-part\nslurm:\n  partition: gpu\n  account: proj1\n  time: '12:00:00'\n")
    write_json_atomic(tmp_path / "profile.json", synthetic_profile(blocks=6, micro_batch_sizes=[1, 2], device="cpu"))
    made = invoke("plan", "--profile", "profile.json", "--cluster", "cl.yaml", "--devices", "2", "--global-batch", "8",
                  "-o", "plan.json")  # fmt: skip
    assert made.exit_code == 0, made.output
    printed = invoke("launch", "plan.json", "--engine", "slurm", "--account", "mine", "--print-config")
    assert printed.exit_code == 0, printed.output
    slurm = printed.output.split("[slurm]\n")[1].split("\n[")[0]
    assert "# partition = \"cpu-part\"  (cluster mycl's; set here to override)" in slurm, slurm
    assert "# time = \"12:00:00\"  (cluster mycl's; set here to override)" in slurm, slurm
    assert "\naccount = \"mine\"" in slurm and "proj1" not in slurm, slurm
    assert "# qos =\n" in slurm, slurm
    assert tomllib.loads(printed.output)["slurm"] == {"account": "mine"}


def test_a_shipped_name_stays_a_name_beside_a_folder_of_that_name(tmp_path):
    """`[cluster] name = "local"` where the working directory (the config's folder) holds a folder
    `local/` (a run directory, say) names the shipped cluster: only a file of that name is a path."""
    from cli_process import pipectl

    write_json_atomic(tmp_path / "profile.json", synthetic_profile(blocks=2, micro_batch_sizes=[1, 2], device="cpu"))
    (tmp_path / "local").mkdir()
    (tmp_path / "job.toml").write_text(
        '[model]\nprofile = "profile.json"\n[cluster]\nname = "local"\ndevices = 2\n[training]\nglobal_batch = 8\n'
    )
    planned = pipectl("plan", "--config", "job.toml", "-o", "plan.json", cwd=tmp_path)
    assert planned.returncode == 0, planned.stdout + planned.stderr
    assert json.loads((tmp_path / "plan.json").read_text())["cluster"] == "local"

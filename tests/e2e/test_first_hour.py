"""A new user's first hour, as they live it: the `pipectl` command run as a subprocess from a
temporary working directory, with their own model and data given by relative paths, then the run
continued (`resize`, `launch --resume`, `status`) from another directory.

The quick start is parsed from README.md, so the README cannot drift from what runs.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from cli_process import pipectl, said, succeeded

REPO = Path(__file__).resolve().parents[2]
def quick_start() -> list[list[str]]:
    """The `$ ` lines of the README's quick-start console block, split as a shell would."""
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Quick start", 1)[1].split("\n## ", 1)[0]
    block = section.split("```console", 1)[1].split("```", 1)[0]
    return [shlex.split(line[2:], comments=True) for line in block.splitlines() if line.startswith("$ ")]


def run_quick_start(folder: Path) -> list[subprocess.CompletedProcess]:
    """Each quick-start command in `folder`: `cp ../configs/...` copies from the checkout (the
    README is read from a checkout's root), `pipectl ...` runs the CLI."""
    results = []
    for argv in quick_start():
        if argv[0] == "cp":
            source, target = argv[1], argv[2]
            shutil.copy(REPO / source.removeprefix("../"), folder / target)
            continue
        assert argv[0] == "pipectl", f"the quick start runs cp and pipectl only, not {argv[0]}"
        done = pipectl(*argv[1:], cwd=folder)
        assert succeeded(done), f"$ {shlex.join(argv)}\n{said(done)}"
        results.append(done)
    return results


@pytest.mark.multiprocess
def test_the_readme_quick_start_trains_resizes_and_resumes_from_anywhere(tmp_path, monkeypatch):
    """The README's commands, typed in an empty directory with the model as `mine.yaml` by a
    relative path: they train, resize and report; then the run is resumed and inspected from
    another directory. (A relative model YAML used to be stored as given and every rank, which
    starts in the run directory, failed to find it.) No launch leaves a folder of its own in the
    temporary folder (torchrun's default log folder used to be, at each launch)."""
    work, elsewhere, temporary = tmp_path / "work", tmp_path / "elsewhere", tmp_path / "tmp"
    for folder in (work, elsewhere, temporary):
        folder.mkdir()
    monkeypatch.setenv("TMPDIR", str(temporary))
    commands = quick_start()
    assert [argv[:2] for argv in commands if argv[0] == "pipectl"] == [
        ["pipectl", c] for c in ("profile", "plan", "simulate", "launch", "resize", "status")
    ]
    outputs = run_quick_start(work)
    # Piped, as here, no line ends in the blanks that pad a table to its width (grep and diff see them).
    padded = [line for done in outputs for line in (done.stdout + done.stderr).splitlines() if line != line.rstrip()]
    assert not padded, padded[:3]
    run = work / "runs" / "mine"
    job = json.loads((run / "job.json").read_text())
    assert job["model"] == str(work / "mine.yaml") and job["import_root"] == str(work)
    # The resized run's own plan re-plans what it now runs: 1 device, the p = 2 pin let go.
    printed = pipectl("launch", "runs/mine/plan.json", "--run-dir", "runs/mine", "--resume", "--print-config", cwd=work)
    assert succeeded(printed), said(printed)
    sections = tomllib.loads(printed.stdout)
    assert sections["cluster"]["devices"] == 1 and "pipeline_parallel" not in sections["plan"], printed.stdout

    trained = json.loads(pipectl("status", run, "--json", cwd=elsewhere).stdout)["steps_done"]
    resumed = pipectl("launch", work / "plan.json", "--run-dir", "../work/runs/mine", "--resume",
                      "--steps", trained + 2, cwd=elsewhere)  # fmt: skip
    assert succeeded(resumed), said(resumed)
    status = pipectl("status", "../work/runs/mine", "--json", cwd=elsewhere)
    assert succeeded(status), said(status)
    assert json.loads(status.stdout)["steps_done"] == trained + 2
    # The run's launch.sh typed again: it says the run has finished and trains nothing (its ranks
    # used to start, load the last checkpoint and exit 0 without a word).
    metrics = (run / "metrics.jsonl").read_bytes()
    again = subprocess.run(["bash", "../work/runs/mine/launch.sh"], cwd=elsewhere, capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 0, again.stderr
    assert f"has trained all its {trained + 2} steps: nothing is left to train" in again.stderr, again.stderr
    assert again.stderr.count("nothing is left to train") == 1 and (run / "metrics.jsonl").read_bytes() == metrics
    assert not list(temporary.glob("torchelastic_*"))  # caches (torchinductor_USER) are shared, not left per launch


@pytest.mark.multiprocess
def test_one_config_file_drives_plan_and_launch_and_a_resume_keeps_its_options(tmp_path):
    """`job.toml` in a sub-folder names the model and profile relative to itself; `plan` and
    `launch` read it from the working directory; `--print-config` fed back gives the same job;
    a resume from another directory keeps the file's options it does not name again."""
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    (work / "conf").mkdir(parents=True)
    elsewhere.mkdir()
    shutil.copy(REPO / "configs/models/gpt-tiny.yaml", work / "mine.yaml")
    profiled = pipectl("profile", "mine.yaml", "-o", "profile.json", cwd=work)
    assert succeeded(profiled), said(profiled)
    assert "" not in profiled.stderr.splitlines(), profiled.stderr  # piped: no bar, nor the blank line it left
    (work / "conf" / "job.toml").write_text(
        '[model]\nreference = "../mine.yaml"\nprofile = "../profile.json"\n'
        '[cluster]\nname = "local"\ndevices = 2\n'
        '[training]\nglobal_batch = 8\nsteps = 4\nlr = 0.002\nlr_schedule = "warmup-decay"\nwarmup_steps = 2\n'
        '[checkpoint]\nevery = 2\nkeep = 2\n[plan]\npipeline_parallel = 2\nmorph = false\n'
    )  # fmt: skip
    planned = pipectl("plan", "--config", "conf/job.toml", "-o", "plan.json", cwd=work)
    assert succeeded(planned), said(planned)

    printed = pipectl("launch", "plan.json", "--run-dir", "runs/c", "--config", "conf/job.toml", "--print-config", cwd=work)
    assert succeeded(printed), said(printed)
    (work / "printed.toml").write_text(printed.stdout)
    jobs = [
        json.loads(pipectl("launch", "plan.json", "--run-dir", "runs/c", "--config", config, "--dry-run", "--json",
                           cwd=work).stdout)["job"]
        for config in ("conf/job.toml", "printed.toml")
    ]  # fmt: skip
    for job in jobs:
        job.pop("master_port"), job.pop("host_at_launch")
    assert jobs[0] == jobs[1] and jobs[0]["model"] == str(work / "mine.yaml")

    launched = pipectl("launch", "plan.json", "--run-dir", "runs/c", "--config", "conf/job.toml", cwd=work)
    assert succeeded(launched), said(launched)
    resumed = pipectl("launch", "../work/plan.json", "--run-dir", "../work/runs/c", "--resume", "--steps", 6,
                      cwd=elsewhere)  # fmt: skip
    assert succeeded(resumed), said(resumed)
    job = json.loads((work / "runs/c/job.json").read_text())
    assert job["steps"] == 6 and job["options"]["training"]["steps"] == 6
    assert job["training"]["learning_rate"] == 0.002 and job["training"]["lr_schedule"] == "warmup-decay"
    assert job["checkpoint_every"] == 2 and job["keep_checkpoints"] == 2


FACTORY = '''
"""A user's model: an nn.Sequential factory, imported by every rank from the launch folder."""
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


def build():
    if "RANK" in os.environ and (Path(__file__).parent / "fail-in-ranks").exists():
        raise RuntimeError("planted failure in the user's factory")
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def make_batch(batch_size, generator):
    return torch.randn(batch_size, 16, generator=generator), torch.randint(0, 4, (batch_size,), generator=generator)


def loss_fn(output, labels):
    return F.cross_entropy(output, labels)
'''


@pytest.mark.multiprocess
def test_a_factory_model_resizes_from_another_directory_and_a_failed_resize_names_the_ranks_error(tmp_path):
    """`package.module:factory` is imported from the folder the run was launched from, whoever
    continues it and from wherever (resize used to hand the ranks its own directory: "No module
    named 'mymodels'"); and a resize whose ranks fail says what they raised, as launch does."""
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    (work / "mymodels.py").write_text(FACTORY)
    for argv in (
        ["profile", "mymodels:build", "-o", "profile.json", "-b", "2,4", "--warmup", "1", "--repeats", "1"],
        ["plan", "--profile", "profile.json", "--cluster", "local", "--devices", "2", "--pipeline-parallel", "2",
         "--global-batch", "8", "-o", "plan.json"],
        ["launch", "plan.json", "--run-dir", "runs/res", "--steps", "4", "--checkpoint-every", "2"],
    ):  # fmt: skip
        done = pipectl(*argv, cwd=work)
        assert succeeded(done), said(done)

    resized = pipectl("resize", "../work/runs/res", "--devices", "1", "--steps", "6", cwd=elsewhere)
    assert succeeded(resized), said(resized)
    assert json.loads((work / "runs/res/job.json").read_text())["import_root"] == str(work)

    (work / "fail-in-ranks").touch()
    failed = pipectl("resize", work / "runs/res", "--devices", "2", "--steps", "8", cwd=elsewhere)
    assert failed.returncode == 1, said(failed)
    assert "planted failure in the user's factory" in failed.stderr, said(failed)
    assert "Traceback" not in failed.stderr.split("error:", 1)[-1], said(failed)
    # The failed move is recorded as failed, and the next resize starts from what last trained.
    history = [json.loads(line) for line in (work / "runs/res/morphs.jsonl").read_text().splitlines()]
    assert history[-1]["failed_exit_code"] == 1 and history[-1]["downtime_seconds"] is None, history[-1]
    trained = history[0]["to_layout"]  # the first resize's layout trained steps 5-6
    (work / "fail-in-ranks").unlink()
    again = pipectl("resize", work / "runs/res", "--devices", "2", "--steps", "8", cwd=elsewhere)
    assert succeeded(again), said(again)
    assert f"1 device: {trained}" in again.stdout, said(again)  # the decision's "from" row
    history = [json.loads(line) for line in (work / "runs/res/morphs.jsonl").read_text().splitlines()]
    assert history[-2]["failed_exit_code"] == 1 and history[-2]["downtime_seconds"] is None, history[-2]
    assert history[-1]["from_layout"] == trained and history[-1]["failed_exit_code"] is None, history[-1]
    shown = pipectl("status", work / "runs/res", cwd=elsewhere)
    assert "exited with code 1 before its first step" in shown.stdout, said(shown)


def test_python_dash_m_h_and_the_commands_in_the_order_a_job_meets_them(tmp_path):
    done = pipectl("-h", cwd=tmp_path)
    module = subprocess.run(
        [sys.executable, "-m", "pipectl", "--help"], cwd=tmp_path, capture_output=True, text=True,
        env={**os.environ, "COLUMNS": "100"},
    )  # fmt: skip
    assert succeeded(done) and succeeded(module), said(done) + said(module)
    assert "Usage: python -m pipectl" in module.stdout
    for shown in (done.stdout, module.stdout):
        rows = [line.split()[1] for line in shown.splitlines() if line.startswith("│ ") and line[2] != " "]
        commands = [name for name in rows if not name.startswith("-")]
        assert commands[:8] == ["profile", "plan", "simulate", "launch", "status", "resize", "export", "calibrate"]
    assert "--install-completion" in done.stdout


@pytest.mark.parametrize("command", ["plan", "launch", "resize", "profile model", "simulate", "status"])
def test_help_names_values_plainly(tmp_path, command):
    """`--resume`, not `--resume <bool>`; `--profile PATH`, not `<list[Path]>`; `RUN_DIR`, not
    `run_dir <path>`."""
    done = pipectl(*command.split(), "-h", cwd=tmp_path)
    assert succeeded(done), said(done)
    for typed in ("<bool>", "<str>", "<path>", "<int", "<float", "list["):
        assert typed not in done.stdout, done.stdout


@pytest.mark.parametrize("columns", [80, 120])
def test_help_lists_the_flags_by_config_section_at_any_width(tmp_path, columns):
    """As docs/guide/config-files.md says: under a narrow terminal too (click's plain layout there,
    Rich's panels from 100 columns), each flag under the section a config file sets it in."""
    done = pipectl("launch", "-h", cwd=tmp_path, columns=columns)
    assert succeeded(done), said(done)
    headings = re.findall(r"^[╭─ ]*\[(\w+)\] options", done.stdout, flags=re.MULTILINE)
    assert {"model", "training", "checkpoint", "deepspeed"} <= set(headings), done.stdout
    training = done.stdout.index("[training] options")
    assert training < done.stdout.index("--steps") < done.stdout.index("[checkpoint] options"), done.stdout
    arguments = done.stdout.index("Arguments")  # PLAN.json under its own heading, before the options
    assert "PLAN.json" in done.stdout[arguments:done.stdout.index("--run-dir")], done.stdout


def test_gpt3_profile_and_plan_fit_a_screen(tmp_path):
    """GPT-3 175B on 3,072 A100s: `profile --derive` in at most 40 lines (its 96 identical blocks
    one row group), `plan` in at most 45 (the chosen layout first, at most 10 that can run, the
    morph table in ranges); every line within 100 columns when piped."""
    profiled = pipectl("profile", "gpt3-175b", "--derive", "--device", "a100-80gb", "-o", "gpt3.json", cwd=tmp_path)
    assert succeeded(profiled), said(profiled)
    profile_lines = (profiled.stdout + profiled.stderr).splitlines()
    assert len(profile_lines) <= 40, profiled.stdout
    assert any("block.0–95 ×96" in line for line in profile_lines)

    planned = pipectl("plan", "--profile", "gpt3.json", "--cluster", "a100-384x8", "--global-batch", "1536",
                      "-o", "gpt3.plan.json", cwd=tmp_path)  # fmt: skip
    assert succeeded(planned), said(planned)
    plan_lines = (planned.stdout + planned.stderr).splitlines()
    assert len(plan_lines) <= 45, planned.stdout
    assert plan_lines[0].startswith("chosen: ")
    table = plan_lines[plan_lines.index(next(line for line in plan_lines if line.startswith("t·p·d"))) + 2:]
    rows = [line for line in table[:12] if line[:1].isdigit()]
    assert 1 < len(rows) <= 10 and not any("*" in row for row in rows)  # only layouts DeepSpeed runs
    assert all(len(line.rstrip()) <= 100 for line in profile_lines + plan_lines)


def test_a_plan_names_its_morph_counts_and_a_run_name_too_long_leaves_nothing(tmp_path):
    """From a temporary folder with relative paths: `--morph-counts` adds counts to a multi-node
    table (a bad one named, exit 2); `launch` into a 300-character run name is refused, exit 2, with
    no `runs/` left behind."""
    assert succeeded(pipectl("profile", "gpt-tiny", "-o", "tiny.json", cwd=tmp_path))
    planned = pipectl("plan", "--profile", "tiny.json", "--cluster", "a100-8x8", "--global-batch", "32",
                      "--morph-counts", "13", "-o", "plan.json", cwd=tmp_path)  # fmt: skip
    assert succeeded(planned), said(planned)
    counts = [entry["devices"] for entry in json.loads((tmp_path / "plan.json").read_text())["morph_table"]]
    assert 13 in counts and 12 not in counts and 16 in counts
    bad = pipectl("plan", "--profile", "tiny.json", "--cluster", "a100-8x8", "--global-batch", "32",
                  "--morph-counts", "9-4", "-o", "other.json", cwd=tmp_path)  # fmt: skip
    assert bad.returncode == 2 and "--morph-counts '9-4'" in said(bad) and "Traceback" not in said(bad)
    local = pipectl("plan", "--profile", "tiny.json", "--cluster", "local", "--devices", "2", "--global-batch", "8",
                    "-o", "local.json", cwd=tmp_path)  # fmt: skip
    assert succeeded(local), said(local)
    refused = pipectl("launch", "local.json", "--run-dir", "runs/" + "r" * 300, "--steps", "2", cwd=tmp_path)
    assert refused.returncode == 2 and "the name is 300 bytes" in said(refused), said(refused)
    assert not (tmp_path / "runs").exists()


def test_a_misspelt_deepspeed_overlay_key_is_refused_before_anything_starts(tmp_path):
    """`pipectl launch plan.json --ds-config-overlay over.yaml` where the overlay misspells a key:
    DeepSpeed's parser would pass over 'optimiser' (training on with the defaults) and the ranks
    would fail on a misspelt AdamW argument; both are one line and exit 2, and no run is left."""
    from builders import write_plan

    write_plan(tmp_path / "plan.json")
    (tmp_path / "over.yaml").write_text("optimiser:\n  params:\n    betas: [0.9, 0.95]\n")
    done = pipectl("launch", "plan.json", "--run-dir", "runs/x", "--steps", "2", "--ds-config-overlay", "over.yaml",
                   cwd=tmp_path)  # fmt: skip
    assert done.returncode == 2 and "'optimiser'" in done.stderr and "did you mean 'optimizer'?" in done.stderr, said(done)
    assert done.stderr.count("error:") == 1 and "Traceback" not in done.stderr, said(done)
    (tmp_path / "over.yaml").write_text("optimizer:\n  params:\n    betaz: [0.9, 0.95]\n")
    done = pipectl("launch", "plan.json", "--run-dir", "runs/x", "--steps", "2", "--ds-config-overlay", "over.yaml",
                   cwd=tmp_path)  # fmt: skip
    assert done.returncode == 2 and "optimizer.params.betaz" in done.stderr and "'betas'" in done.stderr, said(done)
    assert not (tmp_path / "runs").exists()

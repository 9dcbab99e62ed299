"""The CLI's contract: `--help` for every registered command; a user's mistake is one message, exit 2.

Commands are discovered from the root app, so every command registered in cli/main.py is covered.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from pipectl.cli.main import app

runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]


def _command_paths(command, prefix=()):
    """Every command path below the root group, e.g. ('profile', 'links')."""
    for name, sub in sorted(getattr(command, "commands", {}).items()):
        path = (*prefix, name)
        yield path
        yield from _command_paths(sub, path)


COMMAND_PATHS = list(_command_paths(typer.main.get_command(app)))


def test_the_profile_commands_are_registered():
    assert {("profile",), ("profile", "model"), ("profile", "links"), ("profile", "show")} <= set(COMMAND_PATHS)


def test_root_help():
    result = runner.invoke(app, ["--help"], catch_exceptions=False)
    assert result.exit_code == 0 and "Usage" in result.output


@pytest.mark.parametrize("columns", ["80", "160"])
def test_help_reads_whole_at_any_width(columns):
    """Every option name whole (Rich's tables cut them short below 100 columns: plain text there),
    each command listed by its first sentence, no docstring line breaks mid-sentence."""
    shown = runner.invoke(app, ["plan", "-h"], env={"COLUMNS": columns}).output
    for flag in ("--max-tensor-parallel", "--pipeline-parallel", "--micro-batch-size", "--even-replicas"):
        assert flag in shown, (flag, shown)
    assert "…" not in shown and "\\[model]" not in shown and "[model]" in " ".join(shown.replace("│", " ").split())
    listed = " ".join(runner.invoke(app, ["-h"], env={"COLUMNS": columns}).output.replace("│", " ").split())
    assert "resize Move a run to N devices with the same global batch. export" in listed
    assert "PyTorch's pipelining runtime), with checkpoints" in listed
    usage = runner.invoke(app, ["resize", "-h"], env={"COLUMNS": columns}).output
    assert "pipectl resize [OPTIONS] RUN_DIR" in usage and "{RUN_DIR}" not in usage


@pytest.mark.parametrize("path", COMMAND_PATHS, ids=[" ".join(p) for p in COMMAND_PATHS])
def test_help_for_every_command(path):
    result = runner.invoke(app, [*path, "--help"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "Usage" in result.output


def _bad_yaml(tmp_path: Path) -> Path:
    path = tmp_path / "broken.yaml"
    path.write_text("name: x\nfamily: [gpt\n")
    return path


def _bad_field_yaml(tmp_path: Path) -> Path:
    path = tmp_path / "weird.yaml"
    path.write_text("name: weird\nfamily: gpt\nlayers: -3\nhidden: 64\n")
    return path


def _misspelt_cluster(tmp_path: Path) -> Path:
    path = tmp_path / "mine.yaml"
    path.write_text((REPO / "configs" / "clusters" / "a100-8x8.yaml").read_text().replace("devices_per_node", "devices_per_nod"))
    return path


def _not_a_profile(tmp_path: Path) -> Path:
    path = tmp_path / "profile.json"
    path.write_text('{"model": "x", "layers": "nope"}')
    return path


def _empty_yaml(tmp_path: Path) -> Path:
    path = tmp_path / "empty.yaml"
    path.write_text("")
    return path


def _bool_config(tmp_path: Path) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(f'[model]\nprofile = "{_profile(tmp_path)}"\n[cluster]\nname = "local"\n[training]\nglobal_batch = true\n')
    return path


def _config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def _real_plan(tmp_path: Path) -> str:
    from builders import write_plan

    return str(write_plan(tmp_path / "real-plan.json"))


def _plan_file(tmp_path: Path) -> Path:
    path = tmp_path / "plan.json"  # what a plan holds at the top, as far as telling kinds apart goes
    path.write_text('{"model_shape": {}, "request": {}, "chosen": {}}')
    return path


def _profile(tmp_path: Path) -> str:
    from pipectl.io import write_json_atomic
    from pipectl.testing.profiles import synthetic_profile

    write_json_atomic(tmp_path / "p.json", synthetic_profile(blocks=4, micro_batch_sizes=[1, 2], device="cpu"))
    return str(tmp_path / "p.json")


def _conditions(tmp_path: Path) -> str:
    from tests.measured.test_validate import CONDITIONS

    (tmp_path / "c.yaml").write_text(CONDITIONS)
    return str(tmp_path / "c.yaml")


def _model_copy(tmp_path: Path) -> Path:
    path = tmp_path / "mine.yaml"
    path.write_text((REPO / "configs" / "models" / "gpt-tiny.yaml").read_text())
    return path


CASES = {
    "missing model file": (lambda t: ["profile", str(t / "nowhere.yaml")], "nowhere.yaml"),
    "unknown model": (lambda t: ["profile", "gpt-huge"], "gpt-huge"),
    "bad yaml": (lambda t: ["profile", str(_bad_yaml(t))], "broken.yaml"),
    "bad yaml, where": (lambda t: ["profile", str(_bad_yaml(t))], "(at line 3, column 1)"),
    "status of a plan file": (lambda t: ["status", str(_plan_file(t))], "is a plan (pipectl plan), not a run directory"),
    "resize a plan file": (lambda t: ["resize", str(_plan_file(t)), "--devices", "1"], "not a run directory"),
    "bad field": (lambda t: ["profile", str(_bad_field_yaml(t))], "-3"),
    "impossible micro-batch sizes": (lambda t: ["profile", "gpt-tiny", "--micro-batch-sizes", "0,x"], "'0'"),
    "non-numeric micro-batch size": (lambda t: ["profile", "gpt-tiny", "-b", "1,x"], "'x'"),
    "unknown device": (lambda t: ["profile", "gpt-tiny", "--device", "tpu"], "tpu"),
    "unknown dtype": (lambda t: ["profile", "gpt-tiny", "--dtype", "int3"], "int3"),
    "bad factory": (lambda t: ["profile", "no_such_pkg.mod:build"], "no_such_pkg.mod:build"),
    "a factory not importable from here": (lambda t: ["profile", "no_such_pkg.mod:build"],
                                           "run from the folder that holds 'no_such_pkg'"),
    "shape-only model measured": (lambda t: ["profile", "gpt3-175b"], "gpt3-175b"),
    "unknown derive device": (lambda t: ["profile", "gpt-tiny", "--derive", "--device", "z80"], "z80"),
    "derive a factory": (lambda t: ["profile", "examples.custom_model:build", "--derive", "--device", "a100-80gb"],
                         "examples.custom_model"),
    # Deriving for this machine's cores, unasked, is not what --derive alone means.
    "derive without a device": (lambda t: ["profile", "gpt-tiny", "--derive"], "--derive models a catalog device"),
    "missing links to embed": (lambda t: ["profile", "gpt-tiny", "--links", str(t / "l.json")], "l.json"),
    "show missing file": (lambda t: ["profile", "show", str(t / "none.json")], "none.json"),
    "show invalid profile": (lambda t: ["profile", "show", str(_not_a_profile(t))], "layers"),
    "profile over its own model config": (lambda t: ["profile", str(_model_copy(t)), "-o", str(t / "mine.yaml")],
                                          "is the model config this command reads"),
    "links one rank": (lambda t: ["profile", "links", "--ranks", "1"], "got 1"),
    "links more ranks than the machine runs": (lambda t: ["profile", "links", "--ranks", "100000"], "--ranks 100000"),
    "show a directory": (lambda t: ["profile", "show", str(t)], "is a directory, not a file"),
    "show a name too long": (lambda t: ["profile", "show", str(t / ("a" * 300 + ".json"))], "File name too long"),
    "status of a name too long": (lambda t: ["status", str(t / ("r" * 300))], "File name too long"),
    "calibrate a name too long": (lambda t: ["calibrate", str(t / ("r" * 300)), "-o", str(t / "c.json")], "File name too long"),
    "an integer option given a fraction": (
        lambda t: ["plan", "--profile", "p.json", "--cluster", "local", "--global-batch", "2.5"], "--global-batch '2.5'"),
    "a float option given nan": (
        lambda t: ["plan", "--profile", "p.json", "--cluster", "local", "--global-batch", "4", "--memory-headroom", "nan"],
        "--memory-headroom 'nan': not a number"),
    "a choice given another word": (
        lambda t: ["plan", "--profile", "p.json", "--cluster", "local", "--global-batch", "4", "--objective", "speed"],
        "--objective 'speed': 'speed' is not one of"),
    "an empty model file": (lambda t: ["profile", str(_empty_yaml(t))], "empty.yaml is empty: it must hold a mapping"),
    "a boolean for a number in a config file": (
        lambda t: ["plan", "--config", str(_bool_config(t))], "job.toml [training] global_batch = true: true is a boolean"),
    "a misspelt cluster key": (
        lambda t: ["plan", "--profile", _profile(t), "--cluster", str(_misspelt_cluster(t)), "--global-batch", "4"],
        "devices_per_nod: unknown key; did you mean devices_per_node?"),
    "a ZeRO stage out of range": (
        lambda t: ["plan", "--profile", _profile(t), "--cluster", "local", "--global-batch", "4", "--zero-stages", "1,5"],
        "--zero-stages 1,5: ZeRO stages are 0, 1, 2 and 3"),
    "validate a missing CSV": (lambda t: ["validate", str(t / "runs.csv"), "--conditions", _conditions(t)],
                               "runs.csv"),
    "calibrate a missing CSV": (lambda t: ["calibrate", str(t / "runs.csv"), "--conditions", _conditions(t)],
                                "runs.csv"),
    "a python file as the model": (lambda t: ["profile", "models/net.py"],
                                   "models/net.py is a Python file, not a model YAML"),
    "a python file as the model, its import path": (lambda t: ["profile", "models/net.py"], "models.net:FUNCTION"),
    "a measured profile recorded as a GPU": (lambda t: ["profile", "mlp-tiny", "--device-kind", "a100-80gb"],
                                             "--device-kind a100-80gb is a cuda device"),
    "a catalog GPU to measure on": (lambda t: ["profile", "gpt-tiny", "--device", "a100-80gb"],
                                    "pipectl profile gpt-tiny --derive --device a100-80gb"),
    "derive for two devices": (lambda t: ["profile", "gpt-tiny", "--derive", "--device", "a100-80gb", "--device-kind",
                                          "h100-80gb"], "--device a100-80gb and --device-kind h100-80gb"),
    # '' (an unset shell variable) was taken as no value (--model ''), or as '.' for a path (". is a directory").
    "an empty option value": (lambda t: ["launch", str(_plan_file(t)), "--run-dir", "r", "--model", "", "--dry-run"],
                              "--model '': empty; give a value, or leave it out"),
    "an empty path": (lambda t: ["plan", "--profile", "", "--cluster", "local", "--global-batch", "4"],
                      "--profile '': empty"),
    "an empty argument": (lambda t: ["profile", "show", ""], "an argument '': empty"),
    "an empty value after =": (lambda t: ["plan", "--profile", _profile(t), "--cluster=", "--global-batch", "4"],
                               "--cluster '': empty"),
    "a negative interval in a config file": (
        lambda t: ["launch", _real_plan(t), "--run-dir", "r", "--dry-run", "--config", str(_config(t, "[checkpoint]\nevery = -4\n"))],
        "job.toml [checkpoint] every = -4: not a step count"),
    "calibrate two CSVs": (lambda t: ["calibrate", _conditions(t), _conditions(t), "-c", _conditions(t)],
                           "is a file among 2 arguments"),
    "links bad size": (lambda t: ["profile", "links", "--message-sizes", "1KiB,lots"], "lots"),
    # One size: refused before the processes start (a latency and a bandwidth are fitted to the sizes).
    "links one size": (lambda t: ["profile", "links", "--message-sizes", "1KB"], "--message-sizes '1KB' names one size"),
    "links bad device": (lambda t: ["profile", "links", "--device", "fpga"], "fpga"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_exits_2_and_names_the_value(case, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing is written into the repository
    make_args, named = CASES[case]
    result = runner.invoke(app, make_args(tmp_path), catch_exceptions=False)
    assert result.exit_code == 2, result.output
    assert "error:" in result.output
    assert named in result.output
    assert "Traceback" not in result.output


def test_real_process_prints_one_message_and_no_traceback(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PIPECTL_DEBUG", None)
    completed = subprocess.run(
        [sys.executable, "-m", "pipectl.cli.main", "profile", "show", str(tmp_path / "missing.json")],
        capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path,
    )
    assert completed.returncode == 2
    assert "missing.json" in completed.stderr
    assert "Traceback" not in completed.stderr + completed.stdout


def test_debug_variable_shows_the_traceback(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PIPECTL_DEBUG": "1"}
    completed = subprocess.run(
        [sys.executable, "-m", "pipectl.cli.main", "profile", "show", str(tmp_path / "missing.json")],
        capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path,
    )
    assert completed.returncode == 2  # the error's own code, the traceback shown too
    assert "Traceback" in completed.stderr and "missing.json" in completed.stderr


@pytest.mark.parametrize(
    "args, said",
    [
        (["plan", "--steps", "10"], "error: pipectl plan takes no --steps: it is an option of pipectl launch and "
         "pipectl resize"),
        (["simulate", "plan.json", "--global-batch", "8"], "pipectl simulate takes no --global-batch: it is an option "
         "of pipectl plan"),
        (["plan", "--stepz", "10"], "No such option: --stepz"),  # no command's: click's own words
    ],
)
def test_another_commands_option_is_said_to_be_its(tmp_path, args, said):
    """A new user's `pipectl plan ... --steps 10`: which command takes it, not click's near spellings
    of plan's own options (`--samples, --tokens, --top`). In a real process, which loads one command."""
    from cli_process import pipectl

    done = pipectl(*args, cwd=tmp_path)
    assert done.returncode == 2 and said in " ".join(done.stderr.split()), done.stderr
    assert "Traceback" not in done.stderr

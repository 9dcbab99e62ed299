"""Bad inputs found by hand or by the fuzzer, each held by name: exit 2 and a message naming the
field and the value, before anything is allocated, written or started."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from pipectl.cli.main import app
from pipectl.errors import UserInputError
from pipectl.io import write_json_atomic

runner = CliRunner()


def cli(*args: str):
    return runner.invoke(app, list(args))


def refused(result, *words: str) -> str:
    output = " ".join(result.output.split())
    assert result.exit_code == 2, output
    assert result.exception is None or isinstance(result.exception, SystemExit), output
    for word in words:
        assert word in output, f"{word!r} not in: {output}"
    return output


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("known")
    profile, plan = root / "profile.json", root / "plan.json"
    assert cli("profile", "gpt-tiny", "--derive", "--device", "cpu", "-b", "1,2", "-o", str(profile)).exit_code == 0
    result = cli("plan", "--profile", str(profile), "--cluster", "local", "--devices", "2", "--global-batch", "8",
                 "-o", str(plan))  # fmt: skip
    assert result.exit_code == 0, result.output
    return root, profile, plan


def _edited(source: Path, target: Path, edit) -> Path:
    doc = json.loads(source.read_text())
    edit(doc)
    target.write_text(json.dumps(doc, allow_nan=True))
    return target


# --- model YAML ---------------------------------------------------------------------------------


def _model(tmp_path, **fields) -> Path:
    shape = {"name": "m", "family": "gpt", "layers": 2, "hidden": 64, "heads": 4, "seq_len": 8, "vocab": 256, **fields}
    path = tmp_path / "m.yaml"
    path.write_text("".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}\n" for k, v in shape.items()))
    return path


def test_a_boolean_layer_count_is_refused(tmp_path):
    from pipectl.models import build_model

    with pytest.raises(UserInputError, match="layers: true is a boolean"):
        build_model(str(_model(tmp_path, layers=True)))


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"layers": 10**12}, ["layers", "1000000000000"]),
        ({"hidden": 2**20}, ["parameters", "GiB", "hidden 1048576"]),
    ],
)
def test_a_model_too_large_for_this_host_is_refused_before_building(tmp_path, fields, words):
    refused(cli("profile", str(_model(tmp_path, **fields)), "-b", "1", "-o", str(tmp_path / "p.json")), *words)
    assert not (tmp_path / "p.json").exists()


def test_a_shape_only_model_too_large_to_build_can_still_be_derived(tmp_path):
    model = _model(tmp_path, hidden=2**20, shape_only=True)
    refused(cli("profile", str(model), "--once", "-b", "1", "-o", str(tmp_path / "once.json")), "largest layer", "GiB")
    result = cli("profile", str(model), "--derive", "--device", "a100-80gb", "-b", "1", "-o", str(tmp_path / "d.json"))
    assert result.exit_code == 0, result.output


def test_check_fits_host_names_the_figure():
    from pipectl.artifacts.model import ModelConfig
    from pipectl.models.registry import check_fits_host

    config = ModelConfig(name="x", family="gpt", layers=2, hidden=64, heads=4, seq_len=32, vocab=256)
    check_fits_host(config, memory_bytes=4 * sum(config.layer_parameter_counts()))
    with pytest.raises(UserInputError, match=r"134,912 parameters.*this host's 0.0 GiB"):
        check_fits_host(config, memory_bytes=4 * sum(config.layer_parameter_counts()) - 1)


# --- profile, links, plan ---------------------------------------------------------------------------


def _first_cost(field, value):
    def edit(doc):
        doc["layers"][0]["costs"][0][field] = value

    return edit


@pytest.mark.parametrize(
    "edit, words",
    [
        (_first_cost("forward_seconds", float("inf")), ["forward_seconds", "finite", "inf"]),
        (_first_cost("backward_seconds", 1e308), ["backward_seconds", "1e+308"]),
        (_first_cost("saved_activation_bytes", 10**40), ["saved_activation_bytes", "1" + "0" * 40]),
        (lambda doc: doc["layers"][1].update(index=0), ["index 0", "position 1"]),
        (lambda doc: doc.update(micro_batch_sizes=[1, 2, 4]), ["micro_batch_sizes", "[1, 2, 4]"]),
        (lambda doc: doc["layers"][2].update(parameter_count=True), ["parameter_count", "boolean"]),
    ],
)
def test_bad_profile_values_are_refused(made, tmp_path, edit, words):
    _, profile, _ = made
    bad = _edited(profile, tmp_path / "bad.json", edit)
    refused(cli("profile", "show", str(bad)), *words)
    refused(cli("plan", "--profile", str(bad), "--cluster", "local", "--global-batch", "8", "-o", str(tmp_path / "p.json")))


def _links(tmp_path, fits) -> Path:
    path = tmp_path / "links.json"
    path.write_text(json.dumps({"backend": "gloo", "device": "cpu", "fits": fits}, allow_nan=True))
    return path


FIT = {"link_class": "intra_node", "p2p_latency_seconds": 1e-5, "p2p_bandwidth_bytes_per_second": 1e9,
       "allreduce_latency_seconds": 1e-5, "allreduce_bandwidth_bytes_per_second": 1e9}  # fmt: skip


@pytest.mark.parametrize(
    "fits, words",
    [
        ([], ["fits is empty"]),
        ([{**FIT, "p2p_bandwidth_bytes_per_second": float("nan")}], ["p2p_bandwidth_bytes_per_second", "nan"]),
        ([{**FIT, "allreduce_bandwidth_bytes_per_second": float("inf")}], ["allreduce_bandwidth", "inf"]),
        ([FIT, FIT], ["repeats a link class"]),
    ],
)
def test_bad_links_are_refused(tmp_path, fits, words):
    refused(cli("profile", "show", str(_links(tmp_path, fits))), *words)


def test_a_plan_with_a_non_finite_prediction_is_refused(made):
    root, _, plan = made
    bad = _edited(plan, root / "plan-nan.json", lambda doc: doc["chosen"].update(predicted_step_seconds=float("nan")))
    refused(cli("simulate", str(bad)), "predicted_step_seconds", "nan")
    refused(cli("launch", str(bad), "--run-dir", str(root / "never"), "--dry-run"), "predicted_step_seconds")


# --- arguments --------------------------------------------------------------------------------------


def test_a_port_beyond_65535_is_refused(made, tmp_path):
    _, _, plan = made
    refused(cli("launch", str(plan), "--run-dir", str(tmp_path / "r"), "--dry-run", "--master-port", "99999"),
            "--master-port", "99999")  # fmt: skip


def test_resuming_a_run_that_does_not_exist_is_refused_in_a_dry_run(made, tmp_path):
    _, _, plan = made
    refused(cli("launch", str(plan), "--run-dir", str(tmp_path / "none"), "--resume", "--dry-run"), "no such run")


@pytest.mark.parametrize(
    "name, content, words",
    [
        ("odd.bin", b"\x01\x02\x03", ["3 bytes", "uint16"]),
        ("empty.bin", b"", ["empty.bin is empty: no tokens to train on"]),
        ("big.bin", np.array([1, 2, 300] * 20, dtype=np.uint16).tobytes(), ["300", "vocabulary 0..255"]),
        ("junk.npy", b"not an array at all", ["not a .npy array", "NumPy's header"]),
        ("float.npy", None, ["float64", "integer token ids"]),
    ],
)
def test_a_malformed_token_file_is_refused_before_any_rank_starts(made, tmp_path, name, content, words):
    _, _, plan = made
    path = tmp_path / name
    if content is None:
        np.save(path, np.linspace(0, 1, 100))
    else:
        path.write_bytes(content)
    refused(cli("launch", str(plan), "--run-dir", str(tmp_path / "r"), "--dry-run", "--data", str(path)), *words)


# --- outputs ------------------------------------------------------------------------------------------


def _special(tmp_path, kind: str) -> Path:
    path = tmp_path / kind
    if kind == "directory":
        path.mkdir()
    elif kind == "FIFO":
        os.mkfifo(path)
    elif kind == "symbolic link":
        (tmp_path / "target.json").write_text("{}")
        path.symlink_to(tmp_path / "target.json")
    return path


@pytest.mark.parametrize("kind", ["directory", "FIFO", "symbolic link"])
def test_an_output_that_is_not_a_regular_file_is_refused(made, tmp_path, kind):
    _, profile, _ = made
    path = _special(tmp_path, kind)
    refused(cli("plan", "--profile", str(profile), "--cluster", "local", "--global-batch", "8", "-o", str(path)), kind)
    refused(cli("profile", "gpt-tiny", "--derive", "--device", "cpu", "-b", "1", "-o", str(path)), kind)
    if kind == "symbolic link":
        assert (tmp_path / "target.json").read_text() == "{}" and path.is_symlink()


def test_a_device_is_never_replaced(made, tmp_path):
    # A device node of our own (the real /dev/null is never named: if the check regressed, the
    # test would replace it).
    device = tmp_path / "null"
    try:
        os.mknod(device, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("creating a device node needs CAP_MKNOD")
    refused(cli("profile", "gpt-tiny", "--derive", "--device", "cpu", "-b", "1", "-o", str(device)), "a device")
    assert stat.S_ISCHR(os.lstat(device).st_mode)


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_written_files_keep_the_umask(tmp_path, umask):
    previous = os.umask(umask)
    try:
        written = write_json_atomic(tmp_path / "out.json", {"a": 1})
    finally:
        os.umask(previous)
    assert stat.S_IMODE(written.stat().st_mode) == 0o666 & ~umask


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_checkpoint_files_and_launch_sh_keep_the_umask(tmp_path, umask):
    """A rank's safetensors file (safetensors creates it 0600) gets 0666 less the umask; launch.sh
    is executable by whoever may read it (under 077: 0700, not 0711)."""
    from builders import plan_of, gpt_tiny_candidate, shard_model, write_shard_layout
    from pipectl.launch import prepare_launch
    from pipectl.launch.options import LaunchOptions

    previous = os.umask(umask)
    try:
        write_shard_layout(tmp_path, shard_model(), t=1, d=1)
        prepared = prepare_launch(plan_of(gpt_tiny_candidate(1, 1)), tmp_path / "run", LaunchOptions())
        prepared.lock.release()
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "rank-00000.safetensors").stat().st_mode) == 0o666 & ~umask
    assert stat.S_IMODE((tmp_path / "run" / "launch.sh").stat().st_mode) == 0o777 & ~umask



def test_rewritten_run_files_leave_a_reader_the_old_script(tmp_path):
    """A resize by restart rewrites launch.sh while the old Slurm job's batch shell may still be
    reading it (bash reads a script as it runs it, by offset): rewritten in place, that shell read
    the new script from the old offset and failed on a syntax error. The rewrite is a new file
    renamed over the old; a reader keeps the old bytes, and the new script is executable at once."""
    from builders import plan_of, gpt_tiny_candidate, shard_model, write_shard_layout
    from pipectl.launch import prepare_launch
    from pipectl.launch.options import LaunchOptions
    from pipectl.launch.prepare import write_run_files

    write_shard_layout(tmp_path, shard_model(), t=1, d=1)
    prepared = prepare_launch(plan_of(gpt_tiny_candidate(1, 1)), tmp_path / "run", LaunchOptions())
    prepared.lock.release()
    script = tmp_path / "run" / "launch.sh"
    old = script.read_bytes()
    with script.open("rb") as reader:
        head = reader.read(10)
        command = dataclasses.replace(prepared.command, argv=[*prepared.command.argv, "--another-layout"])
        write_run_files(prepared.run_dir, plan=prepared.plan, job=prepared.job, ds_config=prepared.ds_config,
                        command=command)
        assert head + reader.read() == old
    assert script.read_bytes() != old and os.access(script, os.X_OK)
    assert not list(script.parent.glob(".*.tmp"))

# --- model references -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "reference, words",
    [
        ("sys:exit", ["'sys'", "not a model factory"]),
        ("os:system", ["'os'", "not a model factory"]),
        ("pipectl.cli.main:run", ["pipectl.cli.main"]),
        ("numpy:zeros", ["not a Python function"]),
    ],
)
def test_a_reference_that_is_not_a_model_factory_is_refused_before_it_runs(reference, words):
    from pipectl.models import build_model

    with pytest.raises(UserInputError) as caught:
        build_model(reference)
    for word in words:
        assert word in caught.value.message


def test_a_factory_re_exported_from_the_standard_library_is_refused(tmp_path, monkeypatch):
    from pipectl.models import build_model

    (tmp_path / "sneaky_model.py").write_text("from shutil import rmtree as build\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PIPECTL_MODEL_PATH", raising=False)
    with pytest.raises(UserInputError, match="shutil.rmtree"):
        build_model("sneaky_model:build")


def test_a_run_directory_is_not_searched_for_the_factory(tmp_path, monkeypatch):
    from pipectl.models import build_model

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "job.json").write_text("{}")
    (run_dir / "planted_model.py").write_text("raise SystemExit('ran')\n")
    monkeypatch.chdir(run_dir)
    monkeypatch.setenv("PIPECTL_MODEL_PATH", str(tmp_path / "elsewhere"))
    monkeypatch.syspath_prepend(str(run_dir))  # as `python -m` puts the current directory first
    with pytest.raises(UserInputError, match="No module named 'planted_model'"):
        build_model("planted_model:build")


def test_a_boolean_schema_version_is_refused(tmp_path):
    # Found by the slow sweep: Literal[1] accepts True, since True == 1.
    path = _links(tmp_path, [FIT])
    assert cli("profile", "show", str(path)).exit_code == 0  # valid as written
    path.write_text(json.dumps({**json.loads(path.read_text()), "schema_version": True}))
    refused(cli("profile", "show", str(path)), "schema_version", "boolean")


def test_a_file_larger_than_any_pipectl_file_is_refused_before_it_is_read(tmp_path, monkeypatch):
    import pipectl.io as io

    monkeypatch.setattr(io, "MAX_MAPPING_BYTES", 1024)
    big = tmp_path / "plan.json"
    big.write_text('{"a": "' + "x" * 4096 + '"}')
    with pytest.raises(UserInputError, match="plan.json is larger than 0 MiB: not one of pipectl's files"):
        io.read_mapping(big)


def test_a_resumed_run_whose_job_json_lost_its_total_of_steps_is_named(made, tmp_path):
    # Found by the job.json sweep: `launch --resume` compared None with the steps trained (a TypeError).
    _, _, plan = made
    run = tmp_path / "run"
    assert cli("launch", str(plan), "--run-dir", str(run), "--engine", "slurm", "--steps", "4").exit_code == 0
    _edited(run / "job.json", run / "job.json", lambda doc: doc["options"]["training"].update(steps=None))
    refused(cli("launch", str(run / "plan.json"), "--run-dir", str(run), "--resume", "--dry-run"),
            f"{run / 'job.json'} [training] steps is not set", "--steps N")

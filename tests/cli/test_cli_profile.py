"""`pipectl profile` end to end: the real commands, their files and their output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipectl.artifacts.profile import LinkClass, LinkClassFit, LinkSample, LinksProfile, ModelProfile
from pipectl.cli.main import app
from pipectl.io import load_model, write_json_atomic

runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]
QUICK = ["--warmup", "0", "--repeats", "1"]


def _invoke(*args: str):
    result = runner.invoke(app, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


@pytest.fixture
def links_file(tmp_path: Path) -> Path:
    links = LinksProfile(
        backend="gloo",
        device="cpu",
        fits=[
            LinkClassFit(
                link_class=LinkClass.INTRA_NODE,
                p2p_latency_seconds=5e-5,
                p2p_bandwidth_bytes_per_second=3e9,
                allreduce_latency_seconds=7e-5,
                allreduce_bandwidth_bytes_per_second=1.5e9,
            )
        ],
        samples=[
            LinkSample(op="p2p", link_class=LinkClass.INTRA_NODE, ring_size=2, message_bytes=4096, seconds=6e-5)
        ],
    )
    return write_json_atomic(tmp_path / "links.json", links)


def test_measure_gpt_tiny_writes_profile_and_prints_table(tmp_path):
    out = tmp_path / "p.json"
    result = _invoke("profile", "gpt-tiny", "-o", str(out), "-b", "1,2", *QUICK)
    profile = load_model(ModelProfile, out)
    assert profile.source.value == "measured" and profile.device == "cpu"
    assert profile.micro_batch_sizes == [1, 2]
    assert [layer.name for layer in profile.layers][0] == "embed"
    for name in ("embed", "block.5", "final_norm", "head", "total"):
        assert name in result.stdout
    assert f"wrote {out}" in result.stderr.replace("\n", "")
    # the engine calibration (seconds, with the layer bar full) says what it is doing
    assert profile.runtime is not None
    assert "calibrating the training engine on this host…" in result.stderr


def test_json_flag_prints_exactly_the_written_profile(tmp_path):
    out = tmp_path / "p.json"
    result = _invoke("profile", "model", "mlp-tiny", "-o", str(out), "-b", "2", *QUICK, "--json")
    printed = ModelProfile.model_validate(json.loads(result.stdout))
    assert printed == load_model(ModelProfile, out)


def test_show_profile_table_json_and_size_filter(tmp_path):
    out = tmp_path / "p.json"
    _invoke("profile", "gpt-tiny", "-o", str(out), "-b", "1,2", *QUICK)
    table = _invoke("profile", "show", str(out)).stdout
    assert "block.0" in table and "fwd ms" in table
    as_json = json.loads(_invoke("profile", "show", str(out), "--json").stdout)
    assert as_json["model"] == "gpt-tiny"
    only_two = _invoke("profile", "show", str(out), "-b", "2").stdout
    # One row per block, all for b=2 (the row is: name, params value, unit, b, ...).
    rows = [line.split() for line in only_two.splitlines() if line.strip().startswith("block.")]
    assert len(rows) == 6 and all(row[3] == "2" for row in rows)


def test_show_rejects_a_size_that_was_not_profiled(tmp_path):
    out = tmp_path / "p.json"
    _invoke("profile", "gpt-tiny", "-o", str(out), "-b", "1", *QUICK)
    result = runner.invoke(app, ["profile", "show", str(out), "-b", "4"], catch_exceptions=False)
    assert result.exit_code == 2 and "micro-batch size 4" in result.output


def test_show_links_file(links_file):
    result = _invoke("profile", "show", str(links_file))
    assert "intra_node" in result.stdout and "3" in result.stdout  # 3 GB/s p2p


def test_links_are_embedded_in_the_profile(tmp_path, links_file):
    out = tmp_path / "p.json"
    _invoke("profile", "gpt-tiny", "-o", str(out), "-b", "1", *QUICK, "--links", str(links_file))
    profile = load_model(ModelProfile, out)
    assert profile.links == load_model(LinksProfile, links_file)


def test_derive_with_device_as_in_the_issue(tmp_path):
    out = tmp_path / "d.json"
    _invoke("profile", "gpt3-175b", "--derive", "--device", "a100-80gb", "-o", str(out), "-b", "1,2")
    profile = load_model(ModelProfile, out)
    assert profile.source.value == "derived" and profile.device == "a100-80gb"
    assert profile.dtype == "bfloat16"
    assert profile.parameter_count == pytest.approx(175e9, rel=0.01)


def test_derive_with_device_kind(tmp_path):
    out = tmp_path / "d.json"
    _invoke("profile", "gpt-tiny", "--derive", "--device-kind", "v100-16gb", "-o", str(out), "-b", "4")
    assert load_model(ModelProfile, out).device == "v100-16gb"


def test_deriving_a_factory_is_refused_with_a_hint_that_runs_or_the_reference_named(tmp_path):
    """A factory's shape only a measurement knows: the hint measures it, for a reference that is
    one; a path given as a reference is named as no reference (its hint used to be a command that
    failed in turn)."""
    refused = runner.invoke(app, ["profile", "examples.custom_model:build", "--derive", "--device", "a100-80gb"])
    said = " ".join(refused.output.split())
    assert refused.exit_code == 2 and "derived profiles need a model config" in said, said
    assert "hint: derive a built-in gpt, bert or mlp config" in said and "pipectl profile examples.custom_model:build" in said
    path = runner.invoke(app, ["profile", "../b/mypkg.net:build", "--derive", "--device", "a100-80gb"])
    said = " ".join(path.output.split())
    assert path.exit_code == 2 and "model reference '../b/mypkg.net:build' is not 'package.module:function'" in said, said
    assert "pipectl profile ../b" not in said


def test_user_factory_from_the_repo_root(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    out = tmp_path / "c.json"
    _invoke("profile", "examples.custom_model:build", "-o", str(out), "-b", "1", *QUICK)
    profile = load_model(ModelProfile, out)
    assert profile.model == "residual-mlp"
    assert [layer.name for layer in profile.layers][-1] == "classifier"
    # Not a language model: the byte corpus cannot feed it, and its run's job.json says what does
    # (its own batches), not 'builtin' (which it used to record while training on synthetic batches).
    _invoke("plan", "--profile", str(out), "--cluster", "local", "--devices", "1", "--global-batch", "8",
            "-o", str(tmp_path / "plan.json"))  # fmt: skip
    dry = _invoke("launch", str(tmp_path / "plan.json"), "--run-dir", str(tmp_path / "run"), "--data", "builtin", "--dry-run")
    assert '"data": {\n    "kind": "synthetic"' in dry.output, dry.output


def test_memory_budget_stops_the_sweep_and_says_so(tmp_path):
    out = tmp_path / "p.json"
    # gpt-tiny's weights and gradients alone are ~2.4 MiB; 0.004 GiB (4.1 MiB) fits b=1 (3.3 MiB) only.
    result = _invoke("profile", "gpt-tiny", "-o", str(out), "-b", "1,8", *QUICK, "--memory-budget-gib", "0.004")
    profile = load_model(ModelProfile, out)
    assert profile.micro_batch_sizes == [1]
    assert profile.not_fitting_micro_batch_size == 8
    assert "b=8 does not fit" in result.stdout


def test_links_command_passes_its_options_and_writes_the_result(tmp_path, monkeypatch, links_file):
    # The real 2-process calibration is tested in tests/profile/test_links.py; here the command's
    # wiring: options -> CalibrationRequest, result -> links.json + table.
    import pipectl.cli.profile as profile_command

    requests = []

    def fake_calibrate(request, device_name):
        requests.append((request, device_name))
        return load_model(LinksProfile, links_file)

    monkeypatch.setattr(profile_command, "calibrate_links", fake_calibrate)
    out = tmp_path / "out.json"
    result = _invoke(
        "profile", "links", "-o", str(out), "--ranks", "3", "--message-sizes", "1KiB,4m,512",
        "--warmup", "1", "--repeats", "2", "--timeout", "45",
    )
    (request, device_name), = requests
    assert request.ranks == 3 and request.backend == "gloo" and device_name == "cpu"
    assert request.message_sizes == (512, 1024, 4 * 1024**2)
    assert (request.warmup, request.repeats, request.timeout_seconds) == (1, 2, 45.0)
    assert load_model(LinksProfile, out) == load_model(LinksProfile, links_file)
    assert "intra_node" in result.stdout


def test_show_prints_the_engine_costs_of_a_calibrated_profile(tmp_path):
    from pipectl.artifacts.profile import EngineComputeRatio, RuntimeCosts
    from pipectl.testing.profiles import synthetic_profile

    profile = synthetic_profile(2).model_copy(
        update={
            "runtime": RuntimeCosts(
                engine="test engine", forward_overhead_seconds=0.0002, backward_overhead_seconds=0.0003,
                step_fixed_seconds=0.004, step_seconds_per_parameter=2.2e-8,
                compute_ratios=[EngineComputeRatio(micro_batch_size=1, forward_ratio=1.1, backward_ratio=1.3)],
            )  # fmt: skip
        }
    )
    path = tmp_path / "p.json"
    path.write_text(profile.model_dump_json())
    result = runner.invoke(app, ["profile", "show", str(path)], env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    assert "engine costs on this host (test engine)" in result.output
    assert "4.00 ms" in result.output and "22 ns" in result.output and "1.10 fwd, 1.30 bwd" in result.output


def test_once_measures_each_distinct_layer_and_every_layer_measures_all(tmp_path):
    once, every = tmp_path / "once.json", tmp_path / "every.json"
    _invoke("profile", "gpt-tiny", "-o", str(once), "-b", "1", *QUICK, "--once")
    _invoke("profile", "gpt-tiny", "-o", str(every), "-b", "1", *QUICK, "--every-layer")
    measured_once, measured_every = load_model(ModelProfile, once), load_model(ModelProfile, every)
    assert [layer.costs_from for layer in measured_once.layers] == [None, None] + [1] * 5 + [None, None]
    assert any("reuse block.0" in note for note in measured_once.notes)
    assert all(layer.costs_from is None for layer in measured_every.layers)
    assert not any("reuse" in note for note in measured_every.notes)


def test_a_shape_only_config_is_profiled_one_layer_at_a_time_in_bounded_memory(tmp_path):
    import subprocess
    import sys

    from pipectl.models import build_model
    from pipectl.models.base import shape_of

    config = tmp_path / "deep.yaml"
    config.write_text(
        "name: deep\nfamily: gpt\nlayers: 3000\nhidden: 128\nheads: 4\nseq_len: 16\nvocab: 64\nshape_only: true\n"
    )
    full_parameter_bytes = 4 * shape_of(build_model(config, allow_shape_only=True)).parameter_count  # 2.4 GB
    refused = runner.invoke(app, ["profile", str(config), "-o", str(tmp_path / "no.json"), *QUICK, "--every-layer"])
    assert refused.exit_code == 2 and "shape-only" in refused.output and "--once" in refused.output
    # The real command in its own process, which reports its peak resident memory at exit: its own
    # memory's high-water mark (VmHWM), not getrusage's ru_maxrss, which Linux keeps across the exec
    # and so holds the peak of the (v)forking test process too (a test worker's 1.2 GB, at times).
    script = (
        "import sys\nfrom pipectl.cli.main import app\ntry:\n    app(sys.argv[1:])\nfinally:\n"
        "    hwm = next(l for l in open('/proc/self/status') if l.startswith('VmHWM:')).split()[1]\n"
        "    print('maxrss-kib', hwm, file=sys.stderr)\n"
    )
    out = tmp_path / "deep.json"
    done = subprocess.run(
        [sys.executable, "-c", script, "profile", str(config), "-o", str(out), "-b", "1", *QUICK, "--once", "--json"],
        capture_output=True, text=True, timeout=300, env={**__import__("os").environ, "PYTHONPATH": str(REPO / "src")},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    peak_bytes = 1024 * int(done.stderr.split("maxrss-kib")[-1].split()[0])
    assert peak_bytes < full_parameter_bytes / 2
    profile = load_model(ModelProfile, out)
    assert len(profile.layers) == 3003 and profile.layers[-2].name == "final_norm"
    assert profile.parameter_count * 4 == full_parameter_bytes
    assert sum(layer.costs_from is None for layer in profile.layers) == 4
    assert any("shape-only" in note and "runtime terms not measured" in note for note in profile.notes)


def test_options_may_come_before_the_model_and_profile_alone_prints_its_help(tmp_path):
    """`pipectl profile --derive --device a100-80gb gpt-tiny -o p.json`, options first as every other
    command takes them; `pipectl profile` alone prints its help (exit 2, as `pipectl` alone), not an
    error line."""
    import os
    import subprocess
    import sys

    def pipectl(*args: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "COLUMNS": "100"}
        return subprocess.run([sys.executable, "-m", "pipectl.cli.main", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip

    done = pipectl("profile", "--derive", "--device", "a100-80gb", "-b", "1,2", "gpt-tiny", "-o", "p.json")
    assert done.returncode == 0, done.stdout + done.stderr
    assert load_model(ModelProfile, tmp_path / "p.json").micro_batch_sizes == [1, 2]
    alone = pipectl("profile")
    shown = " ".join((alone.stdout + alone.stderr).replace("│", " ").split())
    assert alone.returncode == 2 and "profile [OPTIONS] COMMAND" in shown, shown
    assert "error:" not in shown and "pipectl profile model -h" in shown, shown

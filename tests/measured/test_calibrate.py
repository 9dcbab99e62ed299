"""`pipectl calibrate MEASURED.csv`: the cluster's terms fitted to its runs, then used by validate."""

from __future__ import annotations

import json
from dataclasses import replace
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pipectl.errors import UserInputError

from pipectl.measured.calibrate import (
    RATES, TERMS, _Problem, bounded_terms, calibrate_runs, ceilings, fit, starting_terms, terms_at,
)
from pipectl.measured.predict import Calibrated, Predictor
from pipectl.measured.runs import MeasuredRun, load_conditions

from tests.measured.test_validate import CONDITIONS, HEADER

# Layouts that tell the terms apart: small and large shards (kernel overhead against GEMM and
# memory rates), one to eight micro-batches (per micro-batch), t up to 4 (the link), d up to 4.
LAYOUTS = [  # gpus, B, b, hidden, layers, t, d, p
    (2, 8, 2, 1024, 12, 1, 1, 2), (2, 16, 4, 1024, 12, 1, 2, 1), (2, 8, 1, 1024, 12, 2, 1, 1),
    (4, 16, 4, 2048, 12, 1, 2, 2), (4, 8, 1, 2048, 12, 4, 1, 1), (4, 16, 2, 1024, 12, 2, 2, 1),
    (4, 32, 8, 2048, 12, 2, 1, 2), (8, 32, 4, 1024, 12, 2, 2, 2), (8, 16, 1, 2048, 12, 1, 4, 2),
    (8, 64, 8, 1024, 12, 4, 2, 1), (2, 4, 1, 2048, 12, 1, 1, 2), (4, 32, 2, 2048, 12, 1, 4, 1),
]
# What the synthetic cluster is: slower GEMMs whose library recovers part of the tile quantization,
# a busier host, a slower link, an engine overhead.
TRUTH = {
    "gemm_efficiency": 0.7,
    "wave_quantization": 0.5,
    "memory_bandwidth_gbytes_per_second": 1700.0,
    "kernel_overhead_us": 55.0,
    "intra_node_latency_us": 6.0,
    "intra_node_bandwidth_gbytes_per_second": 110.0,
    "micro_batch_overhead_seconds": 0.003,
    "step_overhead_seconds": 0.004,
}


def _runs(seconds=None) -> list[MeasuredRun]:
    return [
        MeasuredRun(line=i + 2, gpus=g, global_batch=B, micro_batch=b, hidden=h, heads=16, layers=layers, seq_len=1024,
                    tensor_parallel=t, data_parallel=d, pipeline_parallel=p,
                    measured_seconds=1.0 if seconds is None else seconds[i])
        for i, (g, B, b, h, layers, t, d, p) in enumerate(LAYOUTS)
    ]  # fmt: skip


@pytest.fixture(scope="module")
def conditions(tmp_path_factory):
    path = tmp_path_factory.mktemp("conditions") / "conditions.yaml"
    path.write_text(CONDITIONS)
    return load_conditions(path)


def _truth_seconds(conditions) -> list[float]:
    runs = _runs()
    truth = Calibrated("a100-80gb", starting_terms(conditions).model_copy(update=TRUTH))
    predictor = Predictor(conditions, runs, truth)
    return [predictor.predict(run).predicted_seconds for run in runs]


def test_the_fit_recovers_a_cluster_made_of_known_terms(conditions):
    """Rows priced with known terms: the fit explains them and finds the terms the rows determine."""
    seconds = _truth_seconds(conditions)
    runs = _runs(seconds)
    start = starting_terms(conditions)
    problem = _Problem(runs, conditions, start, 1, "a100-80gb", {})
    measured = np.array(seconds)
    (before,) = problem.predictions([np.zeros(len(TERMS))])
    assert np.max(np.abs(before / measured - 1)) > 0.15  # the starting terms are far off
    x = fit(problem, np.arange(len(runs)), measured, lambda line: None)
    (after,) = problem.predictions([x])
    assert np.max(np.abs(after / measured - 1)) < 0.01
    fitted = terms_at(start, x)
    assert fitted.gemm_efficiency == pytest.approx(TRUTH["gemm_efficiency"], rel=0.05)
    # It starts at its ceiling (the model's whole waves): the fit moves it from there.
    assert fitted.wave_quantization == pytest.approx(TRUTH["wave_quantization"], rel=0.15)
    assert fitted.kernel_overhead_us == pytest.approx(TRUTH["kernel_overhead_us"], rel=0.05)
    assert fitted.micro_batch_overhead_seconds == pytest.approx(TRUTH["micro_batch_overhead_seconds"], rel=0.2)
    # Every row ran on one node: the network between nodes is left as it was.
    assert fitted.inter_node_latency_us == start.inter_node_latency_us
    assert fitted.inter_node_bandwidth_gbytes_per_second == start.inter_node_bandwidth_gbytes_per_second


def test_the_fit_stops_at_what_a_device_of_the_kind_can_have(conditions):
    """Rows that ask for A100 GEMMs at 100 % of peak and an NVLink twice its line rate (a cost the
    model misses on them, carried into the device figures, predicted every larger shape fast): the
    fit stops at the best GEMM measured on the part, its link's line rate, its datasheet memory,
    and says which terms it left there."""
    start = starting_terms(conditions)
    most = ceilings(conditions, start)
    assert most["gemm_efficiency"] == 0.869 and most["memory_bandwidth_gbytes_per_second"] == 2039
    assert most["intra_node_bandwidth_gbytes_per_second"] == 300  # NVLink 3, one direction
    assert most["inter_node_bandwidth_gbytes_per_second"] == start.inter_node_bandwidth_gbytes_per_second
    runs = _runs()
    impossible = Calibrated("a100-80gb", start.model_copy(update={
        "gemm_efficiency": 1.0, "intra_node_bandwidth_gbytes_per_second": 600.0}))  # fmt: skip
    predictor = Predictor(conditions, runs, impossible)
    measured = np.array([predictor.predict(run).predicted_seconds for run in runs])
    problem = _Problem(_runs(list(measured)), conditions, start, 1, "a100-80gb", {})
    fitted = terms_at(start, fit(problem, np.arange(len(runs)), measured, lambda line: None))
    assert fitted.gemm_efficiency == pytest.approx(0.869)
    assert fitted.intra_node_bandwidth_gbytes_per_second <= 300 * (1 + 1e-9)
    assert "gemm_efficiency" in bounded_terms(conditions, start, fitted)
    assert bounded_terms(conditions, start, start) == []
    # A rate that starts at 0 stays there (a multiple of 0), without a division by it.
    at_zero = start.model_copy(update={"intra_node_latency_us": 0.0})
    assert _Problem(runs, conditions, at_zero, 1, "a100-80gb", {}).most[RATES.index("intra_node_latency_us")] == 0.0


def test_calibrate_reports_errors_before_after_and_cross_validated(conditions, tmp_path):
    seconds = _truth_seconds(conditions)
    rows = tmp_path / "runs.csv"
    rows.write_text(HEADER + "\n")
    (tmp_path / "conditions.yaml").write_text(CONDITIONS)
    calibration = calibrate_runs(_runs(seconds), conditions, rows_file=rows, conditions_file=tmp_path / "conditions.yaml",
                                 folds=3)  # fmt: skip
    assert calibration.rows == len(LAYOUTS) and calibration.folds == 3
    assert calibration.before.mape > 0.1
    assert calibration.after.max_abs_error < 0.01
    # Held-out rows are predicted by terms fitted without them: close, not exact.
    assert calibration.cross_validated.rows == len(LAYOUTS)
    assert calibration.after.mape <= calibration.cross_validated.mape < 0.05


def test_calibrate_refuses_rows_it_cannot_predict(conditions, tmp_path):
    """Rows whose layouts the planner cannot run (t = 32 over 16 heads) leave nothing to fit to."""
    runs = [
        MeasuredRun(line=i + 2, gpus=32, global_batch=32, micro_batch=1, hidden=1024, heads=16, layers=12, seq_len=1024,
                    tensor_parallel=32, data_parallel=1, pipeline_parallel=1, measured_seconds=0.1)
        for i in range(10)
    ]  # fmt: skip
    (tmp_path / "runs.csv").write_text(HEADER + "\n")
    (tmp_path / "conditions.yaml").write_text(CONDITIONS)
    with pytest.raises(UserInputError, match=r"only 0 of 10 rows can be predicted: calibrate needs 8 or more \(line 2: "):
        calibrate_runs(runs, conditions, rows_file=tmp_path / "runs.csv", conditions_file=tmp_path / "conditions.yaml",
                       folds=None)  # fmt: skip


def pipectl(cwd, *args):
    return subprocess.run([sys.executable, "-m", "pipectl", *args], cwd=cwd, capture_output=True, text=True, timeout=600)


def _write_measured(folder: Path, conditions) -> Path:
    seconds = _truth_seconds(conditions)
    lines = [HEADER] + [
        f"{g},{B},{b},{h},16,{layers},1024,{t},{d},{p},{s * 1e3:.4f}"
        for (g, B, b, h, layers, t, d, p), s in zip(LAYOUTS, seconds)
    ]
    (folder / "runs.csv").write_text("\n".join(lines) + "\n")
    (folder / "conditions.yaml").write_text(CONDITIONS)
    return folder


@pytest.fixture()
def measured(tmp_path, conditions):
    return _write_measured(tmp_path, conditions)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory, conditions) -> dict:
    """One calibration fitted by the CLI, for the tests that only hand one on (a fit is seconds)."""
    folder = _write_measured(tmp_path_factory.mktemp("fitted"), conditions)
    assert pipectl(folder, "calibrate", "runs.csv", "-c", "conditions.yaml", "--folds", "0", "-o", "cal.json").returncode == 0
    return json.loads((folder / "cal.json").read_text())


def test_calibrate_then_validate_with_it_from_a_working_directory(measured):
    # A row the model cannot predict (a pipeline deeper than the model) is named and left out, not
    # counted: it used to be dropped from the fit without a word while the counts included it.
    with open(measured / "runs.csv", "a") as rows:
        rows.write("8,32,4,1024,16,2,1024,1,1,8,120.0\n")
    # A name with brackets is printed as given (not read as markup, which named another file).
    result = pipectl(measured, "calibrate", "runs.csv", "--conditions", "conditions.yaml", "--folds", "0", "-o", "cal[v2].json")
    assert result.returncode == 0, result.stderr
    assert "wrote cal[v2].json" in result.stdout
    (measured / "cal[v2].json").rename(measured / "cal.json")
    assert f"line {len(LAYOUTS) + 2}: left out, not predicted: pipeline-parallel degree 8 exceeds" in result.stderr, result.stderr
    assert f"fitting {len(TERMS)} terms to {len(LAYOUTS)} rows" in result.stderr
    calibration = json.loads((measured / "cal.json").read_text())
    assert calibration["rows_file"] == "runs.csv" and calibration["cross_validated"] is None
    assert calibration["rows"] == calibration["before"]["rows"] == calibration["after"]["rows"] == len(LAYOUTS)
    # Two folds of 12 rows fit to 6 rows each, fewer than a fit needs (refused before, for the whole set).
    folds = pipectl(measured, "calibrate", "runs.csv", "-c", "conditions.yaml", "--folds", "2", "-o", "x.json")
    said = " ".join(folds.stderr.split())
    assert folds.returncode == 2 and "the rows the other folds hold, 8 or more, of 12 predicted rows" in said, said
    assert "use 3 to 6, or 0 for none" in said
    plain = pipectl(measured, "validate", "runs.csv", "-c", "conditions.yaml", "--json")
    fitted = pipectl(measured, "validate", "runs.csv", "-c", "conditions.yaml", "--calibration", "cal.json", "--json")
    assert plain.returncode == 0 and fitted.returncode == 0, plain.stderr + fitted.stderr
    before, after = json.loads(plain.stdout)["summary"], json.loads(fitted.stdout)["summary"]
    assert after["max_abs_error"] < 0.01 < before["max_abs_error"]
    assert after["max_abs_error"] == pytest.approx(calibration["after"]["max_abs_error"], abs=1e-6)


def test_a_fit_worse_on_the_rows_held_out_than_no_fit_says_so(measured, monkeypatch):
    """Cross-validation that predicts the held-out rows worse than the uncalibrated terms means the
    rows do not tell the terms apart: the user is warned, with both figures (the fit itself stood
    in by a calibration whose figures say so)."""
    from typer.testing import CliRunner

    from pipectl.artifacts.calibration import RunsCalibration
    from pipectl.cli.main import app

    terms = starting_terms(load_conditions(measured / "conditions.yaml")).model_dump()

    def errors(mape):
        return {"rows": 12, "median_abs_error": mape, "mape": mape, "max_abs_error": 2 * mape, "signed_median_error": 0.0}

    def calibration(held_out_mape):
        return RunsCalibration.model_validate({
            "device": "a100-80gb", "framework": "megatron-deepspeed", "rows_file": "runs.csv", "rows_sha256": "0" * 64,
            "conditions_sha256": "0" * 64, "rows": 12, "uncalibrated": terms, "terms": terms, "before": errors(0.1),
            "after": errors(0.02), "folds": 3, "cross_validated": errors(held_out_mape),
        })  # fmt: skip

    monkeypatch.chdir(measured)
    for held_out_mape, warned in ((0.2, True), (0.05, False)):
        monkeypatch.setattr("pipectl.measured.calibrate.calibrate_runs", lambda *a, **k: calibration(held_out_mape))
        result = CliRunner().invoke(app, ["calibrate", "runs.csv", "-c", "conditions.yaml", "-o", "cal.json"])
        assert result.exit_code == 0 and (measured / "cal.json").is_file(), result.output
        said = " ".join(result.output.split())
        assert ("warning: fitted on some rows, the terms predict the rows held out worse than uncalibrated "
                "(MAPE 10.0% -> 20.0%)" in said) is warned, said  # fmt: skip
        # --json: the warning is in the JSON (and said on stderr), not dropped.
        result = CliRunner().invoke(app, ["calibrate", "runs.csv", "-c", "conditions.yaml", "-o", "cal.json", "--json"])
        assert result.exit_code == 0, result.output
        warnings = json.loads(result.stdout)["warnings"]
        assert (len(warnings) == 1 and "held out worse than uncalibrated (MAPE 10.0% -> 20.0%)" in warnings[0]) is warned
        assert ("held out worse" in " ".join(result.stderr.split())) is warned


@pytest.mark.parametrize(
    "args, message",
    [
        (["calibrate", "runs.csv"], "needs --conditions"),
        (["calibrate", "runs.csv", "-c", "conditions.yaml", "--folds", "9"], "--folds 9"),
        (["calibrate", ".", "-c", "conditions.yaml"], "--conditions goes with a CSV"),
        (["calibrate", "measured", "-c", "conditions.yaml"], "measured: no such file"),
        (["calibrate", "seconds.csv", "-c", "conditions.yaml"], "is the column 'iteration time (ms)' in milliseconds?"),
        (["calibrate", "runs.csv", "-c", "conditions.yaml", "-o", "/proc/cal.json"], "/proc does not take new files"),
        (["calibrate", "runs.csv", "-c", "conditions.yaml", "-o", "runs.csv"], "-o runs.csv is the measured runs"),
        (["validate", "runs.csv", "-c", "conditions.yaml", "--calibration", "other.json"], "fitted to megatron-lm runs"),
        (["validate", "runs.csv", "-c", "conditions.yaml", "--calibration", "h100.json"],
         "--calibration h100.json was fitted to h100-80gb runs, and no row ran on one"),
    ],
)
def test_calibrate_refuses_in_one_line(measured, args, message):
    other = {"schema_version": 1, "device": "a100-80gb", "framework": "megatron-lm", "rows_file": "x.csv",
             "rows_sha256": "0" * 64, "conditions_sha256": "0" * 64, "rows": 10}  # fmt: skip
    terms = starting_terms(load_conditions(measured / "conditions.yaml")).model_dump()
    errors = {"rows": 10, "median_abs_error": 0.1, "mape": 0.1, "max_abs_error": 0.2, "signed_median_error": 0.0}
    other.update(uncalibrated=terms, terms=terms, before=errors, after=errors)
    (measured / "other.json").write_text(json.dumps(other))
    (measured / "h100.json").write_text(json.dumps({**other, "framework": "megatron-deepspeed", "device": "h100-80gb"}))
    # The rows' times written in seconds under the header that says milliseconds: every term would go to a bound.
    header, *rows = (measured / "runs.csv").read_text().splitlines()
    in_seconds = [",".join([*row.split(",")[:-1], str(float(row.split(",")[-1]) / 1e3)]) for row in rows]
    (measured / "seconds.csv").write_text("\n".join([header, *in_seconds]) + "\n")
    result = pipectl(measured, *args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not Path(measured / "calibration.json").exists()


def test_a_calibration_prices_a_derived_profile_a_plan_and_its_simulation(measured):
    """calibrate, then the device figures into a derived profile and the links into a plan, which
    simulate (from another directory) prices as the plan did."""
    assert pipectl(measured, "calibrate", "runs.csv", "-c", "conditions.yaml", "--folds", "0", "-o", "cal.json").returncode == 0
    assert pipectl(measured, "profile", "gpt-tiny", "--derive", "--device", "a100-80gb", "-o", "plain.json").returncode == 0
    refused = pipectl(measured, "plan", "--profile", "plain.json", "--cluster", "a100-8x8", "--global-batch", "64",
                      "--calibration", "cal.json", "-o", "plan.json")  # fmt: skip
    assert refused.returncode == 2 and "derived for a100-80gb with the catalog's figures" in refused.stderr
    derived = pipectl(measured, "profile", "gpt-tiny", "--derive", "--device", "a100-80gb", "--calibration", "cal.json",
                      "-o", "calibrated.json", "--json")  # fmt: skip
    assert derived.returncode == 0, derived.stderr
    profile = json.loads((measured / "calibrated.json").read_text())
    assert "device figures calibrated by cal.json" in profile["notes"][-1] and "wave quantization" in profile["notes"][-1]
    plain = json.loads((measured / "plain.json").read_text())
    forward = lambda p: p["layers"][1]["costs"][0]["forward_seconds"]  # noqa: E731
    assert forward(profile) != forward(plain)  # the fitted kernel figures, not the catalog's
    # Neither mix prices one plan with two views of the GPU: the calibrated profile without its links,
    # nor a calibration on a cluster without its device (which changed nothing, without a word).
    alone = pipectl(measured, "plan", "--profile", "calibrated.json", "--cluster", "a100-8x8", "--global-batch", "64",
                    "-o", "plan.json")  # fmt: skip
    assert alone.returncode == 2 and "derived for a100-80gb with a calibration" in alone.stderr, alone.stderr
    elsewhere_device = pipectl(measured, "plan", "--profile", "calibrated.json", "--cluster", "local", "--global-batch",
                               "64", "--calibration", "cal.json", "-o", "plan.json")  # fmt: skip
    assert elsewhere_device.returncode == 2 and "cluster 'local' has no a100-80gb" in elsewhere_device.stderr
    assert "--calibration cal.json was fitted to a100-80gb runs" in elsewhere_device.stderr
    # Given by a config file, the refusal names the file's key, not a flag the user never typed.
    (measured / "plan.toml").write_text('[model]\nprofile = "calibrated.json"\n[cluster]\nname = "local"\n'
                                        'calibration = "cal.json"\n[training]\nglobal_batch = 64\n')
    configured = pipectl(measured, "plan", "--config", "plan.toml", "-o", "plan.json")
    said = " ".join(configured.stderr.split())
    assert configured.returncode == 2 and "--calibration" not in said, said
    assert f"plan.toml [cluster] calibration = '{measured / 'cal.json'}' was fitted to a100-80gb runs" in said, said
    planned = pipectl(measured, "plan", "--profile", "calibrated.json", "--cluster", "a100-8x8", "--global-batch", "64",
                      "--calibration", "cal.json", "-o", "plan.json")  # fmt: skip
    assert planned.returncode == 0, planned.stderr
    assert f"priced with the a100-80gb links of cal.json (fitted to {len(LAYOUTS)} megatron-deepspeed runs)" in planned.stdout
    plan = json.loads((measured / "plan.json").read_text())
    assert plan["calibration_file"] == str(measured / "cal.json")
    elsewhere = measured / "elsewhere"
    elsewhere.mkdir()
    simulated = pipectl(elsewhere, "simulate", "../plan.json", "--json")
    assert simulated.returncode == 0, simulated.stderr
    step = json.loads(simulated.stdout)["step_seconds"]
    assert step == pytest.approx(plan["chosen"]["predicted_step_seconds"], rel=1e-6)
    assert "note" not in json.loads(simulated.stdout)
    # Its own cluster named again: still with the calibration it was planned with.
    named = pipectl(elsewhere, "simulate", "../plan.json", "--cluster", "a100-8x8", "--json")
    assert named.returncode == 0 and json.loads(named.stdout)["step_seconds"] == pytest.approx(step, rel=1e-9), named.stderr
    # A profile derived without the calibration, priced with the plan's calibrated links: refused, as plan refuses it.
    mixed = pipectl(elsewhere, "simulate", "../plan.json", "--profile", "../plain.json")
    assert mixed.returncode == 2 and "derived for a100-80gb with the catalog's figures" in mixed.stderr, mixed.stderr
    (measured / "cal.json").rename(measured / "cal.json.bak")  # gone: the plan's copy prices it the same
    simulated = pipectl(elsewhere, "simulate", "../plan.json", "--json")
    assert simulated.returncode == 0, simulated.stderr
    assert json.loads(simulated.stdout)["step_seconds"] == step and "note" not in json.loads(simulated.stdout)
    # A config printed now names the file (a re-plan reads it) and says it is gone, on stderr.
    printed = pipectl(elsewhere, "launch", "../plan.json", "--print-config")
    assert printed.returncode == 0 and f"calibration = \"{measured / 'cal.json'}\"" in printed.stdout, printed.stderr
    said = " ".join(printed.stderr.split())
    assert f"warning: [cluster] calibration {measured / 'cal.json'} is no longer there; `pipectl plan --config` of " \
           "this file will need it back" in said, said
    # Replaced by another fit: priced as it stands, and said so (the figures differ from the plan's).
    other = json.loads((measured / "cal.json.bak").read_text())
    other["rows_file"] = "other-runs.csv"
    (measured / "cal.json").write_text(json.dumps(other))
    simulated = pipectl(elsewhere, "simulate", "../plan.json", "--json")
    assert json.loads(simulated.stdout)["note"] == f"{measured / 'cal.json'} changed since planning: priced as it is now"


@pytest.mark.parametrize(
    "args, message",
    [
        (["profile", "gpt-tiny", "--calibration", "cal.json", "-o", "p.json"], "--calibration applies to --derive only"),
        (["profile", "gpt-tiny", "--derive", "--device", "h100-80gb", "--calibration", "cal.json", "-o", "p.json"],
         "cal.json calibrates a100-80gb, not h100-80gb"),
        (["profile", "gpt-tiny", "--derive", "--device", "a100-80gb", "--calibration", "runs.csv", "-o", "p.json"],
         "runs.csv"),
        # A device without kernel-model figures: the calibration's would replace nothing the derivation reads.
        (["profile", "gpt-tiny", "--derive", "--device", "t4", "--calibration", "t4.json", "-o", "p.json"],
         "t4.json calibrates t4, which has no kernel-model figures"),
        # A hand-edited term no fit can reach: refused naming it, not a traceback later in plan.
        (["profile", "gpt-tiny", "--derive", "--device", "a100-80gb", "--calibration", "slow.json", "-o", "p.json"],
         "gemm_efficiency"),
    ],
)
def test_profile_refuses_a_calibration_it_cannot_use(measured, fitted, args, message):
    calibration = fitted
    (measured / "cal.json").write_text(json.dumps(calibration))
    (measured / "t4.json").write_text(json.dumps({**calibration, "device": "t4"}))
    slow = {**calibration, "terms": {**calibration["terms"], "gemm_efficiency": 1e-9}}
    (measured / "slow.json").write_text(json.dumps(slow))
    result = pipectl(measured, *args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not (measured / "p.json").exists()


def test_a_calibration_fitted_before_the_wave_quantization_term_prices_as_it_did(conditions, tmp_path):
    """A calibration.json without `wave_quantization` (written before the term) loads, reads as the
    model's whole waves, and derives the same profile as its terms with the share set to 1."""
    from pipectl.catalog import get_device
    from pipectl.measured.runs import load_calibration
    from pipectl.models.registry import load_model_config
    from pipectl.profile.derive import derive_profile

    terms = starting_terms(conditions).model_copy(update={"gemm_efficiency": 0.7, "kernel_overhead_us": 55.0})
    old = terms.model_dump()
    del old["wave_quantization"]
    errors = {"rows": 12, "median_abs_error": 0.1, "mape": 0.1, "max_abs_error": 0.2, "signed_median_error": 0.0}
    (tmp_path / "old.json").write_text(json.dumps({
        "schema_version": 1, "device": "a100-80gb", "framework": "megatron-deepspeed", "rows_file": "runs.csv",
        "rows_sha256": "0" * 64, "conditions_sha256": "0" * 64, "rows": 12, "uncalibrated": old, "terms": old,
        "before": errors, "after": errors}))  # fmt: skip
    loaded = load_calibration(tmp_path / "old.json", conditions)
    assert loaded.terms.wave_quantization == 1.0
    a100, config = get_device("a100-80gb"), load_model_config("gpt-small")  # gpt-tiny's GEMMs wait on the host
    derived = derive_profile(config, loaded.terms.device_spec(a100), [1, 4])
    explicit = derive_profile(config, terms.model_copy(update={"wave_quantization": 1.0}).device_spec(a100), [1, 4])
    recovered = derive_profile(config, terms.model_copy(update={"wave_quantization": 0.5}).device_spec(a100), [1, 4])
    assert derived.layers == explicit.layers != recovered.layers


def test_rows_of_another_device_start_and_stop_at_that_devices_figures(conditions, tmp_path):
    """Rows that ran on H100s (a 'device' column) under conditions that name the A100: the fit starts
    from the H100's catalog figures and is bounded by what an H100 can have, not the A100's."""
    from pipectl.catalog import get_device

    h100 = get_device("h100-80gb")
    start = starting_terms(conditions, "h100-80gb")
    assert start.memory_bandwidth_gbytes_per_second == h100.memory_bandwidth_gbytes_per_second
    assert start.gemm_efficiency == h100.gemm_efficiency
    assert ceilings(conditions, start, "h100-80gb")["gemm_efficiency"] == min(h100.gemm_efficiency_best or 1.0, 1.0)
    runs = [replace(run, device="h100-80gb", measured_seconds=0.2) for run in _runs()]
    (tmp_path / "r.csv").write_text(HEADER + "\n")
    calibration = calibrate_runs(runs, conditions, rows_file=tmp_path / "r.csv", conditions_file=tmp_path / "r.csv", folds=0)
    assert calibration.device == "h100-80gb"
    assert calibration.uncalibrated == start


def test_a_pipe_is_calibrated_and_hashed_as_read(measured):
    """`calibrate <(...) -c <(...)`: the pipes are read once; the calibration records the hashes of
    what was read (not of the emptied pipe)."""
    import hashlib
    import shutil

    if shutil.which("bash") is None:
        pytest.skip("needs bash for process substitution")
    command = f"{sys.executable} -m pipectl calibrate <(cat runs.csv) -c <(cat conditions.yaml) --folds 0 -o p.json"
    result = subprocess.run(["bash", "-c", command], cwd=measured, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    calibration = json.loads((measured / "p.json").read_text())
    assert calibration["conditions_sha256"] == hashlib.sha256((measured / "conditions.yaml").read_bytes()).hexdigest()
    assert calibration["rows_sha256"] == hashlib.sha256((measured / "runs.csv").read_bytes()).hexdigest()
    assert calibration["rows_file"].startswith("/dev/fd/")


def test_too_few_rows_and_fewer_rows_than_terms_are_said_as_they_are(measured):
    """5 rows were refused as unable to 'tell 10 terms apart', then 9 rows fitted the 10 terms: the
    refusal says how many rows a fit needs, and a fit of fewer rows than terms says what it does."""
    lines = (measured / "runs.csv").read_text().splitlines()
    (measured / "five.csv").write_text("\n".join(lines[:6]) + "\n")
    (measured / "nine.csv").write_text("\n".join(lines[:10]) + "\n")
    five = pipectl(measured, "calibrate", "five.csv", "-c", "conditions.yaml", "--folds", "0", "-o", "five.json")
    assert five.returncode == 2 and "calibrate needs 8 rows or more to fit to, not 5" in five.stderr, five.stderr
    nine = pipectl(measured, "calibrate", "nine.csv", "-c", "conditions.yaml", "--folds", "0", "-o", "nine.json")
    assert nine.returncode == 0, nine.stderr
    assert f"fitting {len(TERMS)} terms to 9 rows (fewer rows than terms: those the rows cannot tell apart stay near " \
           "the device's figures)" in " ".join(nine.stderr.split())

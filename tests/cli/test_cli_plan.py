"""`pipectl plan` end to end: writes plan.json, prints the table, names bad input, exit codes."""

from __future__ import annotations

from pathlib import Path

import json

import pytest
from typer.testing import CliRunner

from pipectl.artifacts.plan import Candidate, Plan
from pipectl.cli.main import app
from pipectl.io import load_model, write_json_atomic
from pipectl.testing.profiles import synthetic_profile

runner = CliRunner()


@pytest.fixture()
def profile_path(tmp_path):
    path = tmp_path / "profile.json"
    write_json_atomic(path, synthetic_profile(blocks=6, micro_batch_sizes=[1, 2, 4], device="cpu"))
    return path


def test_plan_writes_plan_json_and_prints_a_table(profile_path, tmp_path):
    out = tmp_path / "plan.json"
    result = runner.invoke(app, ["plan", "--profile", str(profile_path), "--cluster", "local", "--devices", "4",
                                 "--global-batch", "16", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "chosen:" in result.output and "morph table" in result.output
    written = load_model(Plan, out)
    assert written.global_batch == 16 and written.chosen.global_batch == 16
    assert [e.devices for e in written.morph_table][-1] == 4


def test_the_profile_a_plan_was_made_from_is_recorded_by_its_absolute_path(profile_path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["plan", "--profile", "profile.json", "--cluster", "local", "--devices", "2",
                                 "--global-batch", "8", "-o", "plan.json"])
    assert result.exit_code == 0, result.output
    assert load_model(Plan, tmp_path / "plan.json").profile.source == str(profile_path.resolve())


def test_plan_json_output(profile_path, tmp_path):
    result = runner.invoke(app, ["plan", "--profile", str(profile_path), "--cluster", "a100-8x8",
                                 "--global-batch", "32", "--json", "--no-morph", "-o", str(tmp_path / "p.json")])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert Candidate.model_validate(data["chosen"]).global_batch == 32
    # Beside the plan: the chosen candidate's predicted MFU and HFU (the synthetic model has no
    # config: its profile's FLOP counts), against 8 x 8 A100s' bf16 peak at most.
    flops = data.pop("flops")
    assert flops["source"] == "profile" and flops["dtype"] == "bfloat16"
    assert 0 < flops["mfu"] <= flops["hfu"] < 1
    assert flops["peak_flops_per_second"] == data["chosen"]["devices"] * 312e12
    assert Plan.model_validate(data) == load_model(Plan, tmp_path / "p.json")


def test_plan_shows_predicted_mfu_and_hfu(profile_path, tmp_path):
    result = runner.invoke(app, ["plan", "--profile", str(profile_path), "--cluster", "a100-8x8",
                                 "--global-batch", "32", "--no-morph", "-o", str(tmp_path / "p.json")])
    assert result.exit_code == 0, result.output
    header = next(line for line in result.output.splitlines() if "samp/s" in line)
    assert "MFU" in header.split()
    line = " ".join(result.output[result.output.index("FLOPs: MFU"):].split())
    assert " TFLOP/s bfloat16; model FLOPs from the derived profile's counts" in line


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--global-batch", "0"], "--global-batch 0: Input should be greater than 0"),
        (["--global-batch", "16", "--schedules", "1f1b,zigzag"], "unknown schedule 'zigzag'"),
        # The layers counted as the profile has them (a user counts the blocks), and said so.
        (["--global-batch", "16", "--pipeline-parallel", "50"], "pipeline-parallel degree 50 exceeds the model's 9 "
         "layers (6 transformer blocks, embedding, layer_norm, lm_head): each stage needs one at least"),
        (["--global-batch", "16", "--data-parallel", "3", "--even-replicas"], "not divisible by data-parallel degree 3"),
        (["--global-batch", "16", "--data-parallel", "17"], "data-parallel degree 17 is more than"),
        (["--global-batch", "16", "--objective", "cost-deadline"], "deadline"),
        (["--global-batch", "16", "--recompute", "sometimes"], "unknown --recompute 'sometimes'"),
        (["--global-batch", "16", "--recompute", "layer", "--no-recompute"], "--no-recompute contradicts --recompute layer"),
        (["--global-batch", "16", "--top", "-1"], "--top -1: Input should be greater than or equal to 0"),
        (["--global-batch", "16", "--morph-counts", "1,3-4"], "--morph-counts 1,3-4: the plan is for 2 devices of this machine, not 3"),
    ],
)
def test_bad_input_exits_2_naming_the_value(profile_path, tmp_path, extra, message):
    result = runner.invoke(app, ["plan", "--profile", str(profile_path), "--cluster", "local", "--devices", "2",
                                 "-o", str(tmp_path / "p.json"), *extra])
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output


def test_nothing_feasible_exits_2_with_reasons(tmp_path):
    path = tmp_path / "huge.json"
    write_json_atomic(path, synthetic_profile(blocks=2, hidden=16384, seq_len=2048, vocab=1000, device="cpu",
                                              micro_batch_sizes=[1]))
    result = runner.invoke(app, ["plan", "--profile", str(path), "--cluster", "local", "--devices", "2",
                                 "--global-batch", "4", "-o", str(tmp_path / "p.json")])
    assert result.exit_code == 2
    assert "nothing fits" in result.output and "memory" in result.output


def test_missing_profile_is_a_user_error(tmp_path):
    result = runner.invoke(app, ["plan", "--profile", str(tmp_path / "nope.json"), "--cluster", "local",
                                 "--global-batch", "4", "-o", str(tmp_path / "p.json")])
    assert result.exit_code == 2
    assert "not found" in result.output


def plan_args(profile: Path, output: Path) -> list[str]:
    return ["plan", "--profile", str(profile), "--cluster", "local", "--global-batch", "4", "-o", str(output)]


def test_output_that_is_an_input_or_a_runs_own_file_is_refused_and_left_alone(profile_path, tmp_path):
    before = profile_path.read_bytes()
    result = runner.invoke(app, plan_args(profile_path, profile_path))
    assert result.exit_code == 2 and "is the --profile" in result.output and "this command reads" in result.output
    assert profile_path.read_bytes() == before
    run = tmp_path / "run"
    run.mkdir()
    (run / "job.json").write_text("{}")
    for name in ("job.json", "plan.json", "metrics.jsonl", "profile-0123456789ab.json"):
        result = runner.invoke(app, plan_args(profile_path, run / name))
        assert result.exit_code == 2 and f"is a file of the run in {run}" in result.output, name
    assert sorted(p.name for p in run.iterdir()) == ["job.json"]
    assert runner.invoke(app, plan_args(profile_path, run / "another-plan.json")).exit_code == 0


def test_an_output_named_as_the_plans_profile_copy_or_its_model_config_is_refused(profile_path, tmp_path):
    """-o profile-<sha>.json wrote the profile copy, then the plan over it (the plan and every plan
    beside it broken); -o mine.yaml replaced the model config launch builds the model from."""
    from pipectl.io import sha256_file
    from pipectl.planfile import profile_copy_name

    copy = tmp_path / profile_copy_name(sha256_file(profile_path))
    result = runner.invoke(app, plan_args(profile_path, copy))
    assert result.exit_code == 2 and "is the name of the profile copy the plan keeps beside itself" in result.output
    assert not copy.exists()
    model = tmp_path / "mine.yaml"
    model.write_text("name: mine\n")
    profiled = tmp_path / "mine-profile.json"
    profiled.write_text(json.dumps({**json.loads(profile_path.read_text()), "model_reference": str(model)}))
    result = runner.invoke(app, plan_args(profiled, model))
    assert result.exit_code == 2 and f"-o {model} is the model {profiled} was profiled from" in result.output
    assert model.read_text() == "name: mine\n"


@pytest.mark.parametrize("flags, said", [
    (["--objective", "cost-deadline", "--deadline-hours", "1", "--tokens", "1B", "--samples", "5"],
     "--samples 5 and --tokens 1B both say how much to train on: give one"),
    (["--deadline-hours", "1"], "--deadline-hours 1 is for the cost-deadline objective, but the objective is time"),
    (["--objective", "cost", "--tokens", "1B"], "--tokens 1B is for the cost-deadline objective, but the objective is cost"),
    (["--no-morph", "--morph-table"], "--morph-table prints the morph table, which --no-morph skips"),
])  # fmt: skip
def test_a_value_another_makes_meaningless_is_refused_not_ignored(profile_path, tmp_path, flags, said):
    result = runner.invoke(app, [*plan_args(profile_path, tmp_path / "plan.json"), *flags])
    assert result.exit_code == 2 and said in result.output, result.output
    assert not (tmp_path / "plan.json").exists()


def test_an_output_the_system_refuses_is_named_without_a_traceback(profile_path, tmp_path):
    result = runner.invoke(app, plan_args(profile_path, Path("/proc/pipectl-plan.json")))
    # Refused before the search whose result it would hold.
    assert result.exit_code == 2 and "cannot write output /proc/pipectl-plan.json: /proc does not take new files" in result.output
    assert "Traceback" not in result.output and ".tmp" not in result.output
    long_name = tmp_path / ("a" * 300 + ".json")
    result = runner.invoke(app, plan_args(long_name, tmp_path / "p.json"))
    assert result.exit_code == 2 and "File name too long" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("objective, best", [("time", "fastest"), ("cost", "cheapest")])
def test_note_on_an_engine_the_best_cannot_run_names_the_objective(profile_path, tmp_path, objective, best):
    """Interleaved is the best by either objective here, and DeepSpeed cannot run it."""
    out = tmp_path / "plan.json"
    result = runner.invoke(app, ["plan", "--profile", str(profile_path), "--cluster", "a100-8x8", "--global-batch", "32",
                                 "--objective", objective, "--pipeline-parallel", "2", "--data-parallel", "1",
                                 "--tensor-parallel", "1", "--schedules", "1f1b,interleaved", "--no-morph",
                                 "-o", str(out)])
    assert result.exit_code == 0, result.output
    plan = load_model(Plan, out)
    best_overall = plan.candidates[0]
    assert not best_overall.deepspeed_runnable and plan.chosen.deepspeed_runnable
    note = next(n for n in plan.notes if "which DeepSpeed cannot run" in n)
    assert note.startswith(f"{best} overall is ") and note.endswith(f"chose the {best} DeepSpeed-runnable candidate")
    other = {"fastest": "cheapest", "cheapest": "fastest"}[best]
    assert other not in note
    if objective == "cost":
        assert f"${best_overall.cost_per_million_samples:,.2f} per 1M samples" in note


@pytest.mark.parametrize(
    "text, expected",
    [("300B", 300 * 10**9), ("300b", 300 * 10**9), ("1.5T", 1_500_000_000_000), ("0.3B", 300_000_000),
     ("150M", 150_000_000), ("12K", 12_000), ("3e11", 300 * 10**9), ("300000000000", 300 * 10**9)],
)
def test_amounts_take_decimal_suffixes(text, expected):
    from pipectl.cli.plan import parse_amount

    assert parse_amount(text, "--tokens") == expected


def test_tokens_with_a_suffix_reach_the_plan(profile_path, tmp_path):
    out = tmp_path / "plan.json"
    result = runner.invoke(app, ["plan", "--profile", str(profile_path), "--cluster", "a100-8x8", "--global-batch", "32",
                                 "--objective", "cost-deadline", "--deadline-hours", "24", "--tokens", "300B",
                                 "--no-morph", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert load_model(Plan, out).request.tokens == 300 * 10**9


@pytest.mark.parametrize(
    "text, message",
    [("300X", "--tokens '300X' is not a number"), ("3BB", "--tokens '3BB' is not a number"), ("0.0005K", "positive whole number, got 0.0005K"),
     ("1.5", "positive whole number, got 1.5"), ("-3B", "positive whole number, got -3B"),
     ("1e999999999", "does not fit a 64-bit integer"), ("inf", "positive whole number, got inf")],
)
def test_bad_amounts_are_named(profile_path, tmp_path, text, message):
    result = runner.invoke(app, ["plan", "--profile", str(profile_path), "--cluster", "a100-8x8", "--global-batch", "32",
                                 "--objective", "cost-deadline", "--deadline-hours", "24", "--tokens", text,
                                 "-o", str(tmp_path / "p.json")])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


def _two_kind_cluster(tmp_path):
    """One node of 4 V100-32GB and one of 4 V100-16GB: the same peak FLOP/s, so only a profile
    per kind can tell that one kind is slower."""
    path = tmp_path / "two-kinds.yaml"
    path.write_text(
        "schema_version: 1\nname: two-kinds\nnode_types:\n"
        "  - {name: big, device: v100-32gb, devices_per_node: 4, nodes: 1}\n"
        "  - {name: small, device: v100-16gb, devices_per_node: 4, nodes: 1}\n"
    )
    return path


def _kind_profile(tmp_path, device, seconds, **fields):
    path = tmp_path / f"{device}.json"
    write_json_atomic(path, synthetic_profile(blocks=4, micro_batch_sizes=[1, 2, 4], device=device, dtype="float16",
                                              block_forward_seconds=seconds, **fields))
    return path


def test_a_profile_per_kind_prices_each_kind_and_travels_with_the_plan(tmp_path):
    cluster = _two_kind_cluster(tmp_path)
    big = _kind_profile(tmp_path, "v100-32gb", 0.01)
    small = _kind_profile(tmp_path, "v100-16gb", 0.03)  # three times as slow, by the workload
    common = ["--cluster", str(cluster), "--global-batch", "64", "--micro-batch-size", "1", "--no-morph",
              "--pipeline-parallel", "1", "--tensor-parallel", "1"]
    alone = runner.invoke(app, ["plan", "--profile", str(big), *common, "-o", str(tmp_path / "alone" / "plan.json")])
    both = runner.invoke(app, ["plan", "--profile", str(big), "--profile", str(small), *common,
                               "-o", str(tmp_path / "both" / "plan.json")])
    assert alone.exit_code == 0 and both.exit_code == 0, alone.output + both.output

    def samples(folder):
        plan = load_model(Plan, tmp_path / folder / "plan.json")
        shares = {}
        for share in plan.chosen.replicas:
            shares[share.device] = shares.get(share.device, 0) + share.samples
        return plan, shares

    plan, even = samples("alone")  # the V100-32GB profile serves both kinds: equal peaks, equal shares
    assert even == {"v100-32gb": 32, "v100-16gb": 32} and plan.kind_profiles == []
    assert any("v100-16gb: the v100-32gb profile scaled by the ratio of peak FLOP/s" in n for n in plan.notes)
    plan, shares = samples("both")
    assert shares["v100-32gb"] > 2 * shares["v100-16gb"]
    assert any("v100-16gb: its own derived profile" in n for n in plan.notes)
    [ref] = plan.kind_profiles
    assert (tmp_path / "both" / ref.file).is_file() and ref.source == str(small)


@pytest.mark.parametrize(
    "second, message",
    [
        (dict(device="v100-32gb"), "are both profiles on v100-32gb"),
        (dict(device="v100-16gb", blocks=5), "is a profile of another model"),
        (dict(device="v100-16gb", dtype="bfloat16"), "one job trains in one precision"),
    ],
)
def test_profiles_given_together_must_be_one_model_on_distinct_kinds(tmp_path, second, message):
    cluster = _two_kind_cluster(tmp_path)
    first = _kind_profile(tmp_path, "v100-32gb", 0.01)
    path = tmp_path / "second" / "profile.json"
    fields = dict(blocks=4, micro_batch_sizes=[1, 2, 4], dtype="float16") | second
    write_json_atomic(path, synthetic_profile(**fields))
    result = runner.invoke(app, ["plan", "--profile", str(first), "--profile", str(path), "--cluster", str(cluster),
                                 "--global-batch", "64", "-o", str(tmp_path / "plan.json")])
    assert result.exit_code == 2 and message in result.output, result.output
    assert not (tmp_path / "plan.json").exists()


def test_zero3_row_is_shown_after_the_top_with_its_predicted_step(tmp_path):
    # 19.4 B parameters without tensor parallelism: ZeRO-1 does not fit at p = 1 on an A100-80GB,
    # ZeRO-3 does, and the runtime trains it there (DeepSpeed's ordinary engine); a pipeline is
    # faster, so it is chosen and the ZeRO-3 row is kept after the top, unflagged.
    path = tmp_path / "profile.json"
    write_json_atomic(path, synthetic_profile(blocks=24, micro_batch_sizes=[1, 2], hidden=8192, seq_len=256))
    out = tmp_path / "plan.json"
    result = runner.invoke(app, ["plan", "--profile", str(path), "--cluster", "a100-8x8", "--global-batch", "64",
                                 "--zero-stages", "1,3", "--max-tensor-parallel", "1", "--no-morph", "--top", "3",
                                 "-o", str(out)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    plan = load_model(Plan, out)
    row = next(c for c in plan.candidates if c.zero_stage == 3)
    assert plan.candidates[-1] == row and row.pipeline_parallel == 1 and row.deepspeed_runnable  # after the top
    header = next(line for line in result.output.splitlines() if "samp/s" in line)
    assert "Z" in header.split()
    from pipectl.report.plan_table import format_step

    shown = next(line for line in result.output.splitlines() if line.startswith(f"1·1·{row.data_parallel} "))
    assert "1f1b " in shown and "1f1b*" not in shown and format_step(row.predicted_step_seconds) in shown
    assert "* ZeRO-3:" not in result.output
    assert plan.chosen.zero_stage == 1 and plan.chosen.pipeline_parallel > 1


def test_2bw_listed_is_priced_in_steady_state_marked_and_chosen_only_with_any_engine(profile_path, tmp_path):
    # PipeDream-2BW (asked for with --schedules): each row is its time per update without a flush,
    # marked "(steady)", its notes give the flushed 1F1B step of the same layout beside it.
    from pipectl.report.plan_table import format_step

    out = tmp_path / "plan.json"
    args = ["plan", "--profile", str(profile_path), "--cluster", "a100-8x8", "--devices", "8", "--global-batch", "32",
            "--pipeline-parallel", "4", "--schedules", "1f1b,2bw", "--no-morph", "--top", "4"]
    shown = runner.invoke(app, [*args, "-o", str(out)], env={"COLUMNS": "200"})
    assert shown.exit_code == 0, shown.output
    assert "2bw" not in shown.output.split("note:")[0].split("other candidate")[0].split("chosen:", 1)[1]
    assert "faster) no engine pipectl launches can run: left out (--all lists them)" in " ".join(shown.output.split())
    result = runner.invoke(app, [*args, "--all", "-o", str(out)], env={"COLUMNS": "200"})  # listed apart
    assert result.exit_code == 0, result.output
    assert "planned for comparison only" in result.output
    plan = load_model(Plan, out)
    assert plan.chosen.schedule.value == "1f1b"  # another optimizer: never chosen for DeepSpeed
    two_bw = [c for c in plan.candidates if c.schedule.value == "2bw"]
    assert two_bw and two_bw[0].predicted_step_seconds < plan.chosen.predicted_step_seconds
    best = two_bw[0]  # the top of the ranking (the chosen one is put before it)
    steady = next(n for n in best.notes if n.startswith("2BW steady state"))
    assert f"2BW steady state {best.predicted_step_seconds:.4g} s per update of " in steady
    assert "(flushed 1F1B: " in steady and any("1-stale" in n for n in best.notes)
    row = next(line for line in result.output.splitlines() if "2bw* (steady)" in line)
    assert format_step(best.predicted_step_seconds) in row
    text = " ".join(result.output.split())
    assert "2bw (steady): PipeDream-2BW's time per update in steady state, no flush between updates" in text
    assert steady in text  # the best 2bw row's steady state and flushed step, under the table
    assert f"fastest overall is t={best.tensor_parallel} p=4" in text and "s per update, 2BW steady state)" in text

    result = runner.invoke(app, [*args, "--any-engine", "-o", str(out)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    chosen = load_model(Plan, out).chosen
    assert chosen.schedule.value == "2bw"
    text = " ".join(result.output.split())
    assert f"2bw (steady) zero=1 on {chosen.devices} x a100-80gb: {format_step(chosen.predicted_step_seconds)} per " \
           "update (steady state, no flush) of 32 samples" in text
    assert "note: 2BW steady state" in text and "note: PipeDream-2BW: 1-stale weight updates" in text
    # The alternatives an engine runs are listed though faster 2BW rows fill the top (before: "0 alternatives").
    alternatives = [c for c in load_model(Plan, out).candidates if c.schedule.value == "1f1b"]
    assert len(alternatives) >= 4 and "the chosen plan and 4 alternatives that can run" in text


def test_2bw_with_fewer_than_p_minus_1_micro_batches_is_rejected_with_its_reason(profile_path, tmp_path):
    result = runner.invoke(app, ["plan", "--profile", str(profile_path), "--cluster", "a100-8x8", "--devices", "8",
                                 "--global-batch", "16", "--pipeline-parallel", "6", "--micro-batch-size", "4",
                                 "--schedules", "2bw", "--any-engine", "--no-morph", "-o", str(tmp_path / "p.json")])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "PipeDream-2BW with two weight versions needs at least p - 1 micro-batches per update" in text
    assert "p=6 d=1 b=4 2bw: 4 micro-batches per update < p - 1 = 5" in text


def _tight_profile(tmp_path):
    """Six blocks of long sequences: one CPU rank of 2.2 GiB holds b = 4 only by checkpointing
    layers (2.8 GiB without, 1.8 GiB with)."""
    path = tmp_path / "tight.json"
    profile = synthetic_profile(blocks=6, micro_batch_sizes=[4], hidden=1024, seq_len=4096, device="cpu")
    write_json_atomic(path, profile.model_copy(update={"device_memory_bytes": int(2.2 * 2**30)}))
    return path


@pytest.mark.parametrize(
    "flags, granularities",
    [
        ([], {"layer"}),  # auto: memory forces per-layer checkpointing at p = 1
        (["--recompute", "layer"], {"layer"}),
        (["--recompute", "auto"], {"layer"}),
        (["--recompute", "stage"], None),  # p = 1 never recomputes whole stages: nothing fits
        (["--recompute", "never"], None),
        (["--no-recompute"], None),
    ],
)
def test_recompute_option_decides_whether_per_layer_checkpointing_is_searched(tmp_path, flags, granularities):
    out = tmp_path / "plan.json"
    result = runner.invoke(app, ["plan", "--profile", str(_tight_profile(tmp_path)), "--cluster", "local",
                                 "--devices", "1", "--global-batch", "8", "--no-morph", "-o", str(out), *flags])
    if granularities is None:
        assert result.exit_code == 2, result.output
        assert "does not fit in device memory" in result.output and "Traceback" not in result.output
        return
    assert result.exit_code == 0, result.output
    written = load_model(Plan, out)
    assert {c.recompute_granularity.label for c in written.candidates} == granularities
    assert written.chosen.checkpoint_layers and not written.chosen.recompute
    assert written.request.recompute.value == (flags[1] if flags else "auto")
    # The table and the chosen line say which recomputation a candidate uses.
    assert "+ckpt" in result.output and "checkpoint-layers" in result.output


def test_tensor_parallel_across_two_nodes_plans(profile_path, tmp_path):
    out = tmp_path / "p.json"
    result = runner.invoke(app, ["plan", "--profile", str(profile_path), "--cluster", "a100-8x8", "--global-batch", "32",
                                 "--tensor-parallel", "16", "--no-morph", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert load_model(Plan, out).chosen.tensor_parallel == 16


@pytest.mark.parametrize("t", ["12", "3"])
def test_tensor_parallel_neither_in_a_node_nor_whole_nodes_is_refused(profile_path, tmp_path, t):
    result = runner.invoke(app, ["plan", "--profile", str(profile_path), "--cluster", "a100-8x8", "--global-batch", "32",
                                 "--tensor-parallel", t, "--no-morph", "-o", str(tmp_path / "p.json")])
    assert result.exit_code == 2
    assert f"tensor-parallel degree {t} neither divides the 8 devices of a node" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "p.json").exists()


def test_a_cluster_yaml_by_relative_path_is_recorded_absolute_and_read_back_from_anywhere(profile_path, tmp_path,
                                                                                           monkeypatch):
    from pipectl.cluster import plan_cluster_spec
    from pipectl.paths import configs_dir

    (tmp_path / "mine.yaml").write_text((configs_dir() / "clusters" / "a100-8x8.yaml").read_text())
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["plan", "--profile", str(profile_path), "--cluster", "mine.yaml", "--devices", "8",
                                 "--global-batch", "16", "--no-morph", "-o", "plan.json"])  # fmt: skip
    assert result.exit_code == 0, result.output
    plan = load_model(Plan, tmp_path / "plan.json")
    assert plan.cluster_file == str(tmp_path.resolve() / "mine.yaml")
    monkeypatch.chdir(tmp_path.parent)
    assert plan_cluster_spec(plan).total_devices == 64
    # The file moved away: the plan keeps a copy, and simulate and launch read it.
    (tmp_path / "mine.yaml").rename(tmp_path / "mine.yaml.bak")
    assert plan_cluster_spec(plan).total_devices == 64
    simulated = runner.invoke(app, ["simulate", str(tmp_path / "plan.json"), "--json"])
    assert simulated.exit_code == 0, simulated.output
    assert json.loads(simulated.stdout)["step_seconds"] == pytest.approx(plan.chosen.predicted_step_seconds, rel=1e-9)
    dry = runner.invoke(app, ["launch", str(tmp_path / "plan.json"), "--run-dir", str(tmp_path / "runs" / "x"),
                              "--engine", "slurm", "--steps", "10", "--data", "synthetic", "--dry-run"])
    # Past the cluster, on to the model (this synthetic profile's, which no launch builds).
    assert "model 'synthetic' is neither a file" in dry.output and "cluster" not in dry.output, dry.output


@pytest.mark.parametrize("counts, expected", [
    (None, [*range(1, 9), *range(16, 65, 8)]),
    ("13,60-61", [*range(1, 9), 13, *range(16, 57, 8), 60, 61, 64]),
    ("all", list(range(1, 65))),
])
def test_the_morph_table_covers_a_node_whole_nodes_and_the_counts_named(profile_path, tmp_path, counts, expected):
    """On 8 x 8 A100s: every count up to a node, whole nodes beyond, the counts `--morph-counts`
    names, or every count; a resize to another count re-plans."""
    out = tmp_path / "plan.json"
    result = runner.invoke(app, ["plan", "--profile", str(profile_path), "--cluster", "a100-8x8", "--global-batch", "32",
                                 "-o", str(out), *(["--morph-counts", counts] if counts else [])])
    assert result.exit_code == 0, result.output
    table = [e.devices for e in load_model(Plan, out).morph_table]
    assert table == [c for c in expected if c >= table[0]]


@pytest.mark.parametrize("counts", ["x", "3-", "0", "9-4", "1-99999999999"])
def test_a_bad_morph_count_is_named(profile_path, tmp_path, counts):
    result = runner.invoke(app, ["plan", "--profile", str(profile_path), "--cluster", "a100-8x8", "--global-batch", "32",
                                 "-o", str(tmp_path / "plan.json"), "--morph-counts", counts])
    assert result.exit_code == 2 and f"--morph-counts '{counts}'" in result.output, result.output
    assert not (tmp_path / "plan.json").exists()


def test_a_terminal_sees_what_is_planned_while_it_runs_and_a_pipe_does_not(profile_path, tmp_path):
    """A long search said nothing until it ended (minutes for a large batch on CPU ranks): a terminal
    gets a transient line naming the search; a pipe's stderr stays empty."""
    import os
    import pty
    import subprocess

    from cli_process import PIPECTL, pipectl

    args = ["plan", "--profile", profile_path, "--cluster", "local", "--devices", "2", "--global-batch", "8"]
    piped = pipectl(*args, "-o", tmp_path / "piped.json", cwd=tmp_path)
    assert piped.returncode == 0 and piped.stderr == "", piped.stderr
    main, terminal = pty.openpty()
    try:
        done = subprocess.run([*PIPECTL, *map(str, args), "-o", tmp_path / "tty.json"], cwd=tmp_path,
                              stdout=subprocess.DEVNULL, stderr=terminal, timeout=120, env={**os.environ, "TERM": "xterm"})
        os.close(terminal)
        seen = b""
        while chunk := _read(main):
            seen += chunk
    finally:
        os.close(main)
    assert done.returncode == 0
    assert "planning " in seen.decode(errors="replace") and "on local, global batch 8" in seen.decode(errors="replace")


def _read(fd: int) -> bytes:
    import os

    try:
        return os.read(fd, 65536)
    except OSError:  # the terminal's other end closed: all read
        return b""

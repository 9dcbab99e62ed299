"""`pipectl simulate` end to end: the real command, its output, files and exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipectl.cli.main import app

runner = CliRunner()
UNIFORM = ["simulate", "--schedule", "1f1b", "--pipeline-parallel", "4", "--micro-batches", "8"]


def invoke(*args: str, code: int = 0):
    result = runner.invoke(app, list(args))
    assert result.exit_code == code, result.output
    return result


def test_uniform_json_reports_the_closed_form():
    payload = json.loads(invoke(*UNIFORM, "--forward-ms", "1", "--backward-ms", "2", "--json").stdout)
    assert payload["step_seconds"] == pytest.approx((8 + 4 - 1) * 3e-3, rel=1e-12)
    assert payload["bubble_ratio"] == pytest.approx([3 / 8] * 4)
    assert payload["peak_in_flight"] == [4, 3, 2, 1]
    assert len(payload["records"]) == 4 * (2 * 8 + 2)
    assert payload["records"][0] == {"rank": 0, "action": "0F0", "start": 0.0, "end": 0.001}


def test_table_and_terminal_chart():
    out = invoke(*UNIFORM, "--terminal", "--width", "50").stdout
    assert "1f1b  p=4 m=8 v=1" in out
    for rank in range(4):
        assert f"rank {rank} " in out
    assert "bubble 27.3%" in out  # (p-1)/(m+p-1) = 3/11


def test_interleaved_with_chunks_and_gantt_file(tmp_path: Path):
    picture = tmp_path / "step.svg"
    out = invoke("simulate", "--schedule", "interleaved", "--pipeline-parallel", "2", "--micro-batches", "4",
                 "--chunks", "2", "--gantt", str(picture)).stdout
    assert "Gantt chart written to" in out
    assert picture.read_text().lstrip().startswith("<?xml")


def test_interleaved_without_chunks_simulates_two_chunks_not_1f1b():
    """`--schedule interleaved` alone is the interleaved schedule (v = 2), not 1F1B under its name."""
    args = ["simulate", "--pipeline-parallel", "2", "--micro-batches", "4"]
    interleaved = invoke(*args, "--schedule", "interleaved").stdout
    one_f_one_b = invoke(*args, "--schedule", "1f1b").stdout
    assert "interleaved  p=2 m=4 v=2" in interleaved, interleaved
    assert interleaved.split("step")[1].split()[0] != one_f_one_b.split("step")[1].split()[0]  # a shorter bubble


def test_print_schedule_shows_sends_and_receives():
    out = invoke("simulate", "--schedule", "gpipe", "--pipeline-parallel", "2", "--micro-batches", "2",
                 "--print-schedule").stdout
    assert "0: 0F0 0SF0 0F1 0SF1" in out
    assert "1: 1RF0 1F0" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["simulate"], "give a PLAN.json, or --schedule"),
        (["simulate", "--schedule", "interleaved", "--pipeline-parallel", "4", "--micro-batches", "6", "--chunks", "2"],
         "m=6 to be a multiple of the pipeline-parallel degree p=4"),
        (UNIFORM + ["--gantt", "step.gif"], "must end in .png, .svg or .pdf"),
        (["simulate", "missing-plan.json"], "file not found: missing-plan.json"),
        (["simulate", "plan.json", "--schedule", "1f1b"], "cannot be combined with a plan"),
        (UNIFORM + ["--devices", "4"], "--devices needs a PLAN.json"),
        (["simulate", "--schedule", "gpipe", "--pipeline-parallel", "2", "--micro-batches", "2", "--chunks", "2"],
         "chunks v=2 needs the interleaved schedule"),
    ],
)
def test_bad_input_is_one_red_line_and_exit_code_2(args, message):
    result = invoke(*args, code=2)
    assert message in result.output
    assert "Traceback" not in result.output


def test_simulates_a_plan_candidate(tmp_path: Path, monkeypatch):
    from pipectl.artifacts.plan import Candidate, ModelShape, Plan, PlanRequest
    from pipectl.cluster import load_cluster
    from pipectl.io import write_json_atomic
    from pipectl.plan.cost_table import stage_costs_for
    from pipectl.planfile import write_plan
    from pipectl.plan.simulate import simulate_step_seconds
    from pipectl.testing.profiles import synthetic_profile
    from pipectl.schedule import ScheduleKind, generate

    profile = synthetic_profile(blocks=4, micro_batch_sizes=[1, 2], device="cpu")
    profile_path = write_json_atomic(tmp_path / "profile.json", profile)
    candidate = Candidate(
        devices=2, device="cpu", tensor_parallel=1, pipeline_parallel=2, data_parallel=1,
        micro_batch_size=2, micro_batches=4, schedule=ScheduleKind.ONE_F_ONE_B, recompute=False,
        zero_stage=0, stage_layers=[(0, 3), (3, len(profile.layers))], predicted_step_seconds=1.0,
        samples_per_second=8.0, tflops_per_device=0.0, peak_memory_bytes=[1, 1], bubble_fraction=0.2,
        communication_fraction=0.0, cost_per_million_samples=0.0,
    )
    plan = Plan(model=profile.model, model_shape=ModelShape.of_profile(profile), cluster="local",
                request=PlanRequest(global_batch=8), chosen=candidate)
    plan_path = tmp_path / "out" / "plan.json"
    write_plan(plan_path, plan, profile_file=profile_path)
    monkeypatch.chdir(tmp_path / "out")  # the profile is found next to the plan, from anywhere
    payload = json.loads(invoke("simulate", str(plan_path), "--json").stdout)
    expected = simulate_step_seconds(
        generate(ScheduleKind.ONE_F_ONE_B, 2, 4),
        stage_costs_for(candidate, profile, load_cluster("local")),
    )
    assert payload["step_seconds"] == pytest.approx(expected, rel=1e-12)
    assert payload["predicted_step_seconds"] == 1.0
    assert payload["source"] == str(plan_path)
    assert Path(profile_path).is_file()
    assert "recompute" not in payload and invoke("simulate", str(plan_path)).stdout.startswith("1f1b  p=2 m=4")
    # What the layout recomputes is in the title, as the plan's table writes it (two plans of one
    # schedule and step looked alike while their ranks' rows differed).
    for field, word, mark in [("recompute", "stage", "1f1b+R  p=2"), ("checkpoint_layers", "layer", "1f1b+ckpt  p=2")]:
        write_plan(plan_path, plan.model_copy(update={"chosen": candidate.model_copy(update={field: True})}),
                   profile_file=profile_path)
        assert json.loads(invoke("simulate", str(plan_path), "--json").stdout)["recompute"] == word
        assert invoke("simulate", str(plan_path)).stdout.startswith(mark)


def test_varuna_order_follows_the_given_stage_times():
    from pipectl.schedule import ScheduleKind, generate

    out = invoke("simulate", "--schedule", "varuna", "--pipeline-parallel", "3", "--micro-batches", "6",
                 "--forward-ms", "1", "--backward-ms", "3", "--print-schedule").stdout
    expected = generate(ScheduleKind.VARUNA, 3, 6, forward_seconds=1.0, backward_seconds=3.0)
    assert expected.actions != generate(ScheduleKind.VARUNA, 3, 6).actions  # the ratio matters here
    first_rank = " ".join(str(a) for a in expected.compute_order(0))
    shown = next(line for line in out.splitlines() if line.startswith("0: "))
    assert " ".join(t for t in shown[3:].split() if t[1] in "FBR" and t[1:3] not in ("SF", "SB", "RF", "RB")) == first_rank


def test_a_morph_entry_using_fewer_devices_says_how_many_and_why(tmp_path: Path):
    from pipectl.artifacts.plan import Plan
    from pipectl.io import load_model, write_json_atomic
    from pipectl.testing.profiles import synthetic_profile

    profile = write_json_atomic(tmp_path / "profile.json", synthetic_profile(blocks=2, micro_batch_sizes=[1, 2]))
    plan_path = tmp_path / "plan.json"
    invoke("plan", "--profile", str(profile), "--cluster", "local", "--devices", "7", "--global-batch", "4",
           "-o", str(plan_path))
    entry = load_model(Plan, plan_path).for_devices(7)
    used = entry.candidate.devices
    assert used < 7  # 5 layers and B = 4 (at most 4 replicas): nothing runs on exactly 7
    out = " ".join(invoke("simulate", str(plan_path), "--devices", "7").stdout.split())
    assert f"the plan's entry for 7 devices uses {used}: no configuration of exactly 7 devices gives each replica samples" in out
    payload = json.loads(invoke("simulate", str(plan_path), "--devices", "7", "--json").stdout)
    assert payload["requested_devices"] == 7 and payload["devices"] == used
    assert payload["note"].startswith(f"the plan's entry for 7 devices uses {used}: ")


def test_a_plan_of_uneven_replicas_simulates_to_its_own_step(tmp_path: Path, monkeypatch):
    # 12 A100s as t = 2, p = 2, d = 3, b = 2: B = 16 is 8 micro-batches over 3 replicas (3, 3, 2).
    from pipectl.io import write_json_atomic
    from pipectl.testing.profiles import synthetic_profile

    monkeypatch.chdir(tmp_path)
    write_json_atomic(tmp_path / "profile.json", synthetic_profile(blocks=4, micro_batch_sizes=[1, 2]))
    invoke("plan", "--profile", "profile.json", "--cluster", "a100-8x8", "--devices", "12", "--global-batch", "16",
           "--tensor-parallel", "2", "--pipeline-parallel", "2", "--micro-batch-size", "2", "--no-morph", "-o", "plan.json")
    payload = json.loads(invoke("simulate", "plan.json", "--json").stdout)
    assert payload["step_seconds"] == pytest.approx(payload["predicted_step_seconds"], rel=1e-9)
    assert payload["note"] == "uneven replicas run 3 or 2 micro-batches: one of 3 sets the step and is shown"


def test_a_cluster_file_edited_since_planning_is_said_to_price_the_simulation(tmp_path: Path, monkeypatch):
    """simulate re-prices a plan with its cluster file as it stands (an edit is meant to count), so
    the step may differ from the plan's: the note says which file changed; unedited, no note."""
    import shutil

    from pipectl.io import write_json_atomic
    from pipectl.paths import resolve_config
    from pipectl.testing.profiles import synthetic_profile

    monkeypatch.chdir(tmp_path)
    shutil.copy(resolve_config("a100-8x8", "clusters"), "mine.yaml")
    write_json_atomic(tmp_path / "profile.json", synthetic_profile(blocks=4, micro_batch_sizes=[1, 2]))
    invoke("plan", "--profile", "profile.json", "--cluster", "mine.yaml", "--devices", "16", "--global-batch", "16",
           "--data-parallel", "2", "--no-morph", "-o", "plan.json")
    assert "note" not in json.loads(invoke("simulate", "plan.json", "--json").stdout)
    text = Path("mine.yaml").read_text()
    Path("mine.yaml").write_text(text.replace("inter_node_bandwidth_gbytes_per_second: 25",
                                              "inter_node_bandwidth_gbytes_per_second: 2"))
    payload = json.loads(invoke("simulate", "plan.json", "--json").stdout)
    assert payload["note"] == f"{tmp_path / 'mine.yaml'} changed since planning: priced as it is now"


def test_a_cluster_with_a_links_file_is_unchanged_after_planning_and_its_copy_holds_the_links(
    tmp_path: Path, monkeypatch
):
    """A cluster file naming a links_file: simulate right after plan says nothing changed; once the
    folder is gone, or only the links file, the plan's copy prices with the links it was planned
    with; a links file edited is priced as it stands, with the note, whether the cluster file is
    there or not."""
    from pipectl.artifacts.profile import LinkClass, LinkClassFit, LinksProfile
    from pipectl.io import write_json_atomic
    from pipectl.testing.profiles import synthetic_profile

    monkeypatch.chdir(tmp_path)
    Path("sub").mkdir()
    fit = LinkClassFit(link_class=LinkClass.INTRA_NODE, p2p_latency_seconds=5e-5, p2p_bandwidth_bytes_per_second=3e8,
                       allreduce_latency_seconds=7e-5, allreduce_bandwidth_bytes_per_second=1.5e8)
    write_json_atomic(Path("sub/links.json"), LinksProfile(backend="gloo", device="cpu", fits=[fit]))
    Path("sub/mine.yaml").write_text(
        "schema_version: 1\nname: mine\nlocal: true\nnode_types:\n  - name: cpus\n    device: cpu\n"
        "    devices_per_node: 2\n    nodes: 1\n    links:\n      links_file: links.json\n"
    )
    write_json_atomic(tmp_path / "profile.json", synthetic_profile(blocks=4, micro_batch_sizes=[1, 2], device="cpu"))
    invoke("plan", "--profile", "profile.json", "--cluster", "sub/mine.yaml", "--global-batch", "8",
           "--pipeline-parallel", "2", "--no-morph", "-o", "plan.json")
    payload = json.loads(invoke("simulate", "plan.json", "--json").stdout)
    assert "note" not in payload, payload["note"]
    Path("sub").rename("moved")
    moved = json.loads(invoke("simulate", "plan.json", "--json").stdout)
    assert moved["step_seconds"] == pytest.approx(payload["step_seconds"], rel=1e-9)
    Path("moved").rename("sub")
    Path("sub/links.json").rename("links.json")
    links_gone = json.loads(invoke("simulate", "plan.json", "--json").stdout)
    assert links_gone["step_seconds"] == pytest.approx(payload["step_seconds"], rel=1e-9)
    write_json_atomic(Path("sub/links.json"), LinksProfile(backend="gloo", device="cpu", fits=[
        fit.model_copy(update={"p2p_bandwidth_bytes_per_second": 3e6})]))
    edited = json.loads(invoke("simulate", "plan.json", "--json").stdout)
    assert edited["note"] == f"{tmp_path / 'sub' / 'links.json'} changed since planning: priced as it is now"
    assert edited["step_seconds"] > payload["step_seconds"]
    Path("sub/mine.yaml").rename("mine.yaml")  # the cluster file gone, its edited links file there
    assert json.loads(invoke("simulate", "plan.json", "--json").stdout) == edited

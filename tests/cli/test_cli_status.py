"""`pipectl status`: progress, loss, prediction summary and checkpoints, as a table, JSON and a plot."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from typer.testing import CliRunner

from pipectl.artifacts.layout import layout_label
from pipectl.artifacts.plan import Candidate
from pipectl.artifacts.run import CheckpointManifest, RankTiming, StepMetrics
from pipectl.cli.main import app
from pipectl.launch import LaunchOptions, prepare_launch
from pipectl.rundir import checkpoints as ckpt
from pipectl.rundir.metrics import MetricsWriter
from pipectl.schedule.ir import ScheduleKind
from builders import plan_of

runner = CliRunner()
MIB = 2**20


def make_run(tmp_path: Path, steps_done: int = 4, memory: str | None = None, recompute: bool = False) -> Path:
    """A run of 10 steps with `steps_done` written; `memory` "cuda" or "rss": the ranks' peaks too
    (rank 0 / stage 0 peaks at 3 MiB, rank 1 / stage 1 at 2 MiB; the plan predicts 4 and 1 MiB)."""
    candidate = Candidate(
        devices=2, device="cpu", tensor_parallel=1, pipeline_parallel=2, data_parallel=1,
        micro_batch_size=2, micro_batches=4, schedule=ScheduleKind.ONE_F_ONE_B, recompute=recompute,
        zero_stage=1, stage_layers=[(0, 4), (4, 9)], predicted_step_seconds=0.05, samples_per_second=160.0,
        tflops_per_device=0.0, peak_memory_bytes=[4 * MIB, 1 * MIB], bubble_fraction=0.1,
        communication_fraction=0.0, cost_per_million_samples=0.0,
    )  # fmt: skip
    plan = plan_of(candidate, global_batch=8)
    run = tmp_path / "run"
    prepare_launch(plan, run, LaunchOptions(steps=10))
    writer = MetricsWriter(run, rank=0)
    for step in range(1, steps_done + 1):
        seconds = 0.04 + 0.01 * step
        ranks = []
        if memory is not None:
            peaks = [(3 * MIB if step == 2 else 2 * MIB), 2 * MIB]
            ranks = [
                RankTiming(rank=r, stage=r, forward_seconds=0.01, backward_seconds=0.02,
                           peak_allocated_bytes=peak if memory == "cuda" else None,
                           peak_reserved_bytes=peak + MIB if memory == "cuda" else None,
                           peak_rss_bytes=100 * peak)
                for r, peak in enumerate(peaks)
            ]  # fmt: skip
        writer.write(
            StepMetrics(step=step, loss=6.0 - 0.5 * step, step_seconds=seconds, predicted_step_seconds=0.05,
                        samples_per_second=8 / seconds, global_batch=8, world_size=2, layout=layout_label(candidate),
                        ranks=ranks)
        )  # fmt: skip
    staged = run / "checkpoints" / ckpt.STAGING_DIR / "x"
    staged.mkdir(parents=True)
    (staged / "fp32.pt").write_bytes(b"w")
    if steps_done >= 4:  # the checkpoint of step 4, once it trained (a leftover staging folder either way)
        manifest = CheckpointManifest(tag="step00000004", step=4, files=ckpt.hash_tree(staged), bytes=1)
        ckpt.commit_tag(run / "checkpoints", staged, "step00000004", manifest)
    return run


def test_status_json_reports_progress_loss_prediction_and_checkpoints(tmp_path):
    run = make_run(tmp_path)
    result = runner.invoke(app, ["status", str(run), "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output)
    assert payload["steps_done"] == 4 and payload["steps"] == 10 and not payload["finished"]
    assert payload["state"] == "interrupted"  # no rank runs, and none stopped at a checkpoint
    assert payload["last_loss"] == 4.0 and payload["first_loss"] == 5.5
    # steps 2..4 measured 0.06, 0.07, 0.08 s against 0.05 s predicted
    assert payload["prediction"]["steps_compared"] == 3
    assert abs(payload["prediction"]["max_abs_error"] - 0.375) < 1e-9
    assert payload["checkpoints"][0]["tag"] == "step00000004" and payload["checkpoints"][0]["verified"]
    assert payload["memory"] is None  # lines without memory figures (as files written before them)


def test_status_compares_measured_cuda_memory_with_the_plan_per_stage(tmp_path):
    run = make_run(tmp_path, memory="cuda")
    stages = json.loads(runner.invoke(app, ["status", str(run), "--json"]).output)["memory"]["stages"]
    assert [(s["stage"], s["measured_peak_bytes"], s["predicted_peak_bytes"]) for s in stages] == [
        (0, 3 * MIB, 4 * MIB),  # the highest step's peak, not the last one's
        (1, 2 * MIB, 1 * MIB),
    ]
    assert [round(s["error"], 3) for s in stages] == [0.333, -0.5]
    table = runner.invoke(app, ["status", str(run)]).output
    assert "peak memory per stage" in table and "measured allocated" in table
    row = next(line for line in table.splitlines() if line.strip().startswith("1 "))
    assert row.split() == ["1", "1", "1", "MiB", "2", "MiB", "3", "MiB", "-50.0", "%"]


def test_status_on_cpu_shows_rss_as_rss_without_an_error_figure(tmp_path):
    run = make_run(tmp_path, memory="rss")
    memory = json.loads(runner.invoke(app, ["status", str(run), "--json"]).output)["memory"]
    assert memory["measure"] == "rss" and not memory["comparable"]
    assert [(s["measured_peak_bytes"], s["error"]) for s in memory["stages"]] == [(300 * MIB, None), (200 * MIB, None)]
    table = " ".join(runner.invoke(app, ["status", str(run)]).output.split())
    section = table[table.index("peak memory per stage") : table.index("checkpoints")]
    assert "predicted (device)" in section and "(process)" in section and "error" not in section
    assert "RSS is the whole process" in section
    assert "0 0 4 MiB 300 MiB 75.0x" in table


def test_status_table_and_verify_flags_a_corrupted_checkpoint(tmp_path):
    healthy = runner.invoke(app, ["status", str(make_run(tmp_path / "ok")), "--verify"])
    assert healthy.exit_code == 0 and "verified: every file of 1 checkpoint matches its manifest's sha256" in healthy.output
    run = make_run(tmp_path)
    (run / "checkpoints" / "step00000004" / "fp32.pt").write_bytes(b"x")
    plain = runner.invoke(app, ["status", str(run)])
    assert plain.exit_code == 0 and "4 / 10 steps" in plain.output and "prediction error" in plain.output
    verified = runner.invoke(app, ["status", str(run), "--verify", "--json"])
    assert verified.exit_code == 2  # a damaged artifact, as everywhere: a script checking the run sees it
    checkpoint = json.loads(verified.stdout)["checkpoints"][0]
    assert not checkpoint["verified"] and "sha256 mismatch" in checkpoint["problems"][0]
    table = runner.invoke(app, ["status", str(run), "--verify"])
    assert table.exit_code == 2 and "1 checkpoint of" in table.output and "failed verification: step00000004" in table.output
    row = next(line for line in table.stdout.splitlines() if line.strip().startswith("step00000004"))
    assert "fp32.pt: sha256 mismatch" in row and str(run) not in row  # the row names the checkpoint: its file alone
    assert runner.invoke(app, ["status", str(run), "--json"]).exit_code == 0  # without --verify: hashes not read


def test_status_plot_writes_a_png(tmp_path):
    run = make_run(tmp_path)
    out = tmp_path / "plots" / "run.png"
    result = runner.invoke(app, ["status", str(run), "--plot", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_plot_marks_whole_steps_only(tmp_path):
    """A short run's step axis: ticks at whole steps, none at 2.5 (matplotlib's SVG keeps each
    label's text in a comment)."""
    run = make_run(tmp_path)
    out = tmp_path / "run.svg"
    assert runner.invoke(app, ["status", str(run), "--plot", str(out)]).exit_code == 0
    labels = re.findall(r"<!-- (\S+) -->", out.read_text())
    assert "2" in labels and not [label for label in labels if re.fullmatch(r"\d+\.5", label)], labels


def test_status_of_something_that_is_not_a_run_exits_2(tmp_path):
    result = runner.invoke(app, ["status", str(tmp_path)])
    assert result.exit_code == 2 and "not a pipectl run" in result.output
    # Not there yet (a launch a moment ago has not written it): says how one is written, and waited for.
    missing = " ".join(runner.invoke(app, ["status", str(tmp_path / "soon")]).output.split())
    assert "no run directory at" in missing and "`pipectl status --follow` waits for a run a launch is about to write" in missing
    empty = make_run(tmp_path / "b", steps_done=0)
    plot = runner.invoke(app, ["status", str(empty), "--plot", str(tmp_path / "p.png")])
    assert plot.exit_code == 2 and "no metrics" in plot.output
    # The folder of runs (`runs`, not `runs/mine`): the runs it holds are named.
    runs = " ".join(runner.invoke(app, ["status", str(empty.parent)]).output.split())
    assert f"hint: give a run it holds (1 run): {empty}" in runs, runs
    resume = " ".join(runner.invoke(app, ["launch", str(empty / "plan.json"), "--run-dir", str(empty.parent),
                                          "--resume"]).output.split())  # fmt: skip
    assert "cannot resume" in resume and f"hint: give a run it holds (1 run): {empty}" in resume, resume


def test_plain_status_shows_a_truncated_file_and_leftover_staging_folders(tmp_path):
    run = make_run(tmp_path)
    tag_dir = run / "checkpoints" / "step00000004"
    manifest = CheckpointManifest.model_validate_json((tag_dir / "manifest.json").read_text())
    (tag_dir / "manifest.json").write_text(manifest.model_copy(update={"file_bytes": {"fp32.pt": 1}}).model_dump_json())
    assert "ok" in runner.invoke(app, ["status", str(run)]).output
    (tag_dir / "fp32.pt").write_bytes(b"")  # truncated: the hash is not needed to see it
    leftover = run / "checkpoints" / ckpt.STAGING_DIR / "w999999-0badcafe" / "step00000008"
    leftover.mkdir(parents=True)
    result = runner.invoke(app, ["status", str(run)])
    output = " ".join(result.output.split())
    assert result.exit_code == 0, result.output
    assert "0 bytes, the manifest records 1 (truncated)" in output and " ok " not in output
    assert "1 staging folder in" in output and "w999999-0badcafe" in output
    payload = json.loads(runner.invoke(app, ["status", str(run), "--json"]).output)
    assert payload["staging"] == [str(leftover.parent)] and not payload["checkpoints"][0]["verified"]


def test_status_shows_measured_mfu_and_hfu_beside_predicted(tmp_path):
    run = make_run(tmp_path)
    flops = json.loads(runner.invoke(app, ["status", str(run), "--json"]).output)["flops"]
    # gpt-tiny (h=64, s=32, V=256, 6 blocks): per sample 6 x (24sh^2 + 4s^2h) + 2shV forward, x3, x B=8
    model = 3 * 8 * (6 * (24 * 32 * 64**2 + 4 * 32**2 * 64) + 2 * 32 * 64 * 256)
    peak = 2 * 0.147e12  # two CPU ranks at the catalog's fp32 peak (job.json: fp32)
    predicted, measured = flops["predicted"], flops["measured"]
    assert predicted["source"] == "shape" and predicted["model_flops_per_step"] == model
    assert predicted["mfu"] == pytest.approx(model / (0.05 * peak), rel=1e-12)
    assert measured["mfu"] == pytest.approx(model / (0.07 * peak), rel=1e-12)  # median of 0.06, 0.07, 0.08 s
    assert measured["hfu"] == measured["mfu"] and flops["steps_measured"] == 3
    table = " ".join(runner.invoke(app, ["status", str(run)]).output.split())
    assert f"MFU measured {100 * measured['mfu']:.1f} %, predicted {100 * predicted['mfu']:.1f} %" in table
    assert "HFU measured" in table and "2 x 0.147 TFLOP/s float32 peak" in table


def test_status_hfu_counts_the_recomputed_forwards_mfu_does_not(tmp_path):
    plain = json.loads(runner.invoke(app, ["status", str(make_run(tmp_path / "a")), "--json"]).output)["flops"]
    again = json.loads(runner.invoke(app, ["status", str(make_run(tmp_path / "b", recompute=True)), "--json"]).output)
    measured = again["flops"]["measured"]
    assert measured["mfu"] == plain["measured"]["mfu"] and measured["hfu"] > measured["mfu"]
    # stage 0 ([0, 4): embed and 3 blocks) runs its forward again; the last stage does not
    assert measured["recomputed_flops_per_step"] == 8 * 3 * (24 * 32 * 64**2 + 4 * 32**2 * 64)
    assert "+ recompute" in runner.invoke(app, ["status", str(make_run(tmp_path / "c", recompute=True))]).output


def test_status_names_the_metrics_lines_it_skipped_but_not_a_torn_last_one(tmp_path):
    run = make_run(tmp_path, steps_done=3)
    metrics = run / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join([lines[0], "not json at all", *lines[1:]]) + "\n" + '{"step": 4, "lo')
    result = runner.invoke(app, ["status", str(run)])
    assert result.exit_code == 0, result.output
    assert "1 line not a step record, skipped (line 2)" in " ".join(result.output.split())
    payload = json.loads(runner.invoke(app, ["status", str(run), "--json"]).output)
    assert payload["unreadable_metrics_lines"] == [2] and payload["steps_done"] == 3


def test_a_stray_byte_in_a_runs_logs_skips_its_line_not_the_run(tmp_path):
    """A byte that is no UTF-8 (a disk error, a hand edit) in metrics.jsonl or a log of lines raised
    UnicodeDecodeError in status, resize, resume and even --force: its line is skipped now."""
    run = make_run(tmp_path, steps_done=3)
    for name in ("metrics.jsonl", "logs/ranks.jsonl", "logs/checkpoints.jsonl", "morphs.jsonl", "logs/resume.json"):
        path = run / name
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("ab") as handle:
            handle.write(b"\xff\xfe junk\n")
    result = runner.invoke(app, ["status", str(run)])
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    assert "1 line not a step record, skipped (line 4)" in " ".join(result.output.split())
    assert json.loads(runner.invoke(app, ["status", str(run), "--json"]).output)["steps_done"] == 3


def test_a_run_trained_without_any_checkpoint_is_not_told_to_resume(tmp_path):
    """Every step trained and no checkpoint written (a disk without room for one): `--resume` has
    nothing to start from, so status says to start over, not to resume."""
    import shutil

    run = make_run(tmp_path, steps_done=10)
    shutil.rmtree(run / "checkpoints" / "step00000004")
    output = " ".join(runner.invoke(app, ["status", str(run)]).output.split())
    assert "trained, but no checkpoint was written: nothing to resume from; launch again with --force" in output
    assert "resume to write it" not in output


def test_a_run_whose_metrics_file_was_deleted_counts_the_steps_its_checkpoint_holds(tmp_path):
    """metrics.jsonl deleted (or emptied) after a run checkpointed step 4: status said "0 / 10 steps
    (not started)" beside "last checkpoint step 4"; the checkpoint holds 4 trained steps."""
    run = make_run(tmp_path)
    (run / "metrics.jsonl").unlink()
    payload = json.loads(runner.invoke(app, ["status", str(run), "--json"]).output)
    assert payload["steps_done"] == 4 and not payload["finished"]
    output = " ".join(runner.invoke(app, ["status", str(run)]).output.split())
    assert "4 / 10 steps (stopped; metrics.jsonl holds no step (deleted?)" in output, output
    assert "not started" not in output and "MFU measured n/a (metrics.jsonl holds no step)" in output, output


def test_a_stored_option_this_version_refuses_is_named_as_a_resume_would(tmp_path):
    """Status reads a run through `rundir` (which knows nothing of launch options) and still checks
    job.json's stored options, as `launch --resume` would take them back: exit 2, naming the key."""
    run = make_run(tmp_path)
    job = json.loads((run / "job.json").read_text())
    job["options"]["training"]["seed"] = "not a number"
    (run / "job.json").write_text(json.dumps(job))
    result = runner.invoke(app, ["status", str(run)])
    assert result.exit_code == 2, result.output
    assert "seed" in result.output and "Traceback" not in result.output


def test_a_run_stopped_by_a_signal_says_it_was_a_stop_request(tmp_path):
    """A Ctrl-C reaches the ranks as SIGTERM (pipectl passes a stop on so): status does not call
    the user's Ctrl-C a SIGTERM, but says what the ranks were sent."""
    import time

    from pipectl.artifacts.run import RankHeartbeat, RankState
    from pipectl.rundir.heartbeats import write_heartbeat

    run = make_run(tmp_path)
    now = time.time()
    for rank in (0, 1):
        write_heartbeat(run, RankHeartbeat(
            rank=rank, pid=999_999, host="here", stage=rank, step=4, phase="step", state=RankState.STOPPED,
            checkpoint_step=4, started_unix=now - 5, beat_unix=now, progress_unix=now, stop_reason="SIGTERM",
        ))  # fmt: skip
    shown = " ".join(runner.invoke(app, ["status", str(run)], env={"COLUMNS": "200"}).output.split())
    assert "stopped at step 4, checkpoint written: a stop request (SIGTERM to the ranks)" in shown, shown
    assert json.loads(runner.invoke(app, ["status", str(run), "--json"]).output)["state"] == "stopped"


def test_a_rank_of_an_older_wider_layout_does_not_hide_a_clean_stop(tmp_path):
    """Resized by a restart from 3 ranks to 2, then stopped: the third rank's last beat (finished,
    an older checkpoint) is still on disk, and status said "stopped (no rank is running)" instead
    of the clean stop the job's two ranks report."""
    import time

    from pipectl.artifacts.run import RankHeartbeat, RankState
    from pipectl.rundir.heartbeats import write_heartbeat

    run = make_run(tmp_path)
    now = time.time()
    beats = [(0, RankState.STOPPED, 4, now - 5, now), (1, RankState.STOPPED, 4, now - 5, now),
             (2, RankState.FINISHED, 2, now - 60, now - 30)]  # fmt: skip
    for rank, state, checkpoint, started, beat in beats:
        write_heartbeat(run, RankHeartbeat(
            rank=rank, pid=999_999, host="here", stage=rank, step=checkpoint, phase="step", state=state,
            checkpoint_step=checkpoint, started_unix=started, beat_unix=beat, progress_unix=beat, stop_reason="SIGTERM",
        ))  # fmt: skip
    shown = " ".join(runner.invoke(app, ["status", str(run)], env={"COLUMNS": "200"}).output.split())
    assert "stopped at step 4, checkpoint written" in shown, shown


def test_an_interrupted_run_says_what_ended_it(tmp_path):
    """A rank killed (kill -9) or failed: status said only "stopped (no rank is running)", though
    the failure records launch reported from are in logs/; it now gives their first line, and calls
    the run interrupted (it said "stopped", which is a run that stopped at a checkpoint)."""
    from pipectl.artifacts.run import RankFailure
    from pipectl.rundir.failures import write_failure

    run = make_run(tmp_path)
    write_failure(run, RankFailure(rank=0, stage=0, step=5, phase="forward of micro-batch 1",
                                   exception="RuntimeError", message="Connection closed by peer"))  # fmt: skip
    shown = " ".join(runner.invoke(app, ["status", str(run)], env={"COLUMNS": "200"}).output.split())
    assert "(interrupted: no rank is running; the newest checkpoint is step 4) failure rank 0 (stage 0) failed in " \
        "step 5 (forward of micro-batch 1)" in shown, shown  # one word for it, as --json says
    assert json.loads(runner.invoke(app, ["status", str(run), "--json"]).output)["state"] == "interrupted"


def test_a_fresh_heartbeat_of_a_rank_whose_process_ended_is_not_a_rank_up(tmp_path):
    """A job killed a second ago left beats that look fresh: a rank of this host whose process has
    ended is not 'up' (the heartbeat alone would say so for several seconds more)."""
    import socket
    import subprocess
    import sys
    import time

    from pipectl.artifacts.run import RankHeartbeat, RankState
    from pipectl.rundir.heartbeats import write_heartbeat

    run = make_run(tmp_path, steps_done=0)
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    now = time.time()
    write_heartbeat(run, RankHeartbeat(
        rank=0, pid=ended.pid, host=socket.gethostname(), stage=0, step=None, phase="start-up",
        state=RankState.RUNNING, started_unix=now - 5, beat_unix=now, progress_unix=now,
    ))  # fmt: skip
    shown = " ".join(runner.invoke(app, ["status", str(run)], env={"COLUMNS": "200"}).output.split())
    assert "the ranks are up" not in shown and "interrupted: no rank is running, and no checkpoint" in shown, shown


def test_a_run_that_failed_before_its_first_step_reads_interrupted(tmp_path):
    """Every start failed before step 1 (a Slurm job requeued until its limit, a model that will
    not build): status said "not started" (--json "not-started") and hid the failure records that
    said why."""
    from pipectl.artifacts.run import RankFailure
    from pipectl.rundir.failures import write_failure

    run = make_run(tmp_path, steps_done=0)
    assert json.loads(runner.invoke(app, ["status", str(run), "--json"]).output)["state"] == "not-started"
    write_failure(run, RankFailure(rank=1, stage=1, step=None, phase="start-up", exception="ImportError",
                                   message="No module named 'mymodel'"))  # fmt: skip
    shown = " ".join(runner.invoke(app, ["status", str(run)], env={"COLUMNS": "200"}).output.split())
    assert "interrupted: no rank is running, and no checkpoint to resume from" in shown, shown
    assert "failure rank 1 (stage 1) failed during start-up" in shown, shown
    assert json.loads(runner.invoke(app, ["status", str(run), "--json"]).output)["state"] == "interrupted"


def test_follow_waits_for_a_run_that_a_launch_is_about_to_write(tmp_path):
    """`launch ... &` then `status --follow` at once: the run directory is waited for, not refused."""
    import threading
    import time

    def launch_a_moment_later() -> None:
        time.sleep(1.0)
        make_run(tmp_path)

    writer = threading.Thread(target=launch_a_moment_later)
    writer.start()
    try:
        result = runner.invoke(app, ["status", str(tmp_path / "run"), "--follow"], env={"COLUMNS": "200"})
    finally:
        writer.join()
    assert result.exit_code == 0, result.output
    assert "waiting for" in result.output and "4 / 10 steps" in result.output


def test_follow_that_waited_in_vain_says_so_without_suggesting_follow(tmp_path, monkeypatch):
    from pipectl.cli import status

    monkeypatch.setattr(status, "APPEAR_SECONDS", 0.2)
    result = runner.invoke(app, ["status", str(tmp_path / "typo"), "--follow"], env={"COLUMNS": "200"})
    shown = " ".join(result.output.split())
    assert result.exit_code == 2 and "no run directory appeared at" in shown and "--follow" not in shown, shown
    make_run(tmp_path / "runs")  # a folder of runs, not a run: said as without --follow
    result = runner.invoke(app, ["status", str(tmp_path / "runs"), "--follow"], env={"COLUMNS": "200"})
    shown = " ".join(result.output.split())
    assert result.exit_code == 2 and "give a run it holds" in shown, shown


def test_follow_on_a_pipe_prints_the_steps_written_just_before_the_job_ended(tmp_path):
    """`pipectl status run --follow | cat` prints a line for every step, also for the steps written
    between its last two reads, when the job ended in between."""
    import os
    import socket
    import subprocess
    import sys
    import time

    from pipectl.artifacts.run import RankHeartbeat, RankState
    from pipectl.rundir.heartbeats import write_heartbeat

    run = make_run(tmp_path, steps_done=4)
    (run / "job.lock").unlink()  # written by this process's prepare_launch, which stands for a launch long gone
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        now = time.time()
        write_heartbeat(run, RankHeartbeat(
            rank=0, pid=rank.pid, host=socket.gethostname(), stage=0, step=4, phase="training",
            state=RankState.RUNNING, started_unix=now, beat_unix=now, progress_unix=now,
        ))  # fmt: skip
        env = {**os.environ, "COLUMNS": "200"}
        follow = subprocess.Popen([sys.executable, "-m", "pipectl.cli.main", "status", "run", "--follow"], cwd=tmp_path,
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        time.sleep(4.0)  # it reads the run as active, then once a second
        writer = MetricsWriter(run, rank=0)
        for step in range(5, 11):  # the last steps, then the ranks end: both between two of its reads
            writer.write(StepMetrics(step=step, loss=1.0, step_seconds=0.05, predicted_step_seconds=0.05,
                                     samples_per_second=160.0, global_batch=8, world_size=2))  # fmt: skip
        rank.kill()
        rank.wait()
        out, err = follow.communicate(timeout=60)
    finally:
        rank.kill()
    assert follow.returncode == 0, out + err
    printed = [line.split()[1] for line in out.splitlines() if line.startswith("step ")]
    assert printed == [f"{step}/10" for step in range(5, 11)], out


def test_status_json_names_the_run_directory_absolute_as_launch_json_does(tmp_path):
    import os
    import subprocess
    import sys

    make_run(tmp_path)
    env = {**os.environ, "COLUMNS": "200"}
    shown = subprocess.run([sys.executable, "-m", "pipectl.cli.main", "status", "run", "--json"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert json.loads(shown.stdout)["run_dir"] == str(tmp_path / "run")


def test_status_says_when_the_last_checkpoint_was_deferred_for_a_slow_disk(tmp_path):
    """`pipectl status run` from the run's folder: a checkpoint taken later than it was due (the
    write before it still ran) says the step it was due at."""
    import os
    import subprocess
    import sys

    from pipectl.artifacts.run import CheckpointEvent, CheckpointOutcome

    make_run(tmp_path)
    ckpt.record_event(tmp_path / "run", CheckpointEvent(step=4, outcome=CheckpointOutcome.COMMITTED, stall_seconds=0.01,
                                                        write_seconds=8.2, bytes=MIB, due_step=3))  # fmt: skip
    env = {**os.environ, "COLUMNS": "200"}
    shown = subprocess.run([sys.executable, "-m", "pipectl.cli.main", "status", "run"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert "step 4: training paused 0.01 s" in shown.stdout
    assert "due at step 3, deferred while the one before was written" in shown.stdout
    assert "it no longer verifies" not in shown.stdout
    # Its manifest deleted since: the row of the commit says so, as the checkpoints table does.
    (tmp_path / "run" / "checkpoints" / "step00000004" / "manifest.json").unlink()
    shown = subprocess.run([sys.executable, "-m", "pipectl.cli.main", "status", "run"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert "deferred while the one before was written; it no longer verifies" in " ".join(shown.stdout.split())


def test_the_first_step_after_a_relaunch_is_left_out_of_the_prediction_error(tmp_path):
    # Steps 1-4 on the plan's layout, 5-6 on another (a resize), 7-8 back on the first: steps 1 and
    # 7 warm up (0.5 s each against 0.05 predicted) and are left out; the rest are exact.
    run = make_run(tmp_path, steps_done=0)
    writer = MetricsWriter(run, rank=0)
    layout = layout_label(json_candidate(run))
    for step, label in enumerate([layout] * 4 + ["t1p1d2 1f1b b4 m1"] * 2 + [layout] * 2, start=1):
        seconds = 0.5 if step in (1, 5, 7) else 0.05
        writer.write(StepMetrics(step=step, loss=1.0, step_seconds=seconds, predicted_step_seconds=0.05,
                                 samples_per_second=8 / seconds, global_batch=8, world_size=2, layout=label))  # fmt: skip
    prediction = json.loads(runner.invoke(app, ["status", str(run), "--json"]).stdout)["prediction"]
    assert prediction["steps_compared"] == 4 and prediction["max_abs_error"] == 0.0  # steps 2, 3, 4 and 8


def json_candidate(run: Path) -> Candidate:
    return Candidate.model_validate(json.loads((run / "plan.json").read_text())["chosen"])


def test_an_automatic_interval_held_at_its_floor_says_so(tmp_path):
    """--checkpoint-every auto with a tiny MTBF: Young/Daly asks for a checkpoint every fraction of
    a second, auto takes one a minute at most; status said 'MTBF 0 h ... every 60 s' as if the
    formula gave it."""
    from pipectl.artifacts.run import CheckpointEvent, CheckpointOutcome

    plan = plan_of(json_candidate(make_run(tmp_path / "first")), global_batch=8)
    run = tmp_path / "auto"
    prepare_launch(plan, run, LaunchOptions(steps=10, checkpoint_every="auto", mtbf_hours=0.001))
    ckpt.record_event(run, CheckpointEvent(step=2, outcome=CheckpointOutcome.COMMITTED, stall_seconds=0.01,
                                           write_seconds=0.1, bytes=MIB, interval_seconds=60.0))  # fmt: skip
    shown = " ".join(runner.invoke(app, ["status", str(run)], env={"COLUMNS": "200"}).output.split())
    assert "auto (Young/Daly, MTBF 0.001 h): every 60 s (at least 60 s apart) after a 0.01 s stall" in shown, shown

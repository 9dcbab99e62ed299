"""Checkpoints: atomic commit with a manifest written last, checksum verification with fallback to
the previous checkpoint, pruning, stop signals; and, with real processes, a checkpoint written at
p=2 that loads (weights and optimizer state) into p=1 and into another cut and continues with the
exact losses of the uninterrupted run."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest

from pipectl.artifacts.plan import Candidate, Plan
from pipectl.artifacts.run import CheckpointManifest
from pipectl.errors import CheckpointError
from pipectl.rundir import checkpoints as ckpt
from pipectl.runtime.checkpoint import ranks
from pipectl.schedule.ir import ScheduleKind
from builders import plan_of


RANK0, RANK1 = "rank-00000.safetensors", "rank-00001.safetensors"


def fake_checkpoint(run_dir: Path, step: int, payload: float = 1.0) -> Path:
    """Two small rank files (one parameter, half each), committed the way the checkpointer does."""
    import torch

    from pipectl.runtime.checkpoint.shards import Fragment, RankHeader, write_rank_file

    root = ckpt.checkpoints_dir(run_dir)
    staged = root / ckpt.STAGING_DIR / "w1-test" / ckpt.tag_for_step(step)
    staged.mkdir(parents=True)
    for rank, name in enumerate((RANK0, RANK1)):
        fragment = Fragment(name="0.weight", group=0, offset=0, start=4 * rank, numel=4, shape=(8,), stage=0)
        header = RankHeader(rank=rank, stage=0, step=step, world_size=2, data_parallel_rank=rank, fragments=[fragment])
        values = torch.full((4,), payload * step)
        write_rank_file(staged / name, {"group0.fp32": values, "rng.torch": torch.get_rng_state()}, header)
    files = ckpt.hash_tree(staged)
    sizes = {relative: (staged / relative).stat().st_size for relative in files}
    manifest = CheckpointManifest(tag=ckpt.tag_for_step(step), step=step, files=files, file_bytes=sizes, bytes=0)
    return ckpt.commit_tag(root, staged, ckpt.tag_for_step(step), manifest)


def rehash(tag_dir: Path, relative: str) -> None:
    """Record a changed file's hash and size in its manifest, as an attacker or a faulty copy tool
    would: verification alone then cannot tell."""
    target = tag_dir / relative
    manifest = CheckpointManifest.model_validate_json((tag_dir / "manifest.json").read_text())
    files = {**manifest.files, relative: ckpt.sha256_file(target)}
    sizes = {**manifest.file_bytes, relative: target.stat().st_size}
    (tag_dir / "manifest.json").write_text(
        manifest.model_copy(update={"files": files, "file_bytes": sizes}).model_dump_json()
    )


def truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    path.write_bytes(bytes(data))


def test_committed_checkpoint_verifies_and_latest_points_at_it(tmp_path):
    fake_checkpoint(tmp_path, 5)
    path = fake_checkpoint(tmp_path, 10)
    info = ckpt.verify_checkpoint(path)
    assert info.verified and info.step == 10
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step00000010"
    latest, warnings = ckpt.find_latest_verified(tmp_path)
    assert latest.tag == "step00000010" and warnings == []


def test_corrupted_file_is_named_and_the_previous_checkpoint_is_used(tmp_path):
    fake_checkpoint(tmp_path, 5)
    newest = fake_checkpoint(tmp_path, 10)
    bad = newest / RANK1
    flip_a_byte(bad)
    assert ckpt.verify_checkpoint(newest, hash_files=False).verified  # presence alone cannot tell
    latest, warnings = ckpt.find_latest_verified(tmp_path)
    assert latest.tag == "step00000005"
    assert len(warnings) == 1 and str(bad) in warnings[0] and "sha256 mismatch" in warnings[0]


def test_a_truncated_file_shows_without_hashing(tmp_path):
    newest = fake_checkpoint(tmp_path, 10)
    bad = newest / RANK0
    size = bad.stat().st_size
    truncate(bad)
    problems = ckpt.verify_checkpoint(newest, hash_files=False).problems
    assert len(problems) == 1 and f"{bad}: {size // 2:,} bytes, the manifest records {size:,} (truncated)" == problems[0]


def test_a_file_that_verifies_but_does_not_load_falls_back_to_the_previous_checkpoint(tmp_path):
    fake_checkpoint(tmp_path, 5)
    newest = fake_checkpoint(tmp_path, 10)
    relative = RANK1
    truncate(newest / relative)
    rehash(newest, relative)
    assert ckpt.verify_checkpoint(newest).verified  # hash and size match: only loading can tell
    latest, warnings = ckpt.find_latest_verified(tmp_path)
    assert latest.step == 10 and warnings == []  # without the load check it would be used
    latest, warnings = ckpt.find_latest_verified(tmp_path, load_check=ranks.unloadable_problem)
    assert latest.step == 5
    assert len(warnings) == 1 and warnings[0].startswith(f"checkpoint step 10 could not be loaded ({newest / relative}: ")
    planted = plant(newest, relative, tmp_path / "payload-ran")  # a pickle that runs code: refused too
    latest, warnings = ckpt.find_latest_verified(tmp_path, load_check=ranks.unloadable_problem)
    assert latest.step == 5 and f"{planted}: not a pipectl rank file" in warnings[0]
    assert not (tmp_path / "payload-ran").exists()


def test_missing_manifest_missing_file_and_stray_file_are_problems(tmp_path):
    first = fake_checkpoint(tmp_path, 1)
    second = fake_checkpoint(tmp_path, 2)
    third = fake_checkpoint(tmp_path, 3)
    (first / "manifest.json").unlink()  # a save interrupted before its manifest
    (second / RANK0).unlink()
    (third / "extra.pt").write_bytes(b"?")
    assert "no manifest" in ckpt.verify_checkpoint(first).problems[0]
    assert "missing" in ckpt.verify_checkpoint(second).problems[0]
    assert "not in the manifest" in ckpt.verify_checkpoint(third).problems[0]
    latest, warnings = ckpt.find_latest_verified(tmp_path)
    assert latest is None and len(warnings) == 3


def test_prune_keeps_the_newest_verified_and_drops_stale_incomplete(tmp_path):
    paths = [fake_checkpoint(tmp_path, step) for step in (1, 2, 3, 4)]
    (paths[0] / "manifest.json").unlink()
    removed = ckpt.prune_checkpoints(tmp_path, keep=2)
    assert sorted(p.name for p in removed) == ["step00000001", "step00000002"]
    assert [i.tag for i in ckpt.list_checkpoints(tmp_path)] == ["step00000003", "step00000004"]


def test_recommitting_a_step_replaces_it(tmp_path):
    import torch

    from pipectl.runtime.checkpoint.shards import ShardReader

    fake_checkpoint(tmp_path, 7, payload=1.0)
    path = fake_checkpoint(tmp_path, 7, payload=2.0)
    assert torch.equal(ShardReader(path).whole("0.weight"), torch.full((8,), 14.0))
    assert ckpt.verify_checkpoint(path).verified


def test_sigterm_sets_the_stop_flag_and_a_stop_file_does_too(tmp_path):
    previous = signal.getsignal(signal.SIGTERM)
    try:
        flag = ranks.install_sigterm_handler()
        assert not ranks.should_stop(flag, tmp_path)
        os.kill(os.getpid(), signal.SIGTERM)
        assert flag.is_set() and flag.reason == "SIGTERM"
        assert ranks.should_stop(flag)
    finally:
        signal.signal(signal.SIGTERM, previous)
    other = ranks.StopFlag()
    (tmp_path / ckpt.STOP_FILE).touch()
    assert ranks.should_stop(other, tmp_path) and other.reason == ckpt.RESIZE_STOP  # only a resize writes it


# --------------------------------------------------------------------------- real processes


def plan_for(p: int, cuts: list[tuple[int, int]], b: int = 2, m: int = 4) -> Plan:
    candidate = Candidate(
        devices=p, device="cpu", tensor_parallel=1, pipeline_parallel=p, data_parallel=1,
        micro_batch_size=b, micro_batches=m, schedule=ScheduleKind.ONE_F_ONE_B, recompute=False,
        zero_stage=1, stage_layers=cuts, predicted_step_seconds=0.05, samples_per_second=160.0,
        tflops_per_device=0.0, peak_memory_bytes=[1] * p, bubble_fraction=0.1,
        communication_fraction=0.0, cost_per_million_samples=0.0,
    )  # fmt: skip
    return plan_of(candidate)


def launch(plan: Plan, run_dir: Path, steps: int, checkpoint_every: int = 0, prepare=None) -> dict[int, float]:
    """Write the run directory, let `prepare(run_dir)` add to it, run it on real ranks, read the losses."""
    from pipectl.launch import LaunchOptions, prepare_launch, run_engine
    from pipectl.rundir.metrics import read_metrics

    prepared = prepare_launch(plan, run_dir, LaunchOptions(steps=steps, checkpoint_every=checkpoint_every))
    if prepare is not None:
        prepare(run_dir)
    code = run_engine(prepared.command, prepared.run_dir, timeout_seconds=240)
    assert code == 0, (run_dir / "logs" / "engine.log").read_text()[-3000:]
    return {m.step: m.loss for m in read_metrics(run_dir)}


def copy_checkpoints(source_run: Path, tags: list[str]):
    """Give a new run another run's checkpoints (what a resize to a new layout starts from)."""

    def prepare(run_dir: Path) -> None:
        for tag in tags:
            shutil.copytree(source_run / "checkpoints" / tag, run_dir / "checkpoints" / tag)
        (run_dir / "checkpoints" / "latest").write_text(tags[-1])

    return prepare


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory) -> tuple[Path, dict[int, float]]:
    """p=2 for 8 steps, checkpointing every 4: the uninterrupted trajectory and its checkpoints."""
    run = tmp_path_factory.mktemp("ckpt") / "p2"
    losses = launch(plan_for(2, [(0, 4), (4, 9)]), run, steps=8, checkpoint_every=4)
    return run, losses


@pytest.mark.multiprocess
def test_p2_checkpoint_continues_exactly_in_p1_past_a_corrupted_newer_checkpoint(reference_run, tmp_path):
    source, reference = reference_run
    assert sorted(reference) == list(range(1, 9)) and reference[8] < reference[1]
    run = tmp_path / "p1"
    corrupted: list[Path] = []

    def prepare(run_dir: Path) -> None:
        copy_checkpoints(source, ["step00000004", "step00000008"])(run_dir)
        corrupted.append(run_dir / "checkpoints" / "step00000008" / RANK1)
        flip_a_byte(corrupted[0])

    losses = launch(plan_for(1, [(0, 9)]), run, steps=7, prepare=prepare)
    bad = corrupted[0]
    # Steps 5..7 are retrained from step 4 on one rank: step 5 checks the weights, steps 6 and 7
    # the restored Adam moments (fresh moments would give a different update).
    assert sorted(losses) == [5, 6, 7]
    for step in range(5, 8):
        assert losses[step] == pytest.approx(reference[step], rel=1e-6, abs=0), step
    log = (run / "logs" / "engine.log").read_text()
    assert f"checkpoint step 8 could not be loaded ({bad}: sha256 mismatch" in log
    # The resume marked step 8 as passed over (never loaded, no kept place: the unit test above), and
    # the resumed run's checkpoint of step 7, committed after, removed it.
    assert [info.step for info in ckpt.list_checkpoints(run)] == [4, 7]
    assert ckpt.find_latest_verified(run)[0].step == 7


@pytest.mark.multiprocess
def test_p2_checkpoint_continues_exactly_in_another_cut(reference_run, tmp_path):
    source, reference = reference_run
    run = tmp_path / "recut"
    losses = launch(plan_for(2, [(0, 2), (2, 9)]), run, steps=8, prepare=copy_checkpoints(source, ["step00000004"]))
    for step in range(5, 9):
        assert losses[step] == pytest.approx(reference[step], rel=1e-6, abs=0), step
    final = ckpt.verify_checkpoint(run / "checkpoints" / "step00000008")
    assert final.verified and final.manifest.layout.stage_layers == ((0, 2), (2, 9))


def test_a_checkpoint_a_resume_passed_over_takes_no_kept_place_and_goes_once_a_newer_verifies(tmp_path):
    """A byte flipped in the newest checkpoint: a resume falls back past it and records why; the
    listing (which does not hash) then counts it out of `--keep-checkpoints`, so the next prune
    keeps the older good ones and removes it, not them."""
    for step in (2, 4, 6, 8):
        fake_checkpoint(tmp_path, step)
    flip_a_byte(tmp_path / "checkpoints" / "step00000008" / RANK1)
    assert [info.verified for info in ckpt.list_checkpoints(tmp_path)] == [True] * 4  # sizes only
    passed_over: dict[str, str] = {}
    info, _ = ckpt.resume_point(tmp_path, skipped=passed_over)
    assert info.step == 6 and list(passed_over) == ["step00000008"]
    ckpt.mark_rejected(tmp_path, passed_over)
    assert [info.verified for info in ckpt.list_checkpoints(tmp_path)] == [True, True, True, False]
    assert ckpt.prune_checkpoints(tmp_path, keep=3) == []  # newer than every good one: kept, not counted
    fake_checkpoint(tmp_path, 10)
    removed = ckpt.prune_checkpoints(tmp_path, keep=3)
    assert sorted(p.name for p in removed) == ["step00000002", "step00000008"]
    assert [info.step for info in ckpt.list_checkpoints(tmp_path)] == [4, 6, 10]
    # Passed over again, and the resumed run's next checkpoint is an older step: still newer.
    ckpt.mark_rejected(tmp_path, {"step00000010": "flipped"})
    assert ckpt.prune_checkpoints(tmp_path, keep=3) == []
    rejected = tmp_path / "checkpoints" / "step00000010" / ckpt.REJECTED_FILE
    os.utime(rejected, (rejected.stat().st_mtime - 5, rejected.stat().st_mtime - 5))  # whatever the clock's grain
    fake_checkpoint(tmp_path, 7)
    assert [p.name for p in ckpt.prune_checkpoints(tmp_path, keep=3)] == ["step00000010"]
    assert [info.step for info in ckpt.list_checkpoints(tmp_path)] == [4, 6, 7]
    fake_checkpoint(tmp_path, 10)
    ckpt.mark_rejected(tmp_path, {"step00000010": "once more"})  # marked once: the first reason stays
    ckpt.mark_rejected(tmp_path, {"step00000010": "twice"})
    assert (tmp_path / "checkpoints" / "step00000010" / ckpt.REJECTED_FILE).read_text() == "once more\n"


def test_a_copied_checkpoint_folder_or_an_edited_tag_is_not_verified(tmp_path):
    """What is verified is what loads: the folder by its name, so its manifest must name it."""
    older = fake_checkpoint(tmp_path, 4)
    newest = fake_checkpoint(tmp_path, 8)
    backup = older.parent / "step00000009"  # a user's copy, newer by name than any real one
    shutil.copytree(older, backup)
    latest, warnings = ckpt.find_latest_verified(tmp_path)
    assert latest.tag == "step00000008" and latest.path == newest
    assert "names tag 'step00000004', but lies in folder 'step00000009'" in warnings[0]
    manifest = CheckpointManifest.model_validate_json((newest / "manifest.json").read_text())
    (newest / "manifest.json").write_text(manifest.model_copy(update={"tag": "step00000004"}).model_dump_json())
    latest, _ = ckpt.find_latest_verified(tmp_path)
    assert latest.tag == "step00000004" and latest.path == older


@pytest.mark.parametrize("key", ["/etc/passwd", f"../step00000004/{RANK0}", "zero/../../x.pt", ""])
def test_a_manifest_naming_files_outside_its_folder_is_unreadable(tmp_path, key):
    newest = fake_checkpoint(tmp_path, 8)
    data = CheckpointManifest.model_validate_json((newest / "manifest.json").read_text()).model_dump(mode="json")
    data["files"][key] = "0" * 64
    (newest / "manifest.json").write_text(json.dumps(data))
    problems = ckpt.verify_checkpoint(newest).problems
    assert "unreadable manifest" in problems[0] and "not a relative path inside the checkpoint" in problems[0]


def test_a_linked_file_is_not_a_checkpoints_own(tmp_path):
    older = fake_checkpoint(tmp_path, 4)
    newest = fake_checkpoint(tmp_path, 8)
    target = newest / RANK0
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes(target.read_bytes())  # the same bytes: the hash alone would pass
    target.unlink()
    target.symlink_to(outside)
    assert any("a link" in problem for problem in ckpt.verify_checkpoint(newest).problems)
    latest, _ = ckpt.find_latest_verified(tmp_path)
    assert latest.path == older


class _Payload:
    """What an attacker pickles: unpickling it calls `Path.touch(marker)`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def plant(tag_dir: Path, relative: str, marker: Path) -> Path:
    """Replace one file of a checkpoint with a code-running pickle and re-hash the manifest, as an
    attacker who can write the run directory would: verification alone cannot tell."""
    import torch

    target = tag_dir / relative
    torch.save({"module": _Payload(marker)}, target)
    rehash(tag_dir, relative)
    return target


def test_a_planted_pickle_is_refused_naming_the_file_and_runs_nothing(tmp_path):
    tag_dir = fake_checkpoint(tmp_path, 4)
    marker = tmp_path / "payload-ran"
    planted = plant(tag_dir, RANK0, marker)
    info = ckpt.verify_checkpoint(tag_dir)
    assert info.verified  # the hash matches: only the load can refuse it
    assert ranks.unloadable_problem(info).startswith(f"{planted}: not a pipectl rank file")
    assert not marker.exists()


def test_a_checkpoint_of_an_earlier_format_is_listed_but_not_loaded(tmp_path):
    tag_dir = fake_checkpoint(tmp_path, 4)
    manifest = CheckpointManifest.model_validate_json((tag_dir / "manifest.json").read_text())
    (tag_dir / "manifest.json").write_text(manifest.model_copy(update={"format": "deepspeed-universal"}).model_dump_json())
    info = ckpt.verify_checkpoint(tag_dir)
    assert info.verified
    assert "written in the deepspeed-universal format of an earlier pipectl" in ranks.unloadable_problem(info)


@pytest.mark.multiprocess
def test_resume_refuses_a_planted_pickle_and_runs_nothing(reference_run, tmp_path):
    from pipectl.launch import LaunchOptions, prepare_launch, run_engine

    source, _ = reference_run
    run = tmp_path / "planted"
    marker = tmp_path / "payload-ran"
    prepared = prepare_launch(plan_for(2, [(0, 4), (4, 9)]), run, LaunchOptions(steps=8))
    copy_checkpoints(source, ["step00000004"])(run)
    planted = plant(run / "checkpoints" / "step00000004", RANK1, marker)
    assert run_engine(prepared.command, prepared.run_dir, timeout_seconds=240) != 0
    assert not marker.exists()
    log = (run / "logs" / "engine.log").read_text()
    assert f"{planted}: not a pipectl rank file" in log


def staged_save(run_dir: Path, step: int, *, writer: str = "w999999999-0badc0de") -> Path:
    """What a dead job's writers left: both rank files of `step` written and reported."""
    import torch

    from pipectl.runtime.checkpoint.shards import Fragment, RankHeader, write_rank_file

    staged = ckpt.checkpoints_dir(run_dir) / ckpt.STAGING_DIR / writer / ckpt.tag_for_step(step)
    staged.mkdir(parents=True)
    ckpt.reports_dir(staged).mkdir()
    for rank, name in enumerate((RANK0, RANK1)):
        fragment = Fragment(name="0.weight", group=0, offset=0, start=4 * rank, numel=4, shape=(8,), stage=0)
        header = RankHeader(rank=rank, stage=0, step=step, world_size=2, fragments=[fragment])
        size = write_rank_file(staged / name, {"group0.fp32": torch.full((4,), float(step))}, header).size
        report = {"rank": rank, "world_size": 2, "step": step, "file": name, "sha256": ckpt.sha256_file(staged / name),
                  "bytes": size, **({"data_position": {"step": step}} if rank == 0 else {})}  # fmt: skip
        ckpt.report_path(staged, rank).write_text(json.dumps(report))
    return staged


def test_a_save_every_rank_reported_is_committed_by_the_next_job_and_a_partial_one_is_not(tmp_path):
    fake_checkpoint(tmp_path, 2)
    staged_save(tmp_path, 4)
    partial = staged_save(tmp_path, 6, writer="w999999998-0badc0de")
    ckpt.report_path(partial, 1).unlink()  # rank 1 died before reporting
    errored = staged_save(tmp_path, 8, writer="w999999997-0badc0de")
    report = ckpt.report_path(errored, 0)
    report.write_text(json.dumps({**json.loads(report.read_text()), "error": "rank 0: no space left on device"}))
    live = staged_save(tmp_path, 10, writer=f"w{os.getpid()}-0badc0de")  # a writer still running: not ours

    committed = ckpt.recover_staged(tmp_path)
    assert [p.name for p in committed] == ["step00000004"]
    info = ckpt.verify_checkpoint(tmp_path / "checkpoints" / "step00000004")
    assert info.verified and info.manifest.data_position == {"step": 4} and not ranks.unloadable_problem(info)
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step00000004"
    assert partial.is_dir() and errored.is_dir() and live.is_dir()  # left for the clean-up, or their writer
    ckpt.remove_dead_writers(tmp_path / "checkpoints" / ckpt.STAGING_DIR)
    assert not partial.exists() and not errored.exists() and live.is_dir()


def test_a_save_whose_commit_was_killed_while_writing_its_manifest_is_committed_whole(tmp_path):
    """Rank 0 killed inside the manifest's atomic write leaves its temporary file in the staged
    folder; the next job's commit must not carry it into the checkpoint, which would not load."""
    staged = staged_save(tmp_path, 4)
    (staged / f".{ckpt.MANIFEST_FILE}.k1ll3d.tmp").write_text("{")
    committed = ckpt.recover_staged(tmp_path)
    assert [p.name for p in committed] == ["step00000004"]
    info = ckpt.verify_checkpoint(tmp_path / "checkpoints" / "step00000004")
    assert info.verified and not ranks.unloadable_problem(info), info.problems


def test_a_save_that_does_not_fit_removes_old_checkpoints_but_never_the_newest_good_one(tmp_path, monkeypatch):
    import collections

    from pipectl.runtime.checkpoint import checkpointer

    for step in (2, 4, 6):
        fake_checkpoint(tmp_path, step)
    usage = collections.namedtuple("usage", "total used free")
    free = {"bytes": 0}
    monkeypatch.setattr(checkpointer.shutil, "disk_usage", lambda _path: usage(0, 0, free["bytes"]))
    reserve = checkpointer.MIN_FREE_SPACE_RESERVE_BYTES  # a small checkpoint keeps a small reserve
    free["bytes"] = reserve + 100
    assert checkpointer.make_room(tmp_path, 100, 8) == (None, True)  # fits: nothing removed
    assert [i.step for i in ckpt.list_checkpoints(tmp_path)] == [2, 4, 6]
    reason, intact = checkpointer.make_room(tmp_path, 101, 8)  # never fits: removes all but step 6, then says so
    assert [i.step for i in ckpt.list_checkpoints(tmp_path)] == [6] and intact
    assert reason.startswith("checkpoint step 8 skipped: it needs 0.0 MiB") and "checkpoint step 6 is intact" in reason


def test_the_reserve_scales_with_the_checkpoint_and_a_first_one_without_room_stops_the_job(tmp_path, monkeypatch):
    """A 4 MiB checkpoint on a disk with 9 MiB free is saved (a fixed 256 MiB reserve skipped every
    one); a first checkpoint with no room at all stops the job instead of training steps that
    could never be resumed, unless told to train on."""
    import collections

    from pipectl.runtime.checkpoint import checkpointer

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(checkpointer.shutil, "disk_usage", lambda _path: usage(0, 0, 9 << 20))
    assert checkpointer.make_room(tmp_path, 4 << 20, 2) == (None, True)
    reason, intact = checkpointer.make_room(tmp_path, 12 << 20, 2)
    assert not intact and "the run has no earlier checkpoint" in reason

    class Host:
        def capture(self, engine, step, data_position, overlap=False):
            return type("Snapshot", (), {"bytes": 12 << 20, "copied": None})()

    saver = checkpointer.Checkpointer(tmp_path, keep=3)
    saver.host = Host()
    with pytest.raises(CheckpointError, match="stopped after step 2, since no step trained from here could be resumed"):
        saver.save(None, 2, {})
    trains_on = checkpointer.Checkpointer(tmp_path, keep=3, train_without_checkpoints=True)
    trains_on.host = Host()
    trains_on.save(None, 2, {})  # skipped, recorded, and training goes on
    assert ckpt.read_events(tmp_path)[-1].message.endswith("; training goes on")


def test_rank0_stops_waiting_for_the_report_of_a_rank_killed_on_this_host(tmp_path):
    """A rank killed before it reported its file never will: rank 0 ends the commit's wait as soon
    as the rank's heartbeat names a process that has ended, not at the commit timeout (a peer's
    death left the job waiting 30 s, until its launcher killed the ranks it had asked to stop)."""
    import socket
    import subprocess
    import sys
    import time

    from pipectl.artifacts.run import CheckpointOutcome, RankHeartbeat
    from pipectl.io import write_json_atomic
    from pipectl.rundir.heartbeats import write_heartbeat
    from pipectl.runtime.checkpoint.checkpointer import Checkpointer, _Save

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    now = time.time()
    write_heartbeat(tmp_path, RankHeartbeat(rank=1, pid=ended.pid, host=socket.gethostname(), stage=1, step=4,
                                            phase="step", started_unix=now - 5, beat_unix=now, progress_unix=now))  # fmt: skip
    saver = Checkpointer(tmp_path, keep=2, commit_timeout_seconds=120.0)
    saver.world_size = 2  # rank 0 of two; rank 1 wrote nothing
    save = _Save(step=4, staged=saver.writer / ckpt.tag_for_step(4), stall_seconds=0.0, started=time.perf_counter(),
                 data_position={})  # fmt: skip
    save.staged.mkdir(parents=True)
    write_json_atomic(ckpt.report_path(save.staged, 0), {"rank": 0, "world_size": 2, "step": 4, "file": "x", "sha256": "0", "bytes": 1})
    started = time.monotonic()
    event = saver._commit(save)
    assert time.monotonic() - started < 30
    assert event.outcome is CheckpointOutcome.FAILED
    assert event.message.startswith("checkpoint step 4 was not committed: rank 1 (stage 1, pid")
    assert "ended without a word in step 4" in event.message
    assert not save.staged.exists()  # nothing loadable left behind


class StepHost:
    """A rank's host snapshot (`HostSnapshot.capture`) of the state after `step`: its 4 elements of
    one parameter, each holding the step."""

    def __init__(self, rank: int = 0, world_size: int = 1) -> None:
        self.rank, self.world_size = rank, world_size

    def capture(self, engine, step, data_position, overlap=False):
        import torch

        from pipectl.runtime.checkpoint.shards import Fragment, RankHeader
        from pipectl.runtime.checkpoint.snapshot import Snapshot

        rank, world = self.rank, self.world_size
        fragment = Fragment(name="0.weight", group=0, offset=0, start=4 * rank, numel=4, shape=(4 * world,), stage=0)
        header = RankHeader(rank=rank, stage=0, step=step, world_size=world, data_parallel_rank=rank, fragments=[fragment])
        return Snapshot({"group0.fp32": torch.full((4,), float(step))}, header)


def test_a_checkpoint_due_while_the_last_one_is_written_is_deferred_not_waited_for(tmp_path, monkeypatch):
    """A disk slower than the checkpoints are asked for costs checkpoints, not training time: a due
    checkpoint whose predecessor is still being written is taken at the first step boundary after
    the write ends, holds that step's state, and says which step it was due at; the last one waits."""
    import threading

    from safetensors.torch import load_file

    from pipectl.runtime.checkpoint import checkpointer

    gate = threading.Event()
    real_write = checkpointer.write_rank_file

    def slow_disk(path, tensors, header):
        if header.step == 4:
            assert gate.wait(30), "the test's gate never opened"
        return real_write(path, tensors, header)

    monkeypatch.setattr(checkpointer, "write_rank_file", slow_disk)
    monkeypatch.setattr(checkpointer, "DEFER_AFTER_SECONDS", 0.01)
    saver = checkpointer.Checkpointer(tmp_path, keep=3)
    saver.host = StepHost()
    assert saver.save(None, 4, {"step": 4}, defer=True) is not None
    assert saver.save(None, 8, {"step": 8}, defer=True) is None and saver.deferred == 8
    assert saver.save(None, 9, {"step": 9}, defer=True) is None and saver.deferred == 8
    gate.set()
    saver._inflight.written.wait(30)
    assert saver.save(None, 10, {"step": 10}, defer=True) is not None and saver.deferred is None
    saver.save(None, 12, {"step": 12})  # the last: waits for the write before it, however long
    saver.finish()
    events = ckpt.read_events(tmp_path)
    assert [(e.step, e.outcome.value, e.due_step) for e in events] == [
        (4, "committed", None), (10, "committed", 8), (12, "committed", None)
    ]
    infos = {info.step: info for info in ckpt.list_checkpoints(tmp_path)}
    assert sorted(infos) == [4, 10, 12] and all(info.verified for info in infos.values())
    assert load_file(infos[10].path / RANK0)["group0.fp32"].tolist() == [10.0] * 4


def _deferring_rank(rank: int, port: int, run_dir: Path, gate: Path, out: Path) -> None:
    """One of two gloo ranks: rank 1's write of step 2 waits for `gate`; `out`: where it took what."""
    import time

    import torch.distributed as dist

    from pipectl.runtime.checkpoint import checkpointer

    real_write = checkpointer.write_rank_file

    def slow_disk(path, tensors, header):
        while header.step == 2 and rank == 1 and not gate.exists():
            time.sleep(0.01)
        return real_write(path, tensors, header)

    checkpointer.write_rank_file = slow_disk
    checkpointer.DEFER_AFTER_SECONDS = 0.01
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    saver = checkpointer.Checkpointer(run_dir, keep=3)
    saver.host = StepHost(rank, world_size=2)
    taken = [saver.save(None, 2, {"step": 2}, defer=True) is not None, saver.save(None, 4, {"step": 4}, defer=True) is None]
    if rank == 0:
        gate.touch()
    for step in range(5, 2000):
        if saver.save(None, step, {"step": step}, defer=True) is not None:
            break
        time.sleep(0.01)
    saver.finish()
    out.write_text(json.dumps({"first_saved_and_then_deferred": taken, "taken_at": step}))
    dist.destroy_process_group()


@pytest.mark.multiprocess
def test_every_rank_defers_while_any_rank_still_writes_and_takes_it_at_the_same_step(tmp_path):
    """Rank 1's disk is slow: both ranks defer the due checkpoint (one gather decides), then take it
    at the same later boundary; it commits whole, naming the step it was due at."""
    import multiprocessing
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = multiprocessing.get_context("fork")
    outs = [tmp_path / f"rank{rank}.json" for rank in range(2)]
    ranks = [context.Process(target=_deferring_rank, args=(rank, port, tmp_path / "run", tmp_path / "gate", outs[rank]))
             for rank in range(2)]  # fmt: skip
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(120)
    for process in ranks:
        if process.is_alive():  # a rank stuck in a collective the other never joined
            process.kill()
    assert [process.exitcode for process in ranks] == [0, 0]
    results = [json.loads(out.read_text()) for out in outs]
    assert results[0] == results[1] and results[0]["first_saved_and_then_deferred"] == [True, True]
    taken_at = results[0]["taken_at"]
    events = ckpt.read_events(tmp_path / "run")
    assert [(e.step, e.outcome.value, e.due_step) for e in events] == [(2, "committed", None), (taken_at, "committed", 4)]
    assert all(info.verified for info in ckpt.list_checkpoints(tmp_path / "run"))

"""Morph history: records round-trip, downtime filled from the first step after the relaunch."""

from __future__ import annotations

import pytest

from pipectl.artifacts.morph import MORPHS_FILE, MorphRecord
from pipectl.artifacts.run import METRICS_FILE, ResumeRecord, StepMetrics
from pipectl.rundir.morph_history import append_record, read_history, read_records, record_layout_change, update_downtimes, with_downtime
from pipectl.rundir.failures import write_resume
from pipectl.rundir.metrics import MetricsWriter


def record(**overrides) -> MorphRecord:
    fields = dict(
        requested_unix=1000.0, requested_devices=1, from_devices=2, from_layout="t1p2d1 1f1b b2 m4",
        to_devices=1, to_layout="t1p1d1 1f1b b2 m4", global_batch=8, resume_step=10, target_steps=20,
        stopped_running_job=True, stop_seconds=2.5, relaunched_unix=1003.0, plan_source="morph-table",
    )  # fmt: skip
    fields.update(overrides)
    return MorphRecord(**fields)


def metrics(step: int, time_unix: float, layout: str = "t1p1d1 1f1b b2 m4") -> StepMetrics:
    return StepMetrics(
        step=step, loss=4.0, step_seconds=0.1, samples_per_second=80.0, global_batch=8,
        world_size=1, layout=layout, time_unix=time_unix,
    )  # fmt: skip


def test_records_round_trip_in_order(tmp_path):
    first, second = record(), record(requested_unix=2000.0, relaunched_unix=2004.0, resume_step=20)
    append_record(tmp_path, first)
    append_record(tmp_path, second)
    assert read_records(tmp_path) == [first, second]


def test_downtime_is_request_to_first_step_after_relaunch():
    rows = [metrics(9, 990.0, "t1p2d1 1f1b b2 m4"), metrics(10, 1001.0, "t1p2d1 1f1b b2 m4"), metrics(12, 1011.0), metrics(11, 1009.25)]
    filled = with_downtime(record(), rows)
    assert filled.first_step_unix == 1009.25
    assert filled.downtime_seconds == pytest.approx(9.25)


def test_no_step_yet_leaves_downtime_unknown():
    assert with_downtime(record(), [metrics(10, 1001.0)]).downtime_seconds is None
    assert with_downtime(record(relaunched_unix=None), [metrics(11, 1009.0)]).downtime_seconds is None


def test_recomputed_steps_after_a_crash_count_too():
    # The old job trained to step 12 but its checkpoint is at 10: step 11 is trained again.
    rows = [metrics(11, 1008.0)]
    assert with_downtime(record(resume_step=10), rows).downtime_seconds == pytest.approx(8.0)


def test_read_history_fills_and_update_writes_back(tmp_path):
    append_record(tmp_path, record())
    writer = MetricsWriter(tmp_path, rank=0)
    writer.write(metrics(11, 1007.5))
    assert read_records(tmp_path)[0].downtime_seconds is None
    assert read_history(tmp_path)[0].downtime_seconds == pytest.approx(7.5)
    update_downtimes(tmp_path)
    assert read_records(tmp_path)[0].downtime_seconds == pytest.approx(7.5)


def test_a_torn_line_is_skipped(tmp_path):
    append_record(tmp_path, record())
    with (tmp_path / MORPHS_FILE).open("a") as handle:
        handle.write('{"schema_version": 1, "trigger": "res')
    assert len(read_records(tmp_path)) == 1
    assert read_history(tmp_path / "missing") == []


def test_first_step_time_without_downtime_is_rejected():
    with pytest.raises(ValueError, match="downtime_seconds"):
        record(first_step_unix=1009.0)


def test_an_elastic_relaunch_on_another_layout_is_recorded_once(tmp_path):
    writer = MetricsWriter(tmp_path, rank=0)
    writer.write(metrics(11, 1011.0, "t1p2d1 1f1b b2 m4"))
    writer.write(metrics(12, 1012.0, "t1p2d1 1f1b b2 m4"))
    kwargs = dict(to_layout="t1p1d1 1f1b b2 m4", to_devices=1, global_batch=8, resume_step=10, target_steps=30)
    # As rank 0 does it: its resume record first (steps past 10 are abandoned for the run's readers),
    # then the morph, whose downtime still runs from the last step trained on the old layout.
    write_resume(tmp_path, ResumeRecord(step=10, tag="step00000010", time_unix=1019.0))
    # The launcher started before the old layout's last step: the group was re-formed within it.
    record = record_layout_change(tmp_path, now_unix=1020.0, launched_unix=1000.0, **kwargs)
    assert record.trigger.value == "elastic" and record.from_layout == "t1p2d1 1f1b b2 m4"
    assert record.requested_unix == 1012.0 and record.relaunched_unix == 1020.0
    assert "steps after 10 are trained again" in record.notes[0]
    writer.write(metrics(11, 1025.0))
    (stored,) = read_history(tmp_path)
    assert stored.downtime_seconds == pytest.approx(13.0)  # 1012 -> 1025
    # A restart on the layout that ran last is no morph.
    assert record_layout_change(tmp_path, now_unix=1030.0, **kwargs) is None
    assert len(read_records(tmp_path)) == 1


def test_a_person_resuming_with_another_plan_is_recorded_as_that_and_timed_from_the_launch(tmp_path):
    """`launch --resume` with another layout's plan, minutes after the run finished: recorded as
    an elastic restart whose downtime was the time between the two launches, with steps 'trained
    again' that were not."""
    writer = MetricsWriter(tmp_path, rank=0)
    writer.write(metrics(16, 1016.0, "t1p1d1 1f1b b8 m2"))
    kwargs = dict(to_layout="t1p2d1 1f1b b8 m2", to_devices=2, global_batch=16, resume_step=16, target_steps=20)
    record = record_layout_change(tmp_path, now_unix=1250.0, launched_unix=1240.0, **kwargs)
    assert record.trigger.value == "resume" and record.plan_source == "chosen"
    assert record.requested_unix == record.relaunched_unix == 1250.0
    assert record.notes == ["launched again with --resume and a plan of another layout: 1 -> 2 ranks"]
    writer.write(metrics(17, 1254.0, "t1p2d1 1f1b b8 m2"))
    (stored,) = read_history(tmp_path)
    assert stored.downtime_seconds == pytest.approx(4.0)  # this launch's start -> its first step


def test_an_uneven_layout_labelled_before_shares_were_counted_is_the_same_layout(tmp_path):
    """metrics.jsonl of a run trained before labels counted uneven shares ('1x6+1x5+1x5'): a restart
    on that layout (now 'b1 m6+5*2') is no morph, and its steps are the layout's."""
    (tmp_path / METRICS_FILE).write_text(metrics(11, 1011.0, "t1p1d3 1f1b 1x6+1x5+1x5").model_dump_json()
                                         .replace("b1 m6+5*2", "1x6+1x5+1x5") + "\n")  # fmt: skip
    assert "1x6+1x5+1x5" in (tmp_path / METRICS_FILE).read_text()  # as the older version wrote it
    kwargs = dict(to_layout="t1p1d3 1f1b b1 m6+5*2", to_devices=3, global_batch=16, resume_step=11, target_steps=30)
    assert record_layout_change(tmp_path, now_unix=1020.0, **kwargs) is None
    assert read_records(tmp_path) == []


def test_a_relaunch_already_recorded_by_resize_is_not_recorded_again(tmp_path):
    MetricsWriter(tmp_path, rank=0).write(metrics(10, 1001.0, "t1p2d1 1f1b b2 m4"))
    append_record(tmp_path, record(relaunched_unix=1003.0))
    assert record_layout_change(
        tmp_path, to_layout="t1p1d1 1f1b b2 m4", to_devices=1, global_batch=8, resume_step=10, target_steps=20
    ) is None
    assert record_layout_change(
        tmp_path / "empty", to_layout="x", to_devices=1, global_batch=8, resume_step=0, target_steps=1
    ) is None


def test_a_rank_knows_when_its_launcher_started():
    """What tells an elastic re-formation (within one launch) from a resume (a new launch)."""
    import os
    import time

    import psutil

    from pipectl.runtime.worker import _launcher_started_unix

    assert _launcher_started_unix() == psutil.Process(os.getppid()).create_time() <= time.time()

"""metrics.jsonl on a disk that refuses writes: the job goes on, no torn line is left, and the
held lines are written once the disk takes them again."""

from __future__ import annotations

import errno
import os

from pipectl.artifacts.run import StepMetrics
from pipectl.rundir.metrics import MetricsWriter, read_metrics_and_unreadable, read_refusals


def step(n: int) -> StepMetrics:
    return StepMetrics(step=n, loss=5.0 - n / 10, step_seconds=0.1, samples_per_second=80.0, global_batch=8, world_size=2)


def test_a_full_disk_holds_the_lines_cuts_the_torn_one_and_writes_them_later(tmp_path, monkeypatch):
    (tmp_path / "logs").mkdir()
    writer = MetricsWriter(tmp_path, rank=0)
    writer.write(step(1))
    real_write = os.write
    full = {"on": True}

    def half_then_full(fd, data):
        if full["on"]:
            real_write(fd, data[: len(data) // 2])  # part of the line lands, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", half_then_full)
    writer.write(step(2))  # refused: no exception reaches the training loop
    writer.write(step(3))
    metrics, unreadable = read_metrics_and_unreadable(tmp_path)
    assert [m.step for m in metrics] == [1] and unreadable == []  # no torn line left behind
    assert (tmp_path / "metrics.jsonl").read_text().endswith("\n")
    assert writer.failed_writes == 2 and len(writer.pending) == 2

    assert read_refusals(tmp_path) == []  # recorded once the lines are written, not meanwhile

    full["on"] = False
    writer.write(step(4))
    metrics, unreadable = read_metrics_and_unreadable(tmp_path)
    assert [m.step for m in metrics] == [1, 2, 3, 4] and unreadable == [] and writer.pending == []
    (refusal,) = read_refusals(tmp_path)
    assert refusal.file == "metrics.jsonl" and refusal.lines == 2 and "No space left on device" in refusal.error
    assert refusal.first_unix <= refusal.written_unix


def test_the_terminal_is_told_once_that_the_disk_is_full(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from pipectl.cli.launch import LowDiskWatch

    usage = namedtuple("usage", "total used free")
    free = {"bytes": 10 * 2**30}
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2**40, 0, free["bytes"]))
    watch = LowDiskWatch(tmp_path, every_seconds=0.0)
    assert watch.check() == []
    free["bytes"] = 3 * 2**20
    (said,) = watch.check()
    assert str(tmp_path) in said and "has 3 MiB free" in said and "training goes on" in said
    assert watch.check() == []  # once
    # A run with no checkpoint yet, which its first checkpoint would stop without room: not "goes on".
    (first,) = LowDiskWatch(tmp_path, every_seconds=0.0, trains_without_checkpoints=False).check()
    assert "no checkpoint yet: a first checkpoint that finds no room stops the run" in first and "goes on" not in first


def test_a_disk_full_for_a_moment_is_named_on_the_terminal_once_the_lines_are_written(tmp_path, monkeypatch):
    """Between two looks at the free space the disk filled and emptied: the spell recorded by the
    rank is what the terminal says, once."""
    import shutil
    from collections import namedtuple

    from pipectl.cli.launch import LowDiskWatch

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2**40, 0, 10 * 2**30))
    (tmp_path / "logs").mkdir()
    watch = LowDiskWatch(tmp_path, every_seconds=0.0)
    writer = MetricsWriter(tmp_path, rank=0)
    real_write = os.write

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    writer.write(step(1))
    assert watch.check() == []
    monkeypatch.setattr(os, "write", real_write)
    writer.write(step(2))
    (said,) = watch.check()
    assert said.startswith("metrics.jsonl could not be written for ") and "No space left on device" in said
    assert "1 line waited in memory and is written now; training went on" in said
    assert watch.check() == []


def test_a_line_nested_too_deeply_is_skipped_like_any_bad_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(step(1).model_dump_json() + "\n" + "[" * 10_000 + "]" * 10_000 + "\n")
    metrics, unreadable = read_metrics_and_unreadable(tmp_path)
    assert [m.step for m in metrics] == [1] and unreadable == [2]

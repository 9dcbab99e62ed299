"""metrics.jsonl: rank 0 appends one line per step; readers survive torn lines and re-trained steps;
memory per rank and stage against the plan's figure."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pipectl.artifacts.run import RankTiming, StepMetrics
from pipectl.rundir.metrics import MetricsWriter, memory_summary, parse_metrics_lines, prediction_summary, rank_memory, read_metrics


def metrics(step: int, loss: float = 1.0, seconds: float = 0.1, predicted: float | None = 0.1) -> StepMetrics:
    return StepMetrics(
        step=step, loss=loss, step_seconds=seconds, predicted_step_seconds=predicted,
        samples_per_second=8 / seconds, global_batch=8, world_size=2,
        ranks=[RankTiming(rank=0, stage=0, forward_seconds=0.01, backward_seconds=0.02)],
    )  # fmt: skip


def test_rank0_appends_one_line_per_step_and_others_write_nothing(tmp_path):
    MetricsWriter(tmp_path, rank=0).write(metrics(1, loss=3.0))
    MetricsWriter(tmp_path, rank=1).write(metrics(2))
    MetricsWriter(tmp_path, rank=0).write(metrics(2, loss=2.5))
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    read = read_metrics(tmp_path)
    assert [m.loss for m in read] == [3.0, 2.5]
    assert read[0].ranks[0].backward_seconds == pytest.approx(0.02)


def test_a_step_line_is_the_same_size_at_any_world_size_and_the_rank_detail_joins_back(tmp_path):
    """Each rank's timings go to logs/ranks.jsonl, not into the step's line: at 3,072 ranks the line
    would grow by ~320 bytes a rank (about 1 MB a step). Readers see them joined by step and layout;
    a step trained again (after a resume) takes its last detail."""
    sizes = {}
    for world in (2, 3072):
        run = tmp_path / f"w{world}"
        line = metrics(1).model_copy(update={"world_size": world, "layout": "t1p2d1 1f1b b2 m4", "ranks": [
            RankTiming(rank=r, stage=r % 2, host=f"node{r // 8:04d}", forward_seconds=0.01, backward_seconds=0.02,
                       peak_allocated_bytes=2**34) for r in range(world)]})  # fmt: skip
        MetricsWriter(run, rank=0).write(line)
        sizes[world] = len((run / "metrics.jsonl").read_bytes())
        assert read_metrics(run) == [line]
    assert sizes[3072] - sizes[2] == len("3072") - len("2")  # the world size's digits, nothing else
    retrained = metrics(1, loss=0.5).model_copy(update={"layout": "t1p2d1 1f1b b2 m4", "ranks": [RankTiming(
        rank=0, stage=0, forward_seconds=9.0, backward_seconds=0.02)]})  # fmt: skip
    MetricsWriter(tmp_path / "w2", rank=0).write(retrained)
    assert read_metrics(tmp_path / "w2")[0].ranks[0].forward_seconds == 9.0


def test_torn_last_line_is_ignored_and_retrained_steps_keep_the_last_line():
    lines = [
        metrics(1, loss=3.0).model_dump_json(),
        metrics(2, loss=2.0).model_dump_json(),
        metrics(2, loss=2.2).model_dump_json(),  # step 2 trained again after a restart
        metrics(3).model_dump_json()[:20],  # the job is writing this line right now
    ]
    parsed = parse_metrics_lines(lines)
    assert [(m.step, m.loss) for m in parsed] == [(1, 3.0), (2, 2.2)]


def test_a_run_resumed_from_an_older_checkpoint_drops_the_steps_it_abandoned(tmp_path):
    """Killed at step 6 with its newest checkpoint at step 3: the resumed run logs 4 and 5 again.
    Steps 6 of the first start are of an abandoned timeline, not what the run has trained (status
    said 'stopped at step 6' after a resume stopped at 5, and refused --steps 5.5 as not beyond 6);
    the launch's progress follows the new lines. From its resume record on, before it logs a step,
    the run stands at the checkpoint."""
    from pipectl.artifacts.run import LOGS_DIR, PREVIOUS_RESUME_FILE, RESUME_FILE, ResumeRecord
    from pipectl.io import write_json_atomic
    from pipectl.rundir.metrics import MetricsTail

    first = [metrics(step, loss=1.0).model_copy(update={"time_unix": 100.0 + step}) for step in range(1, 7)]
    for line in first:
        MetricsWriter(tmp_path, rank=0).write(line)
    tail = MetricsTail(tmp_path)
    assert tail.latest().step == 6
    write_json_atomic(tmp_path / LOGS_DIR / RESUME_FILE, ResumeRecord(step=3, tag="step00000003", time_unix=200.0))
    assert [m.step for m in read_metrics(tmp_path)] == [1, 2, 3]  # resumed: nothing logged yet
    # The next start puts the record aside; dead before its own, the run still stands at step 3.
    os.replace(tmp_path / LOGS_DIR / RESUME_FILE, tmp_path / LOGS_DIR / PREVIOUS_RESUME_FILE)
    assert [m.step for m in read_metrics(tmp_path)] == [1, 2, 3]
    assert [m.step for m in read_metrics(tmp_path, as_resumed=False)] == [1, 2, 3, 4, 5, 6]  # what was trained
    os.replace(tmp_path / LOGS_DIR / PREVIOUS_RESUME_FILE, tmp_path / LOGS_DIR / RESUME_FILE)
    for step in (4, 5):
        MetricsWriter(tmp_path, rank=0).write(metrics(step, loss=0.5).model_copy(update={"time_unix": 200.0 + step}))
    assert [(m.step, m.loss) for m in read_metrics(tmp_path)] == [(1, 1.0), (2, 1.0), (3, 1.0), (4, 0.5), (5, 0.5)]
    assert tail.latest().step == 5
    # Without the record (an older run), the lines alone say the same once the new timeline logs.
    (tmp_path / LOGS_DIR / RESUME_FILE).unlink()
    assert [m.step for m in read_metrics(tmp_path)] == [1, 2, 3, 4, 5]
    # A launch's progress follows its own job only: the steps a resume abandoned are not where it stands.
    from_now = MetricsTail(tmp_path, from_end=True)
    assert from_now.latest() is None
    MetricsWriter(tmp_path, rank=0).write(metrics(6, loss=0.4).model_copy(update={"time_unix": 206.0}))
    assert from_now.latest().step == 6


def test_missing_file_means_no_steps(tmp_path):
    assert read_metrics(tmp_path) == []


def test_prediction_summary_skips_warmup_and_missing_predictions():
    rows = [metrics(1, seconds=5.0), metrics(2, seconds=0.2), metrics(3, seconds=0.1), metrics(4, predicted=None)]
    summary = prediction_summary(rows)
    assert summary.steps == 2
    assert summary.max_abs_error == pytest.approx(0.5)  # |0.2 - 0.1| / 0.2
    assert summary.median_abs_error == pytest.approx(0.25)
    assert summary.median_predicted_seconds == pytest.approx(0.1)
    assert prediction_summary([metrics(1)]) is None


def test_metrics_tail_reads_only_appended_lines_and_restarts_on_a_rewritten_file(tmp_path):
    from pipectl.artifacts.run import METRICS_FILE, StepMetrics
    from pipectl.rundir.metrics import MetricsTail

    def line(step: int) -> str:
        return StepMetrics(step=step, loss=1.0 / step, step_seconds=0.1, samples_per_second=10.0,
                           global_batch=1, world_size=1).model_dump_json() + "\n"  # fmt: skip

    path = tmp_path / METRICS_FILE
    tail = MetricsTail(tmp_path)
    assert tail.latest() is None  # no file yet
    path.write_text(line(1) + line(2))
    assert tail.latest().step == 2
    offset = tail.offset
    with path.open("a") as handle:
        handle.write(line(3)[:20])  # torn: the rank is still writing it
    assert tail.latest().step == 2 and tail.offset == offset
    with path.open("a") as handle:
        handle.write(line(3)[20:])
    assert tail.latest().step == 3
    assert tail.latest().step == 3  # nothing new: the last step stays
    path.write_text(line(1))  # rewritten shorter
    assert tail.latest().step == 1


def test_lines_written_before_memory_was_recorded_still_load():
    old = (
        '{"step": 1, "loss": 2.0, "step_seconds": 0.1, "samples_per_second": 80.0, "global_batch": 8, '
        '"world_size": 1, "ranks": [{"rank": 0, "stage": 0, "forward_seconds": 0.01, "backward_seconds": 0.02}]}'
    )
    (line,) = parse_metrics_lines([old])
    assert line.predicted_peak_memory_bytes == [] and line.ranks[0].peak_rss_bytes is None
    assert memory_summary([line]) is None


def with_memory(step: int, layout: str, peaks: dict[int, tuple[int, int]], predicted: list[int], *, cuda: bool):
    """A line whose ranks (rank -> (stage, peak)) measured `peak` bytes, on CUDA or as RSS."""
    ranks = [
        RankTiming(
            rank=rank, stage=stage, forward_seconds=0.0, backward_seconds=0.0,
            peak_allocated_bytes=peak if cuda else None, peak_reserved_bytes=peak + 100 if cuda else None,
            peak_rss_bytes=10 * peak,
        )
        for rank, (stage, peak) in peaks.items()
    ]  # fmt: skip
    return StepMetrics(
        step=step, loss=1.0, step_seconds=1.0, samples_per_second=1.0, global_batch=4, world_size=len(ranks),
        layout=layout, ranks=ranks, predicted_peak_memory_bytes=predicted,
    )  # fmt: skip


def test_memory_summary_takes_each_stages_highest_peak_over_its_ranks_and_the_last_layouts_steps():
    lines = [
        with_memory(1, "p1", {0: (0, 5000)}, [4000], cuda=True),  # before a resize: not counted
        with_memory(2, "p2d2", {0: (0, 900), 1: (0, 1100), 2: (1, 700), 3: (1, 600)}, [1000, 800], cuda=True),
        with_memory(3, "p2d2", {0: (0, 1000), 1: (0, 1000), 2: (1, 800), 3: (1, 500)}, [1000, 800], cuda=True),
    ]
    summary = memory_summary(lines)
    assert summary.measure == "cuda" and summary.comparable and summary.layout == "p2d2" and summary.steps == 2
    first, second = summary.stages
    assert (first.stage, first.ranks, first.measured_bytes, first.reserved_bytes) == (0, (0, 1), 1100, 1200)
    assert first.error == pytest.approx((1000 - 1100) / 1100)  # under-predicted: negative
    assert (second.measured_bytes, second.error) == (800, 0.0)
    payload = summary.to_dict()
    assert payload["measured_field"] == "peak_allocated_bytes" and payload["stages"][0]["ranks"] == [0, 1]


def test_on_cpu_the_summary_is_rss_and_claims_no_error():
    lines = [with_memory(1, "p2", {0: (0, 100), 1: (1, 300)}, [], cuda=False)]
    summary = memory_summary(lines, predicted_bytes=[500, 1000])  # the plan's, for lines without it
    assert summary.measure == "rss" and not summary.comparable
    assert [(s.measured_bytes, s.predicted_bytes, s.ratio) for s in summary.stages] == [(1000, 500, 2.0), (3000, 1000, 3.0)]
    payload = summary.to_dict()
    assert payload["note"].startswith("RSS is the whole process")
    assert [stage["error"] for stage in payload["stages"]] == [None, None]


def test_peak_rss_is_measured_in_bytes_and_follows_what_the_process_touched():
    """A fresh interpreter touches 128 MiB: its peak RSS grows by about that much (not by all of it:
    the peak before may exceed the RSS it grew from). And it starts from its own size, not from its
    parent's: getrusage's ru_maxrss would carry this process's 256 MiB over into the child."""
    code = (
        "from pipectl.rundir.metrics import rank_memory\n"
        "before = rank_memory('cpu').peak_rss_bytes\n"
        "block = b'x' * (128 << 20)\n"
        "print(before, rank_memory('cpu').peak_rss_bytes)\n"
    )
    parent_block = b"y" * (256 << 20)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    del parent_block
    before, after = map(int, out.split())
    assert before < 200 << 20
    assert 96 << 20 <= after - before <= 160 << 20
    memory = rank_memory("cpu")
    assert memory.peak_allocated_bytes is None and memory.peak_reserved_bytes is None and memory.peak_rss_bytes > 0

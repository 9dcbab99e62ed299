"""metrics.jsonl: rank 0 appends one line per step; readers survive torn lines and re-trained steps."""

from __future__ import annotations

import json

import pytest

from pipectl.artifacts.run import RankTiming, StepMetrics
from pipectl.runtime.metrics import MetricsWriter, parse_metrics_lines, prediction_summary, read_metrics


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


def test_torn_last_line_is_ignored_and_retrained_steps_keep_the_last_line():
    lines = [
        metrics(1, loss=3.0).model_dump_json(),
        metrics(2, loss=2.0).model_dump_json(),
        metrics(2, loss=2.2).model_dump_json(),  # step 2 trained again after a restart
        metrics(3).model_dump_json()[:20],  # the job is writing this line right now
    ]
    parsed = parse_metrics_lines(lines)
    assert [(m.step, m.loss) for m in parsed] == [(1, 3.0), (2, 2.2)]


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
    from pipectl.runtime.metrics import MetricsTail

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

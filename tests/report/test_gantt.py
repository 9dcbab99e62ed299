import re

import pytest

from pipectl.errors import UserInputError
from pipectl.plan.simulate import simulate
from pipectl.plan.stage_costs import uniform_costs
from pipectl.report.gantt import KIND_COLOURS, describe, gantt_figure, micro_batch_id, terminal_gantt, write_gantt
from pipectl.schedule import ScheduleKind, generate


@pytest.fixture(scope="module")
def timeline():
    return simulate(generate(ScheduleKind.ONE_F_ONE_B, 3, 4), uniform_costs(3, 1, 1.0, 2.0, allreduce=0.5, optimizer=0.5))


def test_terminal_rows_are_one_per_rank_and_proportional(timeline):
    width = 60
    lines = terminal_gantt(timeline, width=width).plain.splitlines()
    assert len(lines) == 3 + 2  # the ranks, the legend, the step
    for rank, line in enumerate(lines[:3]):
        assert line.startswith(f"rank {rank} ")
        assert len(line) == len("rank 0 ") + width
    # rank 2 (last stage) starts after two forwards: 2/19 of the step idle, ~6 cells
    idle_cells = len(lines[2]) - len(lines[2][len("rank 2 "):].lstrip("·")) - len("rank 2 ")
    assert idle_cells == round(2 / timeline.step_seconds * width)
    assert lines[0][len("rank 0 "):].startswith("F0")
    assert lines[-1] == describe(timeline)
    assert lines[-2] == "F forward, B backward, A all-reduce, S optimizer step, · idle; F3: micro-batch 3"


def test_terminal_cells_carry_the_kind_colours():
    costs = uniform_costs(3, 1, 1.0, 2.0, allreduce=0.5, optimizer=0.5)
    text = terminal_gantt(simulate(generate(ScheduleKind.GPIPE, 3, 4, recompute=True), costs), width=60)
    styles = {str(span.style) for span in text.spans}
    zero_bubble = terminal_gantt(simulate(generate(ScheduleKind.ZB_H1, 3, 4), costs), width=60)
    styles |= {str(span.style) for span in zero_bubble.spans}  # the split backward's I and W
    for kind, colour in KIND_COLOURS.items():
        assert f"white on {colour}" in styles, kind


def test_terminal_marks_later_chunks_in_lower_case():
    interleaved = simulate(generate(ScheduleKind.INTERLEAVED, 2, 4, 2), uniform_costs(2, 2, 1.0, 2.0))
    plain = terminal_gantt(interleaved, width=200).plain
    assert "f0" in plain and "b0" in plain and "F0" in plain


def test_describe_gives_step_and_mean_bubble(timeline):
    assert describe(timeline) == f"step {timeline.step_seconds:.4g} s, bubble {100 * sum(timeline.bubble_fraction) / 3:.1f}%"


def test_figure_has_one_bar_per_record_and_a_titled_axis(timeline):
    figure = gantt_figure(timeline, title="1f1b p=3 m=4")
    axes = figure.axes[0]
    assert len(axes.patches) == len(timeline.records)
    assert axes.get_title().startswith("1f1b p=3 m=4: step ")
    assert [t.get_text() for t in axes.get_yticklabels()] == ["rank 0", "rank 1", "rank 2"]
    numbers = sorted(t.get_text() for t in axes.texts)
    assert numbers.count("0") == 6  # F0 and B0 on each of 3 ranks


@pytest.mark.parametrize("suffix, magic", [(".png", b"\x89PNG"), (".svg", b"<?xml"), (".pdf", b"%PDF")])
def test_write_gantt_picks_the_format_from_the_suffix(tmp_path, timeline, suffix, magic):
    path = write_gantt(timeline, tmp_path / f"step{suffix}")
    assert path.read_bytes().startswith(magic)


def test_write_gantt_rejects_other_suffixes(tmp_path, timeline):
    with pytest.raises(UserInputError, match=r"must end in .png, .svg or .pdf, not '.jpg'"):
        write_gantt(timeline, tmp_path / "step.jpg")


def test_terminal_width_must_be_usable(timeline):
    with pytest.raises(UserInputError, match="at least 10"):
        terminal_gantt(timeline, width=3)


def test_two_digit_micro_batches_are_one_base_36_character():
    """1F1B, p = 2, m = 12 in 80 cells: each bar is two cells, so 'F10' would not fit (it was 'FF')."""
    timeline = simulate(generate(ScheduleKind.ONE_F_ONE_B, 2, 12), uniform_costs(2, 1, 1.0, 2.0))
    lines = terminal_gantt(timeline, width=80).plain.splitlines()
    for rank in (0, 1):
        row = lines[rank][len("rank 0 "):]
        assert "FF" not in row and "BB" not in row
        for letter in "FB":
            assert [int(n, 36) for n in re.findall(letter + "([0-9a-z])", row)] == list(range(12))
    assert lines[-2].endswith("F3: micro-batch 3, a-z: 10-35")


def test_the_legend_names_only_what_the_chart_shows():
    interleaved = simulate(generate(ScheduleKind.INTERLEAVED, 2, 4, 2, recompute=True), uniform_costs(2, 2, 1.0, 2.0))
    legend = terminal_gantt(interleaved, width=200).plain.splitlines()[-2]
    assert legend == "F forward, B backward, R recompute, f b r: later chunks, · idle; F3: micro-batch 3"
    many = simulate(generate(ScheduleKind.GPIPE, 2, 40), uniform_costs(2, 1, 1.0, 2.0))
    legend = terminal_gantt(many, width=60).plain.splitlines()[-2]
    assert "(base 36: a-z 10-35, 10 = 36)" in legend and "a letter alone: too narrow for its number" in legend


@pytest.mark.parametrize("number", [0, 9, 10, 35, 36, 100, 1295, 1296])
def test_micro_batch_ids_read_back(number):
    assert int(micro_batch_id(number), 36) == number


def test_docstring_examples():
    import doctest

    import pipectl.report.gantt

    assert doctest.testmod(pipectl.report.gantt).failed == 0

from pipectl.schedule import generate
from pipectl.schedule.grid import format_grid
from pipectl.schedule.ir import ScheduleKind


def test_grid_has_one_column_per_rank_and_one_row_per_step():
    schedule = generate(ScheduleKind.ONE_F_ONE_B, 3, 2)
    lines = format_grid(schedule).splitlines()
    assert lines[0].split() == ["step", "rank", "0", "rank", "1", "rank", "2"]
    assert len(lines) == 1 + max(len(a) for a in schedule.actions.values())
    assert lines[1].split() == ["0", "0F0", "1F0", "2F0"]


def test_marks_flag_the_cell_and_the_row():
    schedule = generate(ScheduleKind.GPIPE, 2, 3)
    text = format_grid(schedule, {1: 4})
    row = next(line for line in text.splitlines() if "<-- here" in line)
    assert row.split()[:3] == ["4", "0B1", "*1B1*"]


def test_long_grids_are_cut_to_the_marked_rows():
    schedule = generate(ScheduleKind.GPIPE, 2, 60)
    text = format_grid(schedule, {0: 70})
    lines = text.splitlines()
    assert "*0B10*" in text
    assert lines[1].strip() == "..." and lines[-1].strip() == "..."
    assert len(lines) == 1 + 2 + 9

"""Schedules are diffable files: these small ones must keep their exact order (the runtime and
recorded runs depend on it). After an intended change, regenerate the file and review the diff."""

from pathlib import Path

import pytest

from pipectl.schedule import generate
from pipectl.schedule.comm import add_communication
from pipectl.schedule.ir import Schedule, ScheduleKind

GOLDEN = Path(__file__).parent / "golden"
CASES = {
    "gpipe_p3_m4_recompute": lambda: generate(ScheduleKind.GPIPE, 3, 4, recompute=True),
    "1f1b_p4_m6": lambda: generate(ScheduleKind.ONE_F_ONE_B, 4, 6),
    "interleaved_p2_m4_v2": lambda: generate(ScheduleKind.INTERLEAVED, 2, 4, 2),
    "varuna_p4_m6": lambda: generate(ScheduleKind.VARUNA, 4, 6),
    "1f1b_p4_m6_comm": lambda: add_communication(generate(ScheduleKind.ONE_F_ONE_B, 4, 6)),
    "varuna_p3_m4_comm": lambda: add_communication(generate(ScheduleKind.VARUNA, 3, 4)),
    "zb-h1_p4_m6": lambda: generate(ScheduleKind.ZB_H1, 4, 6),
    "zb-h1_p4_m6_comm": lambda: add_communication(generate(ScheduleKind.ZB_H1, 4, 6)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_schedule_matches_its_golden_file(name):
    text = (GOLDEN / f"{name}.txt").read_text()
    assert CASES[name]().to_text() == text
    assert Schedule.from_text(text) == CASES[name]()

"""The plan's checkpoint line: per-rank bytes of the chosen layout and the automatic interval."""

from __future__ import annotations

from builders import gpt_tiny_candidate, model_shape, plan_of

from pipectl.report.plan_table import CHECKPOINT_BYTES_PER_PARAMETER, checkpoint_line
from pipectl.report.tables import format_bytes
from pipectl.runtime.checkpoint.schedule import DEVICE_MTBF_HOURS, young_daly_seconds


def test_the_checkpoint_line_gives_the_largest_ranks_share_and_the_auto_interval():
    shape = model_shape("gpt-tiny")
    one = checkpoint_line(plan_of(gpt_tiny_candidate(p=1)))
    whole = CHECKPOINT_BYTES_PER_PARAMETER * shape.parameter_count  # one stage holds the tied weight once
    assert one.startswith(f"checkpoint: about {format_bytes(whole)} per rank")
    minutes = young_daly_seconds(1.0, DEVICE_MTBF_HOURS * 3600) / 60
    assert f"{DEVICE_MTBF_HOURS:,.0f} h between failures of 1 device: every {minutes:,.0f} min" in one
    split = checkpoint_line(plan_of(gpt_tiny_candidate(p=2, d=2)))
    largest = max(sum(shape.layer_parameter_counts[a:b]) for a, b in ((0, 4), (4, 9)))
    assert split.startswith(f"checkpoint: about {format_bytes(CHECKPOINT_BYTES_PER_PARAMETER * largest / 2)} per rank")
    assert f"{DEVICE_MTBF_HOURS / 4:,.0f} h between failures of 4 devices" in split


def test_the_morph_summary_says_when_its_fastest_entry_uses_fewer_devices():
    from rich.console import Console

    from pipectl.artifacts.plan import MorphEntry
    from pipectl.report.plan_table import morph_summary_view

    two = gpt_tiny_candidate(p=2)
    plan = plan_of(two, morph_table=[MorphEntry(devices=2, candidate=two), MorphEntry(devices=3, candidate=two)])
    console = Console(width=100, record=True)
    console.print(morph_summary_view(plan))
    row = next(line for line in console.export_text().splitlines() if line.strip().startswith("2–3"))
    assert "2 (uses 2)" not in row and row.split()[:3] == ["2–3", "2", "2"]
    three = plan_of(two, morph_table=[MorphEntry(devices=3, candidate=two)])
    console = Console(width=100, record=True)
    console.print(morph_summary_view(three))
    assert "3 (uses 2)" in console.export_text()

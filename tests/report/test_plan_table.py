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

"""Rendered tables: what a user reads on the terminal."""

from __future__ import annotations

from rich.console import Console

from pipectl.catalog import get_device
from pipectl.models.registry import load_model_config
from pipectl.profile.derive import derive_profile
from pipectl.report.tables import profile_view


def _text(renderable, width: int = 160) -> str:
    console = Console(width=width, record=True)
    console.print(renderable)
    return console.export_text()


def test_the_profile_table_shows_each_blocks_tensor_parallel_shards():
    profile = derive_profile(load_model_config("gpt-small"), get_device("a100-80gb"), [1], "bfloat16")
    text = _text(profile_view(profile))
    assert profile.shard_degrees() == [2, 4]
    # The 12 identical blocks are one row group; their shards one table, a column per degree.
    assert text.count("block.0–11 ×12") == 2 and "block.1 " not in text
    header = next(line for line in text.splitlines() if "t=1 " in line)  # degrees over their shard's bytes
    assert "t=2 " in header and "t=4" in header and "t=8" not in header
    assert text.count("block.") == 2 and "block.0 " in _text(profile_view(profile, every_layer=True))


def test_a_profile_without_shards_shows_none():
    profile = derive_profile(load_model_config("gpt-small"), get_device("a100-80gb"), [1], "bfloat16", tensor_parallel=())
    assert "shard" not in _text(profile_view(profile))


def test_an_80_column_terminal_cuts_no_figure_of_the_profile():
    """A narrow terminal wraps a run's name, never a figure ("3.98 G…") nor a header."""
    profile = derive_profile(load_model_config("gpt3-175b"), get_device("a100-80gb"), [1, 2, 4, 8], "bfloat16")
    text = _text(profile_view(profile), width=80)
    assert "…" not in text and "peak mem" in text and "3.98 GiB" in text
    assert all(len(line) <= 80 for line in text.splitlines())

"""Rendered tables: what a user reads on the terminal."""

from __future__ import annotations

from rich.console import Console

from pipectl.catalog import get_device
from pipectl.models.registry import load_model_config
from pipectl.profile.derive import derive_profile
from pipectl.report.tables import profile_view


def _text(renderable) -> str:
    console = Console(width=160, record=True)
    console.print(renderable)
    return console.export_text()


def test_the_profile_table_shows_each_blocks_tensor_parallel_shards():
    profile = derive_profile(load_model_config("gpt-small"), get_device("a100-80gb"), [1], "bfloat16")
    text = _text(profile_view(profile))
    assert profile.shard_degrees() == [2, 4]
    assert text.count("t=2 shard") == 12 and text.count("t=4 shard") == 12  # one per block
    assert "t=8 shard" not in text


def test_a_profile_without_shards_shows_none():
    profile = derive_profile(load_model_config("gpt-small"), get_device("a100-80gb"), [1], "bfloat16", tensor_parallel=())
    assert "shard" not in _text(profile_view(profile))

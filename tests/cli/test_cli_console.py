"""Output that is not a terminal (a pipe, a log file) keeps every table cell whole."""

from __future__ import annotations

import io

from rich.table import Table
from typer.testing import CliRunner

from pipectl.cli.context import PipectlConsole
from pipectl.cli.main import app
from pipectl.io import write_json_atomic
from pipectl.testing.profiles import synthetic_profile

runner = CliRunner()


def _wide_table() -> Table:
    table = Table()
    for header in ("step", "samples per second", "note"):
        table.add_column(header, no_wrap=True)
    table.add_row("13.5912345 s", f"{123456789.125:,}", "x" * 120)
    return table


def test_a_piped_console_renders_a_wide_table_whole():
    out = io.StringIO()
    PipectlConsole(file=out, _environ={}).print(_wide_table())
    text = out.getvalue()
    assert "…" not in text
    assert "13.5912345 s" in text and "123,456,789.125" in text and "x" * 120 in text


def test_columns_set_by_the_user_is_still_obeyed():
    out = io.StringIO()
    PipectlConsole(file=out, _environ={"COLUMNS": "60"}).print(_wide_table())
    assert max(len(line) for line in out.getvalue().splitlines()) <= 60


def test_plan_piped_to_a_file_cuts_no_figure(tmp_path, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    profile = tmp_path / "profile.json"
    write_json_atomic(profile, synthetic_profile(blocks=6, micro_batch_sizes=[1, 2, 4], device="cpu"))
    result = runner.invoke(app, ["plan", "--profile", str(profile), "--cluster", "a100-8x8", "--global-batch", "32",
                                 "--objective", "cost", "-o", str(tmp_path / "plan.json")])
    assert result.exit_code == 0, result.output
    assert "…" not in result.output
    header = next(line for line in result.output.splitlines() if "samp/s" in line)
    for column in ("step", "TFLOP/s", "mem/dev", "bubble", "comm", "$/1M"):
        assert column in header

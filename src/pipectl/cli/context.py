"""What every command shares: the consoles and the common option types."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import BaseModel
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

console = Console()
err_console = Console(stderr=True)

JsonFlag = Annotated[bool, typer.Option("--json", help="Print the result as JSON instead of a table.")]
OutputPath = Annotated[Path, typer.Option("--output", "-o", help="Where to write the artifact.")]


def print_json(payload: BaseModel | dict[str, Any] | list[Any]) -> None:
    """Plain JSON on stdout (no Rich markup), for scripts."""
    if isinstance(payload, BaseModel):
        text = payload.model_dump_json(indent=2)
    else:
        text = json.dumps(payload, indent=2)
    typer.echo(text)


def training_progress(*, quiet: bool = False) -> Progress:
    """The progress bar of a training run: steps done of total, plus a free `stats` field.

    Redrawn twice a second (the launch polls its metrics as often): the ranks train on this
    machine's cores, so the bar takes as little of them as it can.
    """
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[stats]}"),
        TimeElapsedColumn(),
        console=console,
        disable=quiet,
        refresh_per_second=2,
    )

"""`pipectl profile` (being built; see docs/ARCHITECTURE.md)."""

from __future__ import annotations

import typer

from pipectl.cli.groups import DefaultCommandGroup

app = typer.Typer(cls=DefaultCommandGroup, no_args_is_help=True, help="Measure or derive a model profile.")

"""`pipectl resize` (being built; see docs/ARCHITECTURE.md)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add this module's command(s) to the root app."""

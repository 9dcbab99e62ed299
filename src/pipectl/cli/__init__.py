"""Thin Typer commands: they parse options, call domain code, and render results."""

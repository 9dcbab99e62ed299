"""`pipectl export RUN -o DIR`: a run's checkpoint as a Hugging Face directory (`runtime/hf_export.py`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipectl.cli.context import JsonFlag, console, print_json


def register(app: typer.Typer) -> None:
    """Add `pipectl export` to the root app."""

    @app.command("export")
    def export_command(
        run_dir: Annotated[Path, typer.Argument(help="The run directory (runs/NAME) of an hf:PATH model.")],
        output: Annotated[Path, typer.Option("--output", "-o", help="The Hugging Face directory to write (must not exist).")],
        step: Annotated[
            int | None, typer.Option("--step", min=0, help="The checkpoint of this step (default: the newest verified).")
        ] = None,
        json_output: JsonFlag = False,
    ) -> None:
        """Write a run's checkpoint as a Hugging Face directory that transformers loads (config,
        tokenizer files, model.safetensors in float32)."""
        from pipectl.runtime.hf_export import export_hf  # torch: only when exporting

        path, exported = export_hf(run_dir, output, step)
        if json_output:
            print_json({"output": str(path), "step": exported, "run_dir": str(run_dir)})
        else:
            console.print(f"wrote {path}: the checkpoint of step {exported}, for transformers' from_pretrained", markup=False)

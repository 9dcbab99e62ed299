"""What every command shares: the consoles and the common option types."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from pydantic import BaseModel, ValidationError
from rich.console import Console, ConsoleDimensions
from rich.segment import Segment
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from pipectl.artifacts.run import is_run_file, run_holding
from pipectl.errors import PipectlError, UserInputError
from pipectl.io import ARTIFACT_KINDS, artifact_kind, check_output_file, read_mapping
from pipectl.paths import HF_PREFIX

# Wide enough that no table of ours is ever narrowed; text is not padded to it.
PIPED_WIDTH = 1000
_TRAILING_BLANKS = re.compile(r"[ \t]+$", re.MULTILINE)


class PipectlConsole(Console):
    """A Rich console that keeps tables whole when its output is not a terminal.

    Piped into a file or a log, Rich would take the width of whatever terminal it can find (80
    columns without one) and cut table cells to fit ("13.59…"). There, unless COLUMNS is set,
    the console is `PIPED_WIDTH` wide: tables keep their natural width and no figure is cut.
    Nor does a line end in the blanks that pad a table's cells to its width (`grep`, `diff` and
    editors see them; a terminal does not).
    """

    def _render_buffer(self, buffer: Iterable[Segment]) -> str:
        text = super()._render_buffer(buffer)
        return text if self.is_terminal else _TRAILING_BLANKS.sub("", text)

    @property
    def size(self) -> ConsoleDimensions:
        dimensions = super().size
        if self._width is None and not self.is_terminal and "COLUMNS" not in self._environ:
            return ConsoleDimensions(PIPED_WIDTH, dimensions.height)
        return dimensions

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        self._width, self._height = new_size


console = PipectlConsole()
err_console = PipectlConsole(stderr=True)


def output_file(path: Path | None) -> Path | None:
    """Option callback: a file the command will write is absent or a regular file, checked before
    any work (`pipectl.io.check_output_file`: no directory, link, FIFO or device)."""
    return None if path is None else check_output_file(path)


def into_folder(name: str | None) -> Callable[[str], Path]:
    """Option parser for `-o`: a path ending in a slash names a folder, and the file is `name` in it
    (`-o plans/` writes plans/plan.json; the slash was dropped, and a file `plans` written). Without
    a `name` (a command whose file's name depends on its input), a folder is refused."""

    def parse(value: str | Path) -> Path:  # a default is a Path already
        if not isinstance(value, str) or not value.endswith(("/", os.sep)) or value.strip("/" + os.sep) == "":
            return Path(value)
        if name is None:
            raise typer.BadParameter("names a folder; give the path of the file to write")
        return Path(value) / name

    return parse


def refuse_overwriting(
    output: Path, inputs: Mapping[str, str | os.PathLike[str] | None], writes: str | None = None
) -> None:
    """`-o` names neither a file this command reads (`inputs`, by what each is) nor a run
    directory's own file (`artifacts.run.is_run_file`): writing it would replace what this
    command, or a run, reads. Nor, where the command says what it `writes` (an `ARTIFACT_KINDS`
    key), a pipectl file (.json, .yaml) of another kind (`profile links -o profile.json` replaced a measured
    profile): a file of the same kind is replaced, as a command run again would. Checked before
    any work."""
    for what, source in inputs.items():
        if source is not None and same_file(output, Path(source)):
            raise UserInputError(f"-o {output} is the {what} this command reads; write the result elsewhere")
    if is_run_file(output):
        raise UserInputError(f"-o {output} is a file of the run in {run_holding(output)}; write the result elsewhere")
    if writes is not None and output.is_file() and output.suffix.lower() in (".json", ".yaml", ".yml"):
        try:
            found = artifact_kind(read_mapping(output))
        except PipectlError:  # not a file of ours (or not readable as one): replaced as before
            found = None
        if found is not None and found != writes:
            raise UserInputError(f"-o {output} is {ARTIFACT_KINDS[found][0]}, and this writes {ARTIFACT_KINDS[writes][0]}",
                                 hint="give another path, or remove that file first")


def refuse_overwriting_model(output: Path, reference: str | None, what: str) -> None:
    """`-o` is neither the model config `reference` names nor a file of its Hugging Face folder
    (`hf:PATH`): launch builds the model from them. `what` says whose model it is."""
    if not reference:
        return
    source = Path(reference.removeprefix(HF_PREFIX))
    inside = reference.startswith(HF_PREFIX) and source.is_dir() and output.absolute().is_relative_to(source.absolute())
    if inside or same_file(output, source):
        raise UserInputError(f"-o {output} is {'in ' if inside else ''}the model {what}; write the result elsewhere")


def same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:  # a name the system refuses is no file this command reads
        return False


JsonFlag = Annotated[bool, typer.Option("--json", help="Print the result as JSON instead of a table.")]
OutputPath = Annotated[
    Path, typer.Option("--output", "-o", help="Where to write the artifact.", callback=output_file)
]


ModelT = TypeVar("ModelT", bound=BaseModel)


def from_options(model_type: type[ModelT], **options: Any) -> ModelT:
    """Build a request model from command-line options; a value it refuses is named as its option
    (`--global-batch 4294967296: Input should be less than or equal to 2147483648`)."""
    try:
        return model_type(**options)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            name = str(err["loc"][0]) if err["loc"] else ""
            option = f"--{name.replace('_', '-')} {_as_typed(options.get(name))}" if name in options else "options"
            problems.append(f"{option}: {err['msg'].removeprefix('Value error, ')}")
        raise UserInputError("; ".join(problems)) from None


def _as_typed(value: Any) -> str:
    """An option's value as a user types it: a list as its comma list (`--zero-stages 1,4`)."""
    if isinstance(value, (list, tuple)):
        return ",".join(str(getattr(v, "value", v)) for v in value)
    return repr(getattr(value, "value", value))


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

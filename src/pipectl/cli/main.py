"""The `pipectl` entry point: wires the commands and turns typed errors into messages.

Every `PipectlError`, an option that does not parse and an `OSError` about a named file become one
red line (plus a hint) and an exit code (2 for bad input; `cli.groups.ErrorReportingGroup`); set
PIPECTL_DEBUG=1 to see the traceback. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import typer

from pipectl import __version__
from pipectl.cli import calibrate, export, export_plan, launch, plan, profile, resize, simulate, status, validate
from pipectl.cli.groups import HELP_OPTIONS, ErrorReportingGroup

app = typer.Typer(
    name="pipectl",
    cls=ErrorReportingGroup,
    help="Profile, plan, launch and resize pipeline-parallel training jobs. The global batch never changes.",
    no_args_is_help=True,
    context_settings={"help_option_names": list(HELP_OPTIONS)},
    pretty_exceptions_enable=False,
)
app.add_typer(profile.app, name="profile")
plan.register(app)
simulate.register(app)
launch.register(app)
status.register(app)
resize.register(app)
export.register(app)
export_plan.register(app)
calibrate.register(app)
validate.register(app)


@app.callback(invoke_without_command=True)
def _main(
    ctx: typer.Context,
    version: bool = typer.Option(False, "--version", help="Print the version and exit."),
) -> None:
    if version:
        typer.echo(f"pipectl {__version__}")
        raise typer.Exit()
    if ctx.invoked_subcommand is None:
        typer.echo(ctx.get_help())
        raise typer.Exit()


def run() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    run()

"""The `pipectl` entry point: wires the commands and turns typed errors into messages.

Every `PipectlError`, an option that does not parse and an `OSError` about a named file become one
red line (plus a hint) and an exit code (2 for bad input; `cli.groups.ErrorReportingGroup`); set
PIPECTL_DEBUG=1 to see the traceback. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import gc
import importlib
import os
import sys
from collections.abc import Sequence

import typer
import typer.main

from pipectl import __version__
from pipectl.cli.groups import HELP_OPTIONS, ErrorReportingGroup

# Each command's module, in the order `pipectl --help` lists them (`groups.WORKFLOW`). A command
# line that names one imports that one only: importing them all (each with the artifacts, engines
# and tables of its own) costs a noticeable share of a short command's time.
COMMANDS = {
    "profile": "pipectl.cli.profile",
    "plan": "pipectl.cli.plan",
    "simulate": "pipectl.cli.simulate",
    "launch": "pipectl.cli.launch",
    "status": "pipectl.cli.status",
    "resize": "pipectl.cli.resize",
    "export": "pipectl.cli.export",
    "export-plan": "pipectl.cli.export_plan",
    "calibrate": "pipectl.cli.calibrate",
    "validate": "pipectl.cli.validate",
}

# Set by the completion scripts (`--install-completion`): completion needs every command.
COMPLETION_ENV = "_PIPECTL_COMPLETE"


def build_app(names: Sequence[str] | None = None) -> typer.Typer:
    """The `pipectl` app with the commands `names` (every command when None)."""
    app = typer.Typer(
        name="pipectl",
        cls=ErrorReportingGroup,
        help="Profile, plan, launch and resize pipeline-parallel training jobs. The global batch never changes.",
        no_args_is_help=True,
        context_settings={"help_option_names": list(HELP_OPTIONS)},
        pretty_exceptions_enable=False,
    )
    for name in COMMANDS if names is None else names:
        module = importlib.import_module(COMMANDS[name])
        if name == "profile":  # a group of its own (`profile model`, `profile links`)
            app.add_typer(module.app, name="profile")
        else:
            module.register(app)
    app.callback(invoke_without_command=True)(_main)
    return app


def option_owners(option: str) -> list[str]:
    """The commands that take `option` (`--steps`: launch, resize), in `pipectl --help`'s order."""
    owners: list[str] = []

    def walk(command, path: list[str]) -> None:
        if path and any(option in param.opts or option in param.secondary_opts for param in command.params):
            owners.append(" ".join(path))
        for name in getattr(command, "commands", {}):
            walk(command.commands[name], [*path, name])

    walk(typer.main.get_command(build_app()), [])
    return owners


ErrorReportingGroup.option_owners = staticmethod(option_owners)


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


def command_named(args: Sequence[str]) -> str | None:
    """The command a command line runs when it names one first (`pipectl plan ...`), else None:
    the help, `--version`, a misspelt command (click suggests the near ones) and shell completion
    need every command."""
    if not args or os.environ.get(COMPLETION_ENV):
        return None
    return args[0] if args[0] in COMMANDS else None


def __getattr__(name: str) -> typer.Typer:
    """`pipectl.cli.main.app`: the app with every command (tests, documentation tools)."""
    if name == "app":
        app = globals()["app"] = build_app()
        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def run() -> None:
    """Console-script entry point."""
    name = command_named(sys.argv[1:])
    try:
        build_app(None if name is None else [name])()
    finally:
        # What is still alive is freed with the process. The interpreter's last collection at exit
        # would trace all of it first, in time proportional to the heap: after a large plan (~10^6
        # objects kept) a sizeable share of the command's time, for nothing. Frozen, it is skipped.
        gc.freeze()


if __name__ == "__main__":
    run()

"""A command group with a default sub-command: `pipectl profile gpt-tiny` runs `profile model gpt-tiny`."""

from __future__ import annotations

import os

from rich.markup import escape
from typer.core import TyperGroup

from pipectl.cli.context import err_console
from pipectl.errors import PipectlError

class ErrorReportingGroup(TyperGroup):
    """The root group: a `PipectlError` from any command becomes a message and its exit code.

    Set PIPECTL_DEBUG=1 to get the traceback too (the exit code stays the error's). Other exceptions
    are bugs and propagate.
    """

    def invoke(self, ctx):  # type: ignore[override]
        try:
            return super().invoke(ctx)
        except PipectlError as exc:
            if os.environ.get("PIPECTL_DEBUG", "") not in ("", "0"):
                err_console.print_exception()
            # Messages quote files and exceptions ("[enforce fail at alloc_cpu.cpp:127]"): not markup.
            err_console.print(f"[bold red]error:[/] {escape(exc.message)}", highlight=False, soft_wrap=True)
            if exc.hint:
                err_console.print(f"[dim]hint:[/] {escape(exc.hint)}", highlight=False, soft_wrap=True)
            ctx.exit(exc.exit_code)

class DefaultCommandGroup(TyperGroup):
    """Arguments that name no sub-command go to the sub-command `default_command`."""

    default_command = "model"

    def resolve_command(self, ctx, args: list[str]):
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            args = [self.default_command, *args]
        return super().resolve_command(ctx, args)

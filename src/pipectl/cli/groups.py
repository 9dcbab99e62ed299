"""A command group with a default sub-command: `pipectl profile gpt-tiny` runs `profile model gpt-tiny`."""

from __future__ import annotations

import errno
import os

from rich.markup import escape
from typer.core import TyperGroup

from pipectl.cli.context import err_console
from pipectl.errors import PipectlError

# A file the system refuses for what its path names (missing, too long, a part of it a file,
# permissions): the user's to fix, exit 2. Other refusals (a full disk, an I/O error) exit 1.
PATH_ERRNOS = frozenset(
    {errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG, errno.EACCES, errno.EPERM, errno.EROFS, errno.ELOOP}
)


class ErrorReportingGroup(TyperGroup):
    """The root group: a `PipectlError` from any command becomes a message and its exit code.

    So does an `OSError` about a named file that no check before it caught (a path the system
    refuses): "error: PATH: No such file or directory", exit 2 when the path is the user's to
    fix, else 1. Set PIPECTL_DEBUG=1 to get the traceback too (the exit code stays the error's).
    Other exceptions are bugs and propagate.
    """

    def invoke(self, ctx):  # type: ignore[override]
        try:
            return super().invoke(ctx)
        except PipectlError as exc:
            self._report(exc.message, exc.hint)
            ctx.exit(exc.exit_code)
        except OSError as exc:
            if exc.filename is None:
                raise
            self._report(f"{exc.filename}: {exc.strerror}", None)
            ctx.exit(2 if exc.errno in PATH_ERRNOS else 1)

    @staticmethod
    def _report(message: str, hint: str | None) -> None:
        if os.environ.get("PIPECTL_DEBUG", "") not in ("", "0"):
            err_console.print_exception()
        # Messages quote files and exceptions ("[enforce fail at alloc_cpu.cpp:127]"): not markup.
        err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
        if hint:
            err_console.print(f"[dim]hint:[/] {escape(hint)}", highlight=False, soft_wrap=True)

class DefaultCommandGroup(TyperGroup):
    """Arguments that name no sub-command go to the sub-command `default_command`."""

    default_command = "model"

    def resolve_command(self, ctx, args: list[str]):
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            args = [self.default_command, *args]
        return super().resolve_command(ctx, args)

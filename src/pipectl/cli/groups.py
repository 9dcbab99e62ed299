"""The command groups: the root one, which turns every error a user can cause into one line and an
exit code (`ErrorReportingGroup`), and one with a default sub-command, so that `pipectl profile
gpt-tiny` runs `profile model gpt-tiny` (`DefaultCommandGroup`)."""

from __future__ import annotations

import errno
import inspect
import os
import shutil
import sys
import typing
from collections.abc import Callable
from pathlib import PurePath
from types import MethodType

import typer
from rich.markup import escape
from typer.core import TyperGroup

from pipectl.cli.context import err_console
from pipectl.errors import PipectlError

# click's UsageError, as typer raises it (typer >= 0.20 vendors click: typer._click): the base of
# the one exception class typer exports from it.
USAGE_ERROR = next(cls for cls in typer.BadParameter.__mro__ if cls.__name__ == "UsageError")

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

    # The commands (`launch`, `profile model`) that take an option: set by `cli.main`, which knows
    # every command while a command line loads its own only.
    option_owners: Callable[[str], list[str]] | None = None

    def main(self, args=None, *rest, **options):  # type: ignore[override]
        # The command line as given: a refused option's value is quoted from it (`_usage_message`).
        self.given_args = list(sys.argv[1:] if args is None else args)
        readable_metavars(self)
        tidy_help(self, plain=shutil.get_terminal_size().columns < RICH_HELP_COLUMNS)
        return super().main(args, *rest, **options)

    def list_commands(self, ctx) -> list[str]:  # type: ignore[override]
        """The commands in the order a job meets them (`WORKFLOW`), then any others."""
        names = super().list_commands(ctx)
        return sorted(names, key=lambda name: WORKFLOW.index(name) if name in WORKFLOW else len(WORKFLOW))

    def invoke(self, ctx):  # type: ignore[override]
        empty = empty_value(getattr(self, "given_args", []))
        if empty is not None:  # click takes '' as a value (a Path '' is '.', the current folder)
            self._report(f"{empty}: empty; give a value, or leave it out", None)
            ctx.exit(2)
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
        except USAGE_ERROR as exc:
            if type(exc).__name__ == "NoArgsIsHelpError":  # `pipectl profile` alone: its help, as `pipectl` alone
                err_console.print(escape(exc.format_message()), highlight=False, soft_wrap=True)
                ctx.exit(exc.exit_code)
            # A sub-command's options that do not parse: one line with the value, as our own checks.
            command = exc.ctx.command_path if exc.ctx is not None else ctx.command_path
            message = _usage_message(exc, getattr(self, "given_args", []))
            if type(exc).__name__ == "NoSuchOption" and self.option_owners is not None:
                # Another command's option (`plan --steps`): where it belongs, not click's near spellings.
                here = command.removeprefix(f"{ctx.command_path} ")
                try:
                    owners = [f"pipectl {name}" for name in self.option_owners(exc.option_name) if name != here]
                except Exception:  # a command that cannot load must not turn a usage error into a traceback
                    owners = []
                if owners:
                    message = f"{command} takes no {exc.option_name}: it is an option of {' and '.join(owners)}"
            self._report(message, f"{command} --help")
            ctx.exit(exc.exit_code)

    @staticmethod
    def _report(message: str, hint: str | None) -> None:
        if os.environ.get("PIPECTL_DEBUG", "") not in ("", "0"):
            err_console.print_exception()
        # Messages quote files and exceptions ("[enforce fail at alloc_cpu.cpp:127]"): not markup.
        err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
        if hint:
            err_console.print(f"[dim]hint:[/] {escape(hint)}", highlight=False, soft_wrap=True)


HELP_OPTIONS = ("-h", "--help")

# `pipectl --help` lists the commands in the order a job meets them.
WORKFLOW = ("profile", "plan", "simulate", "launch", "status", "resize", "export", "calibrate")

# What an option's value is, by its Python type: the help shows `--steps INT`, not `<int range>`.
_METAVAR_OF_TYPE = {int: "INT", float: "NUM", str: "TEXT", bool: "BOOL"}


def readable_metavars(command) -> None:
    """Give every option of `command` and its sub-commands that names no metavar of its own a
    plain one: none for a flag (`--resume`, not `--resume <bool>`), its choices for a choice
    (`local|torchrun|deepspeed|slurm`), else the kind of value (`INT`, `NUM`, `TEXT`, `PATH`)."""
    for param in command.params:
        if param.param_type_name == "argument":
            # An argument is named by its metavar (PLAN.json, RUN_DIR), which says what it is: no
            # type column beside it (`<path>`).
            param.metavar = param.metavar or param.name.upper()
            param.display_type_rich = lambda ctx: None
            # The usage line names it as the help does (`pipectl resize RUN_DIR`, not `{RUN_DIR}`).
            param._usage_display_name = lambda metavar=param.metavar: metavar
        elif param.metavar is None:
            param.metavar = _metavar(param)
    # -h/--help is made on first use, once per command (click keeps it): made here, as a flag.
    helper = command.get_help_option(typer.Context(command, help_option_names=list(HELP_OPTIONS)))
    if helper is not None:
        helper.metavar = ""
    for sub in getattr(command, "commands", {}).values():
        readable_metavars(sub)


# Below this width the help is click's plain text: Rich's option tables cut long option names
# short (`--max-tensor-par…`) to make room for the help column.
RICH_HELP_COLUMNS = 100


def _options_by_section(command, ctx, formatter) -> None:
    """Click's plain option list, under the same headings as Rich's panels: the options of each
    config section apart (`[training] options`), as the file holds them."""
    sections: dict[str, list[tuple[str, str]]] = {"Arguments": [], "Options": []}
    for param in command.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is not None:
            panel = "Arguments" if param.param_type_name == "argument" else getattr(param, "rich_help_panel", None)
            sections.setdefault((panel or "Options").replace("\\[", "["), []).append(record)
    for name, records in sections.items():  # arguments, the command's own options, then file order
        if records:
            with formatter.section(name):
                formatter.write_dl(records)


def tidy_help(command, *, plain: bool = False) -> None:
    """Help texts as sentences, not as the docstring's lines: each paragraph of `command`'s and its
    sub-commands' help on one line (the terminal wraps it; a paragraph with indented or listed lines
    keeps them), and the command list's entry its first sentence (`pipectl -h`). `plain`: click's
    plain layout (every name whole, the help wrapped beside it) instead of Rich's panels."""
    if plain:
        command.rich_markup_mode = None
        for param in command.params:  # Rich's escapes (`\[model]`) are plain text's brackets
            if getattr(param, "help", None):
                param.help = param.help.replace("\\[", "[")
        if not hasattr(command, "commands"):  # a group's own options are few; it lists its commands after them
            command.format_options = MethodType(_options_by_section, command)
    if command.help:
        paragraphs = inspect.cleandoc(command.help).split("\n\n")
        command.help = "\n\n".join(
            paragraph if any(line[:1] in (" ", "-", "*", "\b") for line in paragraph.splitlines()[1:])
            else " ".join(paragraph.split())
            for paragraph in paragraphs
        )
        if command.short_help is None:
            first = command.help.split("\n\n")[0]
            end = first.find(". ")
            command.short_help = first if end < 0 else first[: end + 1]
    for sub in getattr(command, "commands", {}).values():
        tidy_help(sub, plain=plain)


def _metavar(param) -> str:
    if getattr(param, "is_flag", False):
        return ""
    described = param.type_descriptor  # typer's account of the annotation (a list's element for a repeated option)
    if described.is_choice:
        return "|".join(str(getattr(choice, "value", choice)) for choice in described.choices)
    if described.is_path:
        return "PATH"
    annotation = typing.get_args(described.annotation)[0] if described.is_list else described.annotation
    if isinstance(annotation, type) and issubclass(annotation, PurePath):
        return "PATH"
    return _METAVAR_OF_TYPE.get(annotation, "VALUE")


def _usage_message(exc: Exception, args: list[str]) -> str:
    """click's message, with the value given where it names an option it refused (`--global-batch
    '2.5': Input should be a valid integer`; click's own message does not quote it)."""
    message = exc.format_message()  # type: ignore[attr-defined]
    param = getattr(exc, "param", None)
    kinds = {cls.__name__ for cls in type(exc).__mro__}
    if "BadParameter" not in kinds or "MissingParameter" in kinds or param is None:
        return message
    for opt in getattr(param, "opts", ()):
        value = _given_value(opt, args)
        if value is None:
            continue
        if value.strip().lower().lstrip("+-") == "nan":  # every range check fails on it: say why
            return f"{opt} {value!r}: not a number"
        return f"{opt} {value!r}: {exc.message.removeprefix('Value error, ')}"  # type: ignore[attr-defined]
    return message


def empty_value(args: list[str]) -> str | None:
    """The first empty value on a command line, as given (an unset shell variable: `--model "$M"`),
    or None. No option or argument of pipectl's means anything by ''.

        >>> empty_value(["launch", "plan.json", "--model", "", "--dry-run"]), empty_value(["plan", "--tokens="])
        ("--model ''", "--tokens ''")
        >>> empty_value(["profile", "show", ""]), empty_value(["plan", "-o", "p.json"])
        ("an argument ''", None)
    """
    for index, arg in enumerate(args):
        if arg == "--":
            continue
        if arg.startswith("--") and arg.endswith("=") and len(arg) > 3:
            return f"{arg[:-1]} ''"
        if arg == "":
            before = args[index - 1] if index else ""
            return f"{before} ''" if before.startswith("-") and before != "--" and "=" not in before else "an argument ''"
    return None


def _given_value(opt: str, args: list[str]) -> str | None:
    """What the command line gave option `opt` (`--opt VALUE` or `--opt=VALUE`), if anything."""
    for i, arg in enumerate(args):
        if arg == opt and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(opt + "="):
            return arg[len(opt) + 1:]
    return None


class DefaultCommandGroup(TyperGroup):
    """Arguments that name no sub-command go to the sub-command `default_command`, options first
    too (`pipectl profile -o p.json MODEL`, as every other command takes them): the group has no
    option of its own but --help."""

    default_command = "model"

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        if args and args[0].startswith("-") and args[0] not in self.get_help_option_names(ctx):
            args = [self.default_command, *args]
        return super().parse_args(ctx, args)

    def resolve_command(self, ctx, args: list[str]):
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            args = [self.default_command, *args]
        return super().resolve_command(ctx, args)

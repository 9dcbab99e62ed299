"""Every `--flag` a hint tells the user to pass is an option of some pipectl command.

Hints are read from the source (ast): the value of every `hint=` keyword and of every assignment
to a name containing 'hint', with the literal parts of f-strings. A renamed option
(`--for-deepspeed` became `--any-engine`) left a hint naming a flag no command has.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import typer

from pipectl.cli.main import app

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "pipectl"
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9]")
COMMAND = re.compile(r"\bpipectl ([a-z]+)")


def hint_texts() -> list[tuple[str, str]]:
    """(where, literal text) of every hint in the package's source."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            values: list[ast.AST] = []
            if isinstance(node, ast.Call):
                values = [kw.value for kw in node.keywords if kw.arg == "hint"]
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and "hint" in t.id.lower() for t in targets) and node.value:
                    values = [node.value]
            for value in values:
                for part in ast.walk(value):
                    if isinstance(part, ast.Constant) and isinstance(part.value, str):
                        found.append((f"{path.relative_to(PACKAGE.parent)}:{part.lineno}", part.value))
    return found


def command_options() -> set[str]:
    """Every long option of every command and sub-command."""
    options: set[str] = set()
    pending = [typer.main.get_command(app)]
    while pending:
        command = pending.pop()
        for param in command.params:
            options.update(o for o in [*param.opts, *param.secondary_opts] if o.startswith("--"))
        pending.extend(getattr(command, "commands", {}).values())
    return options


def test_the_hints_are_found():
    texts = " ".join(text for _, text in hint_texts())
    assert "--resume" in texts and "--derive" in texts  # a hint of launch and one of profile


def test_every_flag_named_in_a_hint_exists():
    options = command_options()
    assert {"--global-batch", "--any-engine", "--every-layer"} <= options  # secondary names count
    unknown = sorted({f"{where}: {flag}" for where, text in hint_texts() for flag in FLAG.findall(text)
                      if flag not in options})
    assert not unknown, "hints name options no command has:\n" + "\n".join(unknown)


def test_every_command_named_in_a_hint_exists():
    commands = set(typer.main.get_command(app).commands)
    assert {"profile", "plan", "launch"} <= commands
    unknown = sorted({f"{where}: pipectl {name}" for where, text in hint_texts() for name in COMMAND.findall(text)
                      if name not in commands})
    assert not unknown, "hints name commands pipectl does not have:\n" + "\n".join(unknown)

"""A command's flags, made from its options model (`pipectl.config`).

    @with_options(LaunchOptions)
    def launch_command(ctx: typer.Context, plan_path: ..., config: ConfigOption = None) -> None:
        options = layered(LaunchOptions, [*file_layers(LaunchOptions, config), passed_flags(ctx, LaunchOptions)])

Each field with a flag becomes one Typer option after the command's own parameters; its help is
the field's description, its default the model's. Only the flags a user typed reach the command
(`passed_flags`), so that a config file or a resumed run's value is not overwritten by a default.
"""

from __future__ import annotations

import functools
import inspect
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer
from pydantic import BaseModel
from rich.markup import escape

from pipectl.config import Layer, file_layer, flag_layer, option_fields, read_config

# The command-line sources of a value (click's ParameterSource names): anything else is a default.
_TYPED = ("COMMANDLINE", "ENVIRONMENT")
_FLAGS = "pipectl.flags"  # ctx.meta key: the flags a user passed, by field

ConfigOption = Annotated[
    Optional[Path],
    typer.Option(
        "--config",
        help="A config file (TOML, or YAML) with \\[model] \\[data] \\[training] \\[checkpoint] \\[cluster] "
        "\\[slurm] \\[monitor] \\[deepspeed] \\[plan] sections; flags win over its values, and a relative path in it is taken from "
        "its folder (`pipectl launch --print-config` writes one).",
        metavar="FILE",
    ),
]


def with_options(model: type[BaseModel], *, after: str | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a command one option per flag field of `model` (after its own parameter `after`, else
    after all of them; one of them a `typer.Context`); the command reads the values passed with
    `passed_flags`."""

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(func, eval_str=True)
        own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in signature.parameters.values()]
        context = next(p.name for p in own if p.annotation is typer.Context)
        made: dict[str, tuple[str, str | None]] = {}  # parameter -> (field, sub-field)
        generated = []
        for field in option_fields(model):
            if field.submodel is not None:
                for sub, flag in field.flags:
                    info = field.submodel.model_fields[sub]
                    made[f"{field.name}__{sub}"] = (field.name, sub)
                    help_text = f"{field.section}: {info.description}"
                    generated.append(_parameter(f"{field.name}__{sub}", flag, str, help_text, None, field.section))
            elif field.flag:
                made[field.name] = (field.name, None)
                generated.append(_parameter(field.name, field.flag, field.cli, field.description, field.default, field.section))

        @functools.wraps(func)
        def command(**values: Any) -> Any:
            ctx = values[context]
            passed: dict[str, Any] = {}
            for parameter, (name, sub) in made.items():
                value = values.pop(parameter)
                if getattr(ctx.get_parameter_source(parameter), "name", None) not in _TYPED:
                    continue
                if sub is None:
                    passed[name] = value
                else:
                    passed.setdefault(name, {})[sub] = value
            ctx.meta[_FLAGS] = passed
            return func(**values)

        cut = next((i + 1 for i, p in enumerate(own) if p.name == after), len(own))
        parameters = [*own[:cut], *generated, *own[cut:]]
        command.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in parameters}
        del command.__wrapped__  # typer reads the signature above, not the function's own
        return command

    return decorate


def _parameter(name: str, flag: str, cli: type, help_text: str, default: Any, section: str | None) -> inspect.Parameter:
    """One Typer option, its default the model's (what the help shows; `passed_flags` leaves
    defaults out). A boolean of a config section is `--x/--no-x` (a flag can undo the file); an
    invocation's (`--resume`) a plain flag."""
    help_text = escape(help_text)  # "[default: ...]" and "[slurm]" are words, not Rich markup
    panel = None if section is None else escape(f"[{section}]") + " options"  # the help lists them by config section
    if cli is bool:
        decls = [flag] if section is None or "/" in flag else [f"{flag}/--no-{flag.removeprefix('--')}"]
        shown = (section is not None or "/" in flag) and bool(default)  # `--live/--restart` says which is the default
        info = typer.Option(*decls, help=help_text, show_default=shown, rich_help_panel=panel)
        return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=bool(default), annotation=Annotated[bool, info])
    shown = default if isinstance(default, (int, float, str, Enum)) else None  # not a model, a mapping or unset
    info = typer.Option(flag, help=help_text, show_default=shown is not None, rich_help_panel=panel)
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=shown, annotation=Annotated[Optional[cli], info])


def config_models() -> tuple[type[BaseModel], ...]:
    """The options models whose keys a config file may hold: the commands that read one."""
    from pipectl.launch.options import LaunchOptions
    from pipectl.plan.options import PlanOptions

    return (PlanOptions, LaunchOptions)


def passed_flags(ctx: typer.Context, model: type[BaseModel]) -> Layer:
    """The flags the user typed, as the top layer of `model`'s options."""
    return flag_layer(model, dict(ctx.meta.get(_FLAGS, {})))


def file_layers(model: type[BaseModel], config: Path | None) -> list[Layer]:
    """The config file's layer ([] without `--config`); its keys checked against every command's
    model (`config_models`: the file is shared, `plan` and `launch` read one)."""
    if config is None:
        return []
    return [file_layer(model, read_config(config, config_models()))]

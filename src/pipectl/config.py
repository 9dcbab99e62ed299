"""Options declared once: one pydantic model per command, whose fields are its options.

A field of such a model carries everything about one option: its type and bounds, its default, its
`--help` text (the field's description), the flag that sets it and the config-file section and key
that set it too (`Opt`). From that one declaration come

- the command's flags (`pipectl.cli.options` turns each field into a Typer option),
- the config file the command reads (`read_config`: TOML, or YAML, in sections),
- the effective options a run stores in job.json (`to_sections`), which `launch --resume` reads
  back, and the commented file `launch --print-config` writes (`render_config`).

Layers, lowest first: the model's defaults; on a resume, the run's stored options; the config
file; the flags (`layered`). A value a layer refuses is named as that layer gave it: `--lr 20.0`,
`job.toml [training] lr = 20.0`; so is one a later check refuses beside another (`given`:
`job.toml [checkpoint] every = 4 exceeds job.toml [training] steps = 2`).

A config file's sections are shared by the commands (`plan` and `launch` read one `job.toml`), so
a key is refused only when no command knows it: a misspelt key is a mistake, never a silent no-op.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import textwrap
import tomllib
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, PrivateAttr, ValidationError

from pipectl.errors import UserInputError
from pipectl.io import ARTIFACT_KINDS, artifact_kind, error_words, input_file, parse_error, safe_load_yaml

OptionsT = TypeVar("OptionsT", bound=BaseModel)


@dataclass(frozen=True)
class Opt:
    """Where an options field is set from; put it in the field's `Annotated[...]` metadata.

    `section` is the config-file table (`training`); None makes the field a flag of one
    invocation only (`--resume`), never read from a file nor stored. `key` is its name there
    (default: the field's). `flag` is its command-line flag (default `--field-name`; None: file
    only). `cli` is the flag's type where the field's own is richer (a comma list, a `MIN:MAX`
    range): the field's validator parses the text. `path` marks a value that may name a file: a
    config file's relative path is taken from the file's folder. `table`: the field is a model
    that fills the whole section, key by key; `flags` names the few of its fields that flags set,
    as (field, flag) pairs.
    """

    section: str | None
    key: str | None = None
    flag: str | None = ""
    cli: type | None = None
    path: bool = False
    table: bool = False
    flags: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class OptionField:
    """One field of an options model, as `Opt` and the field's declaration describe it."""

    name: str
    section: str | None
    key: str
    flag: str | None
    cli: type
    description: str
    path: bool
    default: Any
    submodel: type[BaseModel] | None  # a whole section
    flags: tuple[tuple[str, str], ...]


def option_fields(model: type[BaseModel]) -> list[OptionField]:
    """The fields of `model` that are options (they carry an `Opt`), in declaration order."""
    found = []
    for name, info in model.model_fields.items():
        opt = next((m for m in info.metadata if isinstance(m, Opt)), None)
        if opt is None:
            continue
        inner = _inner_type(info.annotation)
        submodel = inner if opt.table else None
        found.append(
            OptionField(
                name=name,
                section=opt.section,
                key=opt.key or name,
                flag=None if opt.flag is None or submodel else (opt.flag or "--" + name.replace("_", "-")),
                cli=opt.cli or (inner if isinstance(inner, type) and issubclass(inner, (bool, int, float, str, Enum)) else str),
                description=info.description or "",
                path=opt.path,
                default=None if info.is_required() else info.get_default(call_default_factory=True),
                submodel=submodel,
                flags=opt.flags,
            )
        )
    return found


def _inner_type(annotation: Any) -> Any:
    """`X` of `X | None`, else the annotation."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def known_keys(models: Iterable[type[BaseModel]]) -> dict[str, set[str]]:
    """Every section and key some options model reads from a config file."""
    known: dict[str, set[str]] = {}
    for model in models:
        for field in option_fields(model):
            if field.section is None:
                continue
            keys = known.setdefault(field.section, set())
            keys.update(field.submodel.model_fields if field.submodel else {field.key})
    return known


@dataclass(frozen=True)
class ConfigFile:
    """A config file's sections, as read (`read_config`)."""

    path: Path
    sections: dict[str, dict[str, Any]]
    # A run's own options (job.json): an empty value there is one an earlier version stored for an
    # option left unset, read as unset; a user's file is refused one (`cli.groups.empty_value`).
    stored: bool = False

    def values(self, model: type[BaseModel]) -> dict[str, Any]:
        """The fields of `model` this file sets; a relative path is taken from the file's folder."""
        values: dict[str, Any] = {}
        for field in option_fields(model):
            section = self._without_empty(model, field, self.sections.get(field.section or "", {}))
            if field.submodel is not None:
                if section:
                    values[field.name] = dict(section)
            elif field.key in section:
                value = section[field.key]
                if field.path:
                    value = [self._found(model, field, v) for v in value] if isinstance(value, list) else \
                        self._found(model, field, value)
                values[field.name] = value
        return values

    def _without_empty(self, model: type[BaseModel], field: Any, section: dict[str, Any]) -> dict[str, Any]:
        """`section` (the field's own key, or every key of a table field) without the empty values
        of a stored file; in a user's file, an empty value is refused, naming it."""
        keys = list(section) if field.submodel is not None else [field.key] if field.key in section else []
        empty = [key for key in keys if section[key] == "" or (isinstance(section[key], list) and "" in section[key])]
        if empty and not self.stored:
            sub = empty[0] if field.submodel is not None else None
            raise UserInputError(f"{self.where(model, field.name, sub)} = '': empty; give a value, or leave the key out")
        return {key: value for key, value in section.items() if key not in empty}

    def _found(self, model: type[BaseModel], field: Any, value: Any) -> Any:
        """`_beside(value)`; in a user's file, a path that names nothing there is refused naming the
        key and the value as written, beside where it was looked for (every path key is an input)."""
        found = self._beside(value)
        if not self.stored and found != value and not Path(found).exists() and _looks_like_path(value):
            raise UserInputError(f"{self.where(model, field.name)} = {value!r}: no such file (looked for {found})",
                                 hint=f"a relative path is taken from the folder of {self.path}")
        return found

    def _beside(self, value: Any) -> Any:
        """A relative path, taken from this file's folder: absolute. A value that names nothing
        there stays as it is only if it is no path at all (a shipped name, `package.module:function`,
        `hf:NAME`): a path, or a name that is a file in the current directory, is the file's
        folder's even when missing there, so that the error names where it was looked for, and a
        file of the same name where the command happens to run is never taken instead. A folder
        named as a shipped name (a run directory called `local`) leaves the name a name: every
        path key names a file. `~` is the home folder, as a shell would have it on the command line."""
        if isinstance(value, str) and value.startswith("~"):
            try:
                value = str(Path(value).expanduser())
            except RuntimeError:  # ~name of no user: left as written, as a shell leaves it
                pass
        if not isinstance(value, str) or not value or Path(value).is_absolute():
            return value
        beside = (self.path.parent / value).resolve()
        if beside.is_file() or Path(value).is_file() or (not _is_reference(value) and _looks_like_path(value)):
            return str(beside)
        return value

    def where(self, model: type[BaseModel], name: str, sub: str | None = None) -> str:
        """How the file names a field: `job.toml [training] lr`."""
        field = next(f for f in option_fields(model) if f.name == name)
        return f"{self.path} [{field.section}] {sub or field.key}"


def _reads_as_toml(text: str) -> bool:
    try:
        tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return False
    return True


def _is_reference(value: str) -> bool:
    """`package.module:function` or `hf:NAME`: what a model or data field names besides files."""
    return ":" in value


def _looks_like_path(value: str) -> bool:
    """`sub/mine.yaml`, `../tokens.bin`, `corpus.txt`: a folder in it, or a file's suffix (a
    shipped name such as `gpt-tiny`, `local` or `gpt2-2.5b` has neither)."""
    return "/" in value or os.sep in value or re.fullmatch(r"\.[A-Za-z][A-Za-z0-9]*", Path(value).suffix) is not None


def read_config(path: str | os.PathLike[str], models: Iterable[type[BaseModel]]) -> ConfigFile:
    """A config file: TOML (`.toml`), else YAML; tables of keys, each key one that some options
    model in `models` reads. Anything else is refused, naming the section or key."""
    path = input_file(path)
    text = path.read_text(errors="replace")
    try:
        data = tomllib.loads(text) if path.suffix.lower() == ".toml" else safe_load_yaml(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        kind = "TOML" if path.suffix.lower() == ".toml" else "YAML"
        hint = None
        if kind == "YAML" and _reads_as_toml(text):  # `launch --print-config > job.yaml` writes TOML
            hint = f"it reads as TOML (what launch --print-config writes): name it {path.with_suffix('.toml').name}"
        raise UserInputError(f"{path} is not valid {kind}: {parse_error(exc)}", hint=hint) from None
    data = {} if data is None else data
    known = known_keys(models)
    if not isinstance(data, dict):
        raise UserInputError(f"{path} must hold sections ([training], [cluster], ...), found {type(data).__name__}")
    kind = artifact_kind(data)
    config_keys = set(known).union(*known.values())
    if kind is not None and not ARTIFACT_KINDS[kind][1] <= config_keys:
        # Another file in its place (a model config, a profile, a plan), named; not a config file whose
        # key slipped above its section (`devices = 4`: the keys a device catalog is told by).
        raise UserInputError(f"{path} is {ARTIFACT_KINDS[kind][0]}, not a config file",
                             hint="a config file holds sections ([model], [cluster], [training], ...): "
                                  "pipectl launch PLAN --print-config writes one")
    toml = path.suffix.lower() == ".toml"
    for section, keys in data.items():
        if not isinstance(keys, dict) and section in known:  # a section's name given a value, not its keys
            example = f"[{section}] with KEY = VALUE lines" if toml else f"{section}: then indented KEY: VALUE lines"
            raise UserInputError(f"{path}: section {section} holds {keys!r}, not keys", hint=f"write {example}")
        if not isinstance(keys, dict):
            homes = [f"[{name}]" if toml else f"{name}:" for name, names in known.items() if section in names]
            raise UserInputError(
                f"{path}: {section} = {keys!r} is outside any section, and every key goes in one",
                hint=f"put it under {' or '.join(homes)}" if homes else f"sections: {', '.join(f'[{s}]' for s in known)}",
            )
        if section not in known:
            raise UserInputError(
                f"{path}: unknown section [{section}]",
                hint=_did_you_mean(section, known, "[{}]") + f"sections: {', '.join(f'[{s}]' for s in known)}",
            )
        for key in keys:
            if key not in known[section]:
                raise UserInputError(
                    f"{path}: [{section}] has no key {key!r}",
                    hint=_did_you_mean(key, known[section], "'{}'") + f"[{section}] keys: {', '.join(sorted(known[section]))}",
                )
    return ConfigFile(path, {section: dict(keys) for section, keys in data.items()})


def _did_you_mean(word: str, names: Iterable[str], form: str) -> str:
    """'did you mean [training]? ' for a near miss among `names` (as `io.validation_message` says it
    of model and cluster YAML keys), else ''."""
    near = difflib.get_close_matches(word, list(names), n=1)
    return f"did you mean {form.format(near[0])}? " if near else ""


@dataclass(frozen=True)
class Layer:
    """Values for some fields of an options model, and how to name where one came from."""

    values: dict[str, Any]
    name: typing.Callable[[str, str | None], str]  # (field, sub-field) -> "--lr", "job.toml [training] lr"
    assign: str = " "  # between the name and a value: "--lr 20.0", "job.toml [training] lr = 20.0"


def flag_layer(model: type[BaseModel], values: dict[str, Any]) -> Layer:
    """The flags a user passed, by field (a section field's by sub-field: {'slurm': {'account': ..}})."""
    flags = {f.name: f for f in option_fields(model)}

    def name(field: str, sub: str | None) -> str:
        spec = flags[field]
        return dict(spec.flags).get(sub, spec.flag or field) if sub else (spec.flag or field)

    return Layer(values, name)


def file_layer(model: type[BaseModel], config: ConfigFile) -> Layer:
    return Layer(config.values(model), lambda field, sub: config.where(model, field, sub), " = ")


def stored_layer(model: type[BaseModel], sections: dict[str, dict[str, Any]], source: str | os.PathLike[str]) -> Layer:
    """A run's stored options (job.json's `options`), read back; named as `source [section] key`."""
    return file_layer(model, ConfigFile(Path(source), sections, stored=True))


def layered(model: type[OptionsT], layers: list[Layer], *, context: dict[str, Any] | None = None, **fixed: Any) -> OptionsT:
    """The options `layers` give, later layers over earlier ones (a section's keys one by one),
    over the model's defaults; `fixed` are values no user gave (what a run records about itself);
    `context` goes to the model's validators. A refused value is named by the layer that gave it."""
    tables = {f.name for f in option_fields(model) if f.submodel is not None}
    merged: dict[str, Any] = {}
    origin: dict[tuple[str, str | None], Layer] = {}
    for layer in layers:
        for name, value in layer.values.items():
            if name in tables and isinstance(value, dict):  # a whole section: key by key
                earlier = merged.get(name)
                merged[name] = {**earlier, **value} if isinstance(earlier, dict) else value
                origin.setdefault((name, None), layer)
                origin.update({(name, key): layer for key in value})
            else:
                merged[name] = value
                origin[(name, None)] = layer
    try:
        options = model.model_validate({**merged, **fixed}, context=context)
    except ValidationError as exc:
        message, hint = _refusal(model, exc, merged, origin)
        raise UserInputError(message, hint=hint) from None
    if isinstance(options, Layered):
        options._given = {
            name: (_named(layer.name(name, None), layer.assign, merged[name]), getattr(options, name))
            for (name, sub), layer in origin.items()
            if sub is None and name not in tables
        }
    return options


class Layered(BaseModel):
    """An options model that remembers how `layered` was given each value, for `given`."""

    # field -> (how it was given, the value it validated to)
    _given: dict[str, tuple[str, Any]] = PrivateAttr(default_factory=dict)


def given(options: Layered, name: str) -> str:
    """A field's value named as the user gave it (`--steps 2`, `job.toml [training] steps = 2`, a
    resumed run's `job.json [training] steps = 2`), for a check that refuses two values together;
    a value no layer gave (a default, or one set after layering) is named by its flag."""
    value = getattr(options, name)
    text, validated = options._given.get(name, (None, None))
    if text is not None and validated == value:
        return text
    flag = next(f.flag for f in option_fields(type(options)) if f.name == name) or name
    return _named(flag, " ", value)


def _named(name: str, assign: str, value: Any) -> str:
    """`--steps 2`, `--tensorboard` (a switch that is on), `job.toml [training] steps = 2`."""
    if assign == " " and isinstance(value, bool) and name.startswith("--"):
        return name if value else f"--no-{name[2:]}"  # a switch, as typed: `--tensorboard`, `--no-morph`
    return f"{name}{assign}{_shown(value, bare=assign == ' ')}"


def _refusal(
    model: type[BaseModel], exc: ValidationError, merged: dict[str, Any], origin: dict[tuple[str, str | None], Layer]
) -> tuple[str, str | None]:
    """One line per refused value, each named as its layer gave it, and the first one's hint."""
    lines, hint = [], None
    fields = {f.name: f for f in option_fields(model)}
    for err in exc.errors():
        loc = [str(part) for part in err["loc"]]
        field, sub = (loc[0], loc[1] if len(loc) > 1 else None) if loc else ("", None)
        if err["type"] == "missing" and sub is None and field in fields:
            spec = fields[field]
            in_file = f" (or [{spec.section}] {spec.key} in a --config file)" if spec.section else ""
            lines.append(f"missing {spec.flag}{in_file}")
            continue
        layer = origin.get((field, sub)) or origin.get((field, None))
        value = merged.get(field)
        if sub is not None and isinstance(value, dict):
            value = value.get(sub)
        where = layer.name(field, sub) if layer is not None else (field or "options")
        message = error_words(err)
        if isinstance(value, float) and value != value:  # every bound fails on NaN: say why
            value, message = "nan", "not a number"
        lines.append(f"{where}{layer.assign}{_shown(value)}: {message}" if layer is not None else f"{where}: {message}")
        error = (err.get("ctx") or {}).get("error")
        hint = hint or getattr(error, "hint", None)
    return "; ".join(lines), hint


def _shown(value: Any, *, bare: bool = False) -> str:
    """A value as the user wrote it; a refused one quoted (`--tokens '300X'`), an accepted flag's
    text `bare` (`--checkpoint-every 4`)."""
    if isinstance(value, bool):
        return str(value).lower()  # as the file wrote it
    value = value.value if isinstance(value, Enum) else value
    value = os.fspath(value) if isinstance(value, os.PathLike) else value  # a path flag: as typed, not PosixPath(...)
    if bare and isinstance(value, (list, tuple)):  # a comma list flag: `--hosts n1,n2`
        value = ",".join(map(str, value))
    if bare and isinstance(value, float) and value == value and float(f"{value:g}") == value:
        value = f"{value:g}"  # `--mtbf-hours 5` as typed, not 5.0
    shown = value if bare and isinstance(value, str) else repr(value)
    return shown if len(shown) <= 120 else shown[:117] + "..."


class OptionValueError(ValueError):
    """A validator's refusal with a hint for the person who gave the value."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


def to_sections(options: BaseModel) -> dict[str, dict[str, Any]]:
    """The options that belong in a file, by section and key (JSON values; unset ones left out):
    what job.json stores and `--print-config` writes."""
    dumped = options.model_dump(mode="json")
    sections: dict[str, dict[str, Any]] = {}
    for field in option_fields(type(options)):
        if field.section is None:
            continue
        value = dumped[field.name]
        if field.submodel is not None:
            value = {k: v for k, v in value.items() if v is not None}
            if value:
                sections.setdefault(field.section, {}).update(value)
        elif value is not None and value != {}:
            sections.setdefault(field.section, {})[field.key] = value
    return sections


def files_gone(sections: dict[str, dict[str, Any]], models: Iterable[type[BaseModel]]) -> list[tuple[str, type[BaseModel]]]:
    """The files that `sections` names (under a key of `models` marked `Opt(path=True)`) and that are
    no longer there: ("[section] key path", the options model reading it). A printed config keeps
    a plan's and a run's paths absolute; a later `plan --config` or `launch --config` of it reads
    them and fails, naming the first gone. Values that name no absolute path (a model reference,
    `synthetic`) are not files."""
    gone, seen = [], set()
    for model in models:
        for field in option_fields(model):
            if not field.path or field.section is None or (field.section, field.key) in seen:
                continue
            seen.add((field.section, field.key))
            value = sections.get(field.section, {}).get(field.key)
            for path in value if isinstance(value, list) else [value]:
                if isinstance(path, str) and Path(path).is_absolute() and not Path(path).exists():
                    gone.append((f"[{field.section}] {field.key} {path}", model))
    return gone


def render_config(
    models: type[BaseModel] | Iterable[type[BaseModel]],
    sections: dict[str, dict[str, Any]],
    *,
    title: str,
    inherited: dict[str, dict[str, tuple[Any, str]]] | None = None,
) -> str:
    """`sections` as a TOML file with each key's description above it; a key without a value is
    written commented out, so that every option of `models` appears once, where it goes (a key two
    models read, under the first one's description). `inherited`: values an unset key takes from
    elsewhere (a cluster file's Slurm section), as (value, where from): shown in its comment."""
    inherited = inherited or {}
    lines = [f"# {line}" for line in title.splitlines()]
    by_section: dict[str, list[tuple[str, str, Any]]] = {}
    seen: set[tuple[str, str]] = set()

    def add(section: str, key: str, description: str) -> None:
        if (section, key) not in seen:
            seen.add((section, key))
            by_section.setdefault(section, []).append((key, description, sections.get(section, {}).get(key)))

    for model in [models] if isinstance(models, type) else models:
        for field in option_fields(model):
            if field.section is None:
                continue
            if field.submodel is not None:
                for key, info in field.submodel.model_fields.items():
                    add(field.section, key, info.description or "")
            else:
                add(field.section, field.key, field.description)
    for section, entries in by_section.items():
        lines += ["", f"[{section}]"]
        for key, description, value in entries:
            lines += textwrap.wrap(description, width=98, initial_indent="# ", subsequent_indent="# ")
            if value is not None:
                lines.append(f"{_toml_key(key)} = {toml_value(value)}")
            elif key in inherited.get(section, {}):
                given, source = inherited[section][key]
                lines.append(f"# {_toml_key(key)} = {toml_value(given)}  ({source}; set here to override)")
            else:
                lines.append(f"# {key} =")
    return "\n".join(lines) + "\n"


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else json.dumps(key)


def toml_value(value: Any) -> str:
    """A JSON value as TOML: JSON's strings, numbers and arrays are TOML's; an object becomes an
    inline table. (None has no TOML form: an unset key is written commented out.)"""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_toml_key(k)} = {toml_value(v)}" for k, v in value.items() if v is not None) + " }"
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, float) and value.is_integer():
        return repr(value)  # 1.0, not 1: read back as the float it is
    return json.dumps(value)

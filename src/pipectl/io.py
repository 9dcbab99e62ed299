"""Reading and writing artifacts: YAML/JSON in, pydantic models out, errors that name the file."""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
import stat
import tempfile
import typing
from pathlib import Path
from typing import Any, Hashable, Mapping, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from pipectl.errors import ArtifactError, PipectlError, UserInputError
from pipectl.words import count

ModelT = TypeVar("ModelT", bound=BaseModel)


MAX_YAML_NODES = 1_000_000  # far above any pipectl file; a "billion laughs" file has 10**9


class BoundedSafeLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses a document whose aliases expand to more than
    `MAX_YAML_NODES` nodes. Aliases are shared when loaded, but everything that walks the result
    (validation, JSON) walks the expansion: nine nested lists of nine aliases each are 10**9
    nodes, which hung `pipectl profile` on a 9-line file. The count is kept while composing, with
    each anchored node's size computed once."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._expanded = 0
        self._sizes: dict[int, int] = {}

    def compose_node(self, parent: Any, index: Any) -> Any:
        alias = self.check_event(yaml.AliasEvent)
        node = super().compose_node(parent, index)
        self._expanded += self._size(node) if alias else 1
        if self._expanded > MAX_YAML_NODES:
            raise yaml.YAMLError(f"its aliases expand to more than {MAX_YAML_NODES:,} values")
        return node

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        """A mapping; a key written twice in it is an error, where YAML loaders keep the last one
        and drop the first without a word (a condition, a cluster figure, a model dimension)."""
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *defaults`: keys written beside it override the merged ones, as meant
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, Hashable):
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"the key {key!r} is written twice (the first would be dropped)", key_node.start_mark
                    )
                seen.add(key)
        return super().construct_mapping(node, deep)

    def _size(self, node: yaml.Node) -> int:
        """Values in `node` with every alias expanded (memoised per node)."""
        key = id(node)
        if key not in self._sizes:
            self._sizes[key] = 1  # a recursive alias counts once instead of looping
            if isinstance(node, yaml.SequenceNode):
                self._sizes[key] = 1 + sum(self._size(child) for child in node.value)
            elif isinstance(node, yaml.MappingNode):
                self._sizes[key] = 1 + sum(self._size(k) + self._size(v) for k, v in node.value)
        return self._sizes[key]


def safe_load_yaml(text: str) -> Any:
    """`yaml.safe_load`, bounded: see `BoundedSafeLoader` (what safe_load does, with that loader)."""
    loader = BoundedSafeLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def input_file(path: str | os.PathLike[str]) -> Path:
    """`path` names a file to read: a regular file or a pipe (`<(...)`). Anything else is a user
    error that says what it is: missing, a directory, a device, or a name the system refuses
    (too long, a part of it a file)."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise UserInputError(f"file not found: {path}") from None
    except OSError as exc:
        raise UserInputError(f"cannot read {path}: {exc.strerror}") from None
    if stat.S_ISDIR(mode):
        raise UserInputError(f"{path} is a directory, not a file")
    if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
        raise UserInputError(f"{path} is {_kind_of(mode)}, not a file to read")
    return path


# The largest YAML or JSON file read (a GPT-3 plan with its morph table is ~20 MB; `plan --all`
# at that scale stays well below): a larger one is refused before it fills memory.
MAX_MAPPING_BYTES = 512 * 2**20


def read_mapping(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Parse a YAML or JSON file into a mapping; a missing or malformed file is a user error."""
    path = input_file(path)
    try:
        with path.open("rb") as handle:  # read no more than a pipectl file can hold (a FIFO has no size)
            raw = handle.read(MAX_MAPPING_BYTES + 1)
        if len(raw) > MAX_MAPPING_BYTES:
            raise ArtifactError(f"{path} is larger than {MAX_MAPPING_BYTES // 2**20} MiB: not one of pipectl's files")
        text = raw.decode()
        data = json.loads(text) if path.suffix == ".json" else safe_load_yaml(text)
    except (yaml.YAMLError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {parse_error(exc)}") from None
    except ValueError as exc:  # a value YAML reads as a date or number that is none (`when: 2024-13-01`)
        raise ArtifactError(f"{path} holds a value YAML cannot read: {exc}") from None
    except OSError as exc:  # unreadable (permissions), a folder behind the name
        raise ArtifactError(f"cannot read {path}: {exc.strerror or exc}") from None
    except RecursionError:
        raise ArtifactError(f"{path} is nested too deeply to be one of pipectl's files") from None
    if data is None:
        raise ArtifactError(f"{path} is empty: it must hold a mapping of keys to values")
    if not isinstance(data, dict):
        kind = "a list" if isinstance(data, list) else "text" if isinstance(data, str) else f"the value {data!r}"
        raise ArtifactError(f"{path} must hold a mapping of keys to values at the top level, not {kind}")
    return data


def parse_error(exc: Exception) -> str:
    """A parser's complaint on one line, with the line and column in the file where it has them
    (PyYAML's own text spans several lines and names "<unicode string>", not the file).

    >>> try:
    ...     safe_load_yaml("node_types: [")
    ... except yaml.YAMLError as exc:
    ...     parse_error(exc)
    "expected the node content, but found '<stream end>' (at line 1, column 14)"
    """
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        what = exc.problem or exc.context or "not valid"
        return f"{what} (at line {mark.line + 1}, column {mark.column + 1})" if mark is not None else what
    return " ".join(str(exc).split())


def validation_message(
    exc: ValidationError, names: Mapping[str, str] | None = None, model: type[BaseModel] | None = None
) -> str:
    """One line per validation error, naming the field and the offending value (a check of the whole
    file, whose message names its values, as it is); `names` calls a field (the last part of its
    location) what the user set it as (a command-line option). An unknown key is said as one, with
    the nearest of the missing keys, or of `model`'s fields at its place, as its likely spelling."""
    lines = []
    errors = exc.errors()
    # A misspelt key is an unknown key beside a missing one: said once, as the misspelling.
    missing = {tuple(err["loc"]) for err in errors if err["type"] == "missing" and err["loc"]}
    misspelt: dict[tuple, str] = {}
    for err in errors:
        loc = tuple(err["loc"])
        if err["type"] == "extra_forbidden" and loc:
            near = difflib.get_close_matches(str(loc[-1]), [str(m[-1]) for m in missing if m[:-1] == loc[:-1]], n=1)
            if near:
                misspelt[loc] = near[0]
                missing.discard((*loc[:-1], near[0]))
    for err in errors:
        loc = tuple(err["loc"])
        if loc in misspelt:
            lines.append(f"{'.'.join(map(str, loc))}: unknown key; did you mean {misspelt[loc]}?")
            continue
        if err["type"] == "missing" and any(loc == (*m[:-1], near) for m, near in misspelt.items()):
            continue
        if err["type"] == "extra_forbidden" and loc:
            near = difflib.get_close_matches(str(loc[-1]), _field_names_at(model, loc[:-1]), n=1)
            lines.append(f"{'.'.join(map(str, loc))}: unknown key" + (f"; did you mean {near[0]}?" if near else ""))
            continue
        where = ".".join(str(part) for part in err["loc"]) or "(top level)"
        if names and err["loc"] and str(err["loc"][-1]) in names:
            where = names[str(err["loc"][-1])]
        value = err.get("input")
        shown = "{...}" if isinstance(value, dict) else "[...]" if isinstance(value, list) and len(repr(value)) > 80 else repr(value)
        if len(shown) > 200:
            shown = shown[:200] + "..."
        message = error_words(err)
        if not err["loc"] and isinstance(value, dict):  # a check of the whole file names its values itself
            lines.append(message)
            continue
        if err["type"] == "missing":  # the input is the mapping the key is missing from: no news
            lines.append(f"{where}: {message}")
            continue
        lines.append(f"{where}: {message} (got {shown})")
    return "; ".join(lines)


# A pattern that is one character class, repeated: said as the characters it allows.
_CHARACTER_CLASS = re.compile(r"\^\[(?P<chars>[^\]]+)\](?P<count>[*+]|\{(?P<least>\d+),(?P<most>\d+)\})\$")


def error_words(err: Mapping[str, Any]) -> str:
    """A validation error's message in the user's words: a string that fails a character-class
    pattern says which characters it may hold, not the regular expression; an empty list that needs
    one entry says so.

        >>> error_words({"type": "string_pattern_mismatch", "msg": "...", "ctx": {"pattern": "^[A-Za-z0-9_.-]{1,128}$"}})
        'should be 1 to 128 letters, digits or any of _.-, without spaces'
        >>> error_words({"type": "string_pattern_mismatch", "msg": "...", "ctx": {"pattern": "^[a-z0-9:/-]*$"}})
        'should hold only lower-case letters, digits or any of :/-, without spaces'
        >>> error_words({"type": "too_short", "msg": "...", "ctx": {"min_length": 1, "actual_length": 0}})
        'is empty: name at least one'
    """
    message = str(err["msg"]).removeprefix("Value error, ")  # a validator's own words say enough
    if err.get("type") == "too_short" and (err.get("ctx") or {}).get("actual_length") == 0:
        return "is empty: name at least one" if err["ctx"].get("min_length") == 1 else message
    found = _CHARACTER_CLASS.fullmatch(str((err.get("ctx") or {}).get("pattern", "")))
    if err.get("type") != "string_pattern_mismatch" or found is None:
        return message
    chars, kinds = found["chars"], []
    for span, kind in (("A-Za-z", "letters"), ("a-z", "lower-case letters"), ("0-9", "digits")):
        if span in chars:
            chars, _ = chars.replace(span, "", 1), kinds.append(kind)
    if chars:
        kinds.append(f"any of {chars}")
    allowed = ", ".join(kinds[:-1]) + f" or {kinds[-1]}" if len(kinds) > 1 else kinds[0]
    if found["count"] == "*":
        return f"should hold only {allowed}, without spaces"
    many = "one or more" if found["count"] == "+" else f"{found['least']} to {found['most']}"
    return f"should be {many} {allowed}, without spaces"


def _field_names_at(model: type[BaseModel] | None, loc: tuple) -> list[str]:
    """The fields of the model found at `loc` inside `model` (list indices passed over), or none."""
    for part in loc:
        if isinstance(part, int) or model is None:
            continue
        field = model.model_fields.get(str(part))
        model = None if field is None else _model_in(field.annotation)
    return list(model.model_fields) if model is not None else []


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model an annotation holds (`SlurmSpec`, `list[NodeType]`, `LinkSpec | None`)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for argument in typing.get_args(annotation):
        found = _model_in(argument)
        if found is not None:
            return found
    return None


# The kinds of file one command may be handed in place of another, by their model's class name:
# what to call one, and the top-level keys that only that kind has (all of them required).
ARTIFACT_KINDS: dict[str, tuple[str, frozenset[str]]] = {
    "ModelProfile": ("a profile (pipectl profile)", frozenset({"source", "micro_batch_sizes", "layers"})),
    "LinksProfile": ("a links calibration (pipectl profile links)", frozenset({"backend", "fits"})),
    "Plan": ("a plan (pipectl plan)", frozenset({"model_shape", "request", "chosen"})),
    "ClusterSpec": ("a cluster (configs/clusters/*.yaml)", frozenset({"node_types"})),
    "ModelConfig": ("a model config (configs/models/*.yaml)", frozenset({"family", "hidden"})),
    "DeviceCatalog": ("a device catalog (configs/devices.yaml)", frozenset({"devices"})),
    "JobSpec": ("a run's job.json (pipectl launch)", frozenset({"world_size", "ranks_per_node", "master_port"})),
    "CheckpointManifest": ("a checkpoint manifest", frozenset({"tag", "files", "bytes"})),
    "MorphRecord": ("a resize record (pipectl resize)", frozenset({"from_layout", "to_layout"})),
    "RankFailure": ("a rank's failure record", frozenset({"rank", "exception"})),
    "RunsCalibration": ("a calibration (pipectl calibrate MEASURED.csv)", frozenset({"uncalibrated", "terms"})),
    "RunConditions": ("a conditions file (pipectl validate --conditions)", frozenset({"devices_per_node", "vocab", "precision"})),
    # No model of pipectl's: DeepSpeed's own file, which a run directory holds beside its plan.
    "DeepSpeedConfig": ("a DeepSpeed config (a run's ds_config.json)", frozenset({"train_batch_size", "train_micro_batch_size_per_gpu"})),
}


def artifact_kind(data: dict[str, Any]) -> str | None:
    """The class name of the one kind of file in `ARTIFACT_KINDS` whose keys `data` has, else None.

    >>> artifact_kind({"schema_version": 1, "backend": "gloo", "device": "cpu", "fits": {}})
    'LinksProfile'
    >>> artifact_kind({"name": "x"}) is None
    True
    """
    kinds = [name for name, (_, keys) in ARTIFACT_KINDS.items() if keys <= data.keys()]
    return kinds[0] if len(kinds) == 1 else None


def file_kind(path: str | os.PathLike[str]) -> str | None:
    """What kind of pipectl file `path` is, in words ("a plan (pipectl plan)"), or None when it is
    not one (or cannot be read)."""
    try:
        kind = artifact_kind(read_mapping(path))
    except PipectlError:
        return None
    return ARTIFACT_KINDS[kind][0] if kind is not None else None


def read_records(model_type: type[ModelT], path: str | os.PathLike[str]) -> list[ModelT]:
    """The lines of a JSON-lines log that `model_type` validates, in order; a line that does not
    (a write cut short by a kill or a full disk) is skipped, a missing file is empty."""
    try:
        lines = Path(path).read_text(errors="replace").splitlines()  # a stray byte: its line is skipped
    except OSError:
        return []
    records = []
    for line in lines:
        try:
            records.append(model_type.model_validate_json(line))
        except ValidationError:
            continue
    return records


def load_model(model_type: type[ModelT], path: str | os.PathLike[str]) -> ModelT:
    """Read and validate an artifact file; errors name the file, the field and the value, or what
    the file is when it is another kind of pipectl file ("p.json is a profile (pipectl profile),
    not a plan (pipectl plan)")."""
    data = read_mapping(path)
    return parse_model(model_type, data, source=str(path))


def parse_model(model_type: type[ModelT], data: dict[str, Any], *, source: str) -> ModelT:
    try:
        return model_type.model_validate(data)
    except ValidationError as exc:
        expected = ARTIFACT_KINDS.get(model_type.__name__)
        found = artifact_kind(data)
        if expected is not None and found is not None and found != model_type.__name__:
            raise ArtifactError(f"{source} is {ARTIFACT_KINDS[found][0]}, not {expected[0]}") from None
        if expected is not None and found is None and _foreign(model_type, data, expected[1]):
            own = sorted(expected[1])
            strange = sorted(data.keys() - set(model_type.model_fields))
            raise ArtifactError(
                f"{source} is not {expected[0]}: it has no {' or '.join([', '.join(own[:-1]), own[-1]] if len(own) > 1 else own)} "
                f"key, and {count(len(strange), 'key')} one does not have "
                f"({', '.join(strange[:4])}{', ...' if len(strange) > 4 else ''})"
            ) from None
        raise ArtifactError(f"{source}: {validation_message(exc, model=model_type)}") from exc


def _foreign(model_type: type[BaseModel], data: dict[str, Any], distinctive: frozenset[str]) -> bool:
    """Whether `data` is some other file altogether (a benchmark's JSON handed as a calibration):
    none of the kind's own keys, and more keys the kind does not know than keys it does. A file of
    the kind with a key misspelt stays one (its errors name the key and the likely spelling).

    >>> from pipectl.artifacts.calibration import RunsCalibration
    >>> keys = ARTIFACT_KINDS["RunsCalibration"][1]
    >>> _foreign(RunsCalibration, {"machine": 1, "command": 2, "date": 3}, keys)
    True
    >>> _foreign(RunsCalibration, {"device": "a100", "framework": "x", "term": {}}, keys)
    False
    """
    if distinctive & data.keys():
        return False
    known = len(data.keys() & set(model_type.model_fields))
    return len(data) - known > known


def check_output_file(path: str | os.PathLike[str], *, what: str = "output") -> Path:
    """`path` is somewhere a file may be written: absent, or a regular file (replaced).

    Anything else that exists is refused: a directory, a symbolic link (even to a regular file:
    the rename would replace the link, not its target), a FIFO, a socket or a device (`-o /dev/null`
    run as root would replace the device node with a regular file).
    """
    path = Path(path)
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        raise UserInputError(f"cannot write {what} {path}: {exc.strerror}") from None
    if mode is not None and not stat.S_ISREG(mode):
        raise UserInputError(f"{what} {path} is {_kind_of(mode)}; give the path of a regular file to write")
    if path.parent.exists() and not path.parent.is_dir():
        raise UserInputError(f"cannot write {what} {path}: {path.parent} is not a directory")
    if mode is None or not os.access(path, os.W_OK):  # a writable file stays writable in place (a plot's savefig)
        _check_writable_folder(path, what)
    return path


def nearest_existing_parent(path: str | os.PathLike[str]) -> Path | None:
    """The nearest existing path above `path` (absolute): where creating it would start; None for a root."""
    return next((folder for folder in Path(path).absolute().parents if folder.exists()), None)


def _check_writable_folder(path: Path, what: str) -> None:
    """The nearest existing folder above `path` takes a new file (probed with an unnamed temporary
    file, which leaves nothing behind): a read-only or pseudo filesystem is refused before the work
    whose result would be written there, not after it."""
    existing = nearest_existing_parent(path)
    if existing is None:
        return
    if not existing.is_dir():
        raise UserInputError(f"cannot write {what} {path}: {existing} is not a directory")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        raise UserInputError(f"cannot write {what} {path}: {existing} does not take new files ({exc.strerror})") from None


def _kind_of(mode: int) -> str:
    """What a file that is not a regular one is, in words."""
    return (
        "a directory" if stat.S_ISDIR(mode)
        else "a symbolic link" if stat.S_ISLNK(mode)
        else "a FIFO" if stat.S_ISFIFO(mode)
        else "a socket" if stat.S_ISSOCK(mode)
        else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
        else "not a regular file"
    )


def umask() -> int:
    """The process's umask: read from /proc (Linux 4.7+), else by setting it and back."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    current = os.umask(0o022)
    os.umask(current)
    return current


def temporary_file(folder: str | os.PathLike[str], name: str) -> tuple[int, str]:
    """A new, uniquely named temporary file in `folder` for an atomic replace of `name`, with the
    mode a plain `open(name, "w")` would give it (0o666 less the umask; mkstemp alone gives 0o600).
    An error names the file meant, `folder/name`, not the temporary one."""
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(Path(folder) / name)) from exc
    try:
        os.fchmod(fd, 0o666 & ~umask())
    except BaseException:
        os.close(fd)
        Path(tmp).unlink(missing_ok=True)
        raise
    return fd, tmp


def write_json_atomic(path: str | os.PathLike[str], payload: BaseModel | dict[str, Any]) -> Path:
    """Write JSON next to `path`, fsync, then rename over it: readers never see half a file.

    `path` must be absent or a regular file (`check_output_file`); the file gets the user's umask.
    """
    text = payload.model_dump_json(indent=2) if isinstance(payload, BaseModel) else json.dumps(payload, indent=2)
    return write_text_atomic(path, text + "\n")


def write_text_atomic(path: str | os.PathLike[str], text: str, *, executable: bool = False, create_parent: bool = True) -> Path:
    """Write `text` to a uniquely named sibling of `path`, fsync, then rename over it: a reader (a
    batch shell still reading the old launch.sh, a rank reading `latest`) sees the old file or the
    new one, never half of one. `path` must be absent or a regular file; it gets the user's umask,
    and with `executable` is executable by whoever may read it (umask 077: 0700, not 0711). Without
    `create_parent`, a folder gone meanwhile stays gone (an OSError), not made again for one file."""
    path = check_output_file(path)
    try:
        if create_parent:
            path.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise UserInputError(f"cannot write {path}: a part of {path.parent} is not a directory") from None
    fd, tmp = temporary_file(path.parent, path.name)
    try:
        if executable:
            mode = os.fstat(fd).st_mode & 0o777
            os.fchmod(fd, mode | (mode & 0o444) >> 2)
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def sha256_file(path: str | os.PathLike[str], chunk_bytes: int = 1 << 20) -> str:
    """sha256 of a file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()

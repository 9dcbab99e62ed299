"""Reading and writing artifacts: YAML/JSON in, pydantic models out, errors that name the file."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from pipectl.errors import ArtifactError, UserInputError

ModelT = TypeVar("ModelT", bound=BaseModel)


def read_mapping(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Parse a YAML or JSON file into a mapping; a missing or malformed file is a user error."""
    path = Path(path)
    if not path.is_file():
        raise UserInputError(f"file not found: {path}")
    try:
        text = path.read_text()
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {exc}")
    if not isinstance(data, dict):
        raise ArtifactError(f"{path} must hold a mapping at the top level, found {type(data).__name__}")
    return data


def validation_message(exc: ValidationError) -> str:
    """One line per validation error, naming the field and the offending value."""
    lines = []
    for err in exc.errors():
        where = ".".join(str(part) for part in err["loc"]) or "(top level)"
        value = err.get("input")
        shown = repr(value) if not isinstance(value, dict) else "{...}"
        lines.append(f"{where}: {err['msg']} (got {shown})")
    return "; ".join(lines)


def load_model(model_type: type[ModelT], path: str | os.PathLike[str]) -> ModelT:
    """Read and validate an artifact file; errors name the file, the field and the value."""
    data = read_mapping(path)
    return parse_model(model_type, data, source=str(path))


def parse_model(model_type: type[ModelT], data: dict[str, Any], *, source: str) -> ModelT:
    try:
        return model_type.model_validate(data)
    except ValidationError as exc:
        raise ArtifactError(f"{source}: {validation_message(exc)}") from exc


def write_json_atomic(path: str | os.PathLike[str], payload: BaseModel | dict[str, Any]) -> Path:
    """Write JSON next to `path`, fsync, then rename over it: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = payload.model_dump_json(indent=2) if isinstance(payload, BaseModel) else json.dumps(payload, indent=2)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text + "\n")
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

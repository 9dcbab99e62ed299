"""Common base classes for artifacts, and the number types every file shares.

Rules every artifact follows (a file is data a user may have edited or damaged):

- unknown fields are an error, never dropped silently;
- a number is a number: `true` is refused where an int or a float is expected (pydantic's lax
  mode would read it as 1), and so is NaN or ±Infinity anywhere;
- an int fits a signed 64-bit integer (numpy, torch and the C libraries below them hold no more);
- seconds, bytes and rates carry bounds (`Seconds`, `Bytes`, `BytesPerSecond`) far beyond any real
  figure but small enough that sums over every layer and micro-batch of a plan stay finite.
"""

from __future__ import annotations

import types
import typing
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

# A sha256 as hex, the form every hash in pipectl's files takes.
Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]

INT64_MAX = 2**63 - 1
# 2**53 bytes (8 PiB): the largest integer a float64 holds exactly; no device holds a layer that large.
MAX_BYTES = 2**53
# About 31 years: one layer, transfer or step taking longer is a broken file, not a measurement.
MAX_SECONDS = 1e9
# Rates between 1 byte/s and 1 PB/s; fits and datasheets lie between 1e5 (a slow network) and 1e13.
MIN_BYTES_PER_SECOND = 1.0
MAX_BYTES_PER_SECOND = 1e15

Seconds = Annotated[float, Field(ge=0, le=MAX_SECONDS)]
Bytes = Annotated[int, Field(ge=0, le=MAX_BYTES)]
BytesPerSecond = Annotated[float, Field(ge=MIN_BYTES_PER_SECOND, le=MAX_BYTES_PER_SECOND)]


def _misplaced_number(annotation: Any, value: Any) -> str | None:
    """Why `value` is not a number that `annotation` (int, float, and containers of them) accepts:
    a bool where a number is wanted, or an int beyond int64; None when nothing is wrong."""
    origin = typing.get_origin(annotation)
    if annotation in (int, float):
        if isinstance(value, bool):
            return f"{str(value).lower()} is a boolean, not a number"  # as a YAML or TOML file writes it
        if annotation is int and isinstance(value, int) and not -INT64_MAX - 1 <= value <= INT64_MAX:
            return f"{value} does not fit a 64-bit integer"
        return None
    if origin is Literal:  # Literal[1] takes True (True == 1): schema_version: true
        options = typing.get_args(annotation)
        if isinstance(value, bool) and not any(isinstance(option, bool) for option in options):
            return f"{value!r} is a boolean, not {' or '.join(map(repr, options))}"
        return None
    if origin is Annotated:
        return _misplaced_number(typing.get_args(annotation)[0], value)
    if origin in (Union, types.UnionType):
        options = typing.get_args(annotation)
        if bool in options:
            return None
        for option in options:
            if option is not type(None) and (reason := _misplaced_number(option, value)):
                return reason
        return None
    if origin in (list, set, frozenset) and isinstance(value, (list, tuple, set, frozenset)):
        (item,) = typing.get_args(annotation) or (Any,)
        return next((r for v in value if (r := _misplaced_number(item, v))), None)
    if origin is tuple and isinstance(value, (list, tuple)):
        args = typing.get_args(annotation)
        items = [args[0]] * len(value) if len(args) == 2 and args[1] is Ellipsis else list(args)
        return next((r for a, v in zip(items, value) if (r := _misplaced_number(a, v))), None)
    if origin is dict and isinstance(value, dict):
        args = typing.get_args(annotation)
        return next((r for v in value.values() if (r := _misplaced_number(args[1], v))), None) if args else None
    return None


class Strict(BaseModel):
    """A nested record: unknown fields are an error, never dropped silently; numbers are finite
    numbers (no NaN, no Infinity, no `true` read as 1, no int beyond int64)."""

    model_config = ConfigDict(extra="forbid", use_enum_values=False, populate_by_name=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _numbers_are_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        kind = type(value)
        if kind is float or kind is str or value is None or (kind is int and -INT64_MAX - 1 <= value <= INT64_MAX):
            return value  # nothing `_misplaced_number` objects to: only bools, big ints and containers need the walk
        field = cls.model_fields.get(info.field_name or "")
        if field is not None and (reason := _misplaced_number(field.annotation, value)):
            raise ValueError(reason)
        return value


class Artifact(Strict):
    """A top-level file on disk. Subclasses pin `schema_version` with a Literal."""

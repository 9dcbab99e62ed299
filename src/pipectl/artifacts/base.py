"""Common base classes for artifacts."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """A nested record: unknown fields are an error, never dropped silently."""

    model_config = ConfigDict(extra="forbid", use_enum_values=False, populate_by_name=True)


class Artifact(Strict):
    """A top-level file on disk. Subclasses pin `schema_version` with a Literal."""

"""Common base classes for artifacts."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

# A sha256 as hex, the form every hash in pipectl's files takes.
Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class Strict(BaseModel):
    """A nested record: unknown fields are an error, never dropped silently."""

    model_config = ConfigDict(extra="forbid", use_enum_values=False, populate_by_name=True)


class Artifact(Strict):
    """A top-level file on disk. Subclasses pin `schema_version` with a Literal."""

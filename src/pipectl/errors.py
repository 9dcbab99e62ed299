"""Typed errors. The CLI maps every `PipectlError` to one message and an exit code.

A `PipectlError` is something the user can cause and fix (a missing file, a bad value, an
impossible plan). Anything else that escapes is a bug and keeps its traceback.
"""

from __future__ import annotations


class PipectlError(Exception):
    """Base of every error the CLI reports without a traceback."""

    exit_code: int = 2

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


class UserInputError(PipectlError):
    """Bad input: a missing file, malformed YAML/JSON, an unknown name, an impossible value."""


class ArtifactError(UserInputError):
    """An artifact on disk (profile, cluster, plan, run manifest) does not parse or validate."""


class InfeasibleError(PipectlError):
    """No configuration satisfies the constraints (memory, divisibility of the global batch)."""


class ScheduleError(PipectlError):
    """A schedule is malformed: a micro-batch missing, a dependency violated, a deadlock."""


class CheckpointError(PipectlError):
    """A checkpoint is missing, incomplete or fails its checksum."""


class LaunchError(PipectlError):
    """A job could not be started or failed while running."""

    exit_code = 1

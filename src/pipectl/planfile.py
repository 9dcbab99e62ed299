"""plan.json and the profile it was made from, kept together on disk.

A plan names its profile by content: the copy `profile-<sha256[:12]>.json` lies in plan.json's own
folder and `plan.profile.sha256` holds the full hash. Writing a plan writes that copy (once per
content); reading the profile back checks the hash. So `simulate`, `launch` and `resize` work from
any directory, and a plan is never re-priced with a profile it was not made from.

    write_plan("out/plan.json", plan, profile_file="profile.json")   # out/profile-1a2b3c4d5e6f.json too
    profile = load_plan_profile("out/plan.json", load_model(Plan, "out/plan.json"))
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from pipectl.artifacts.plan import Plan, ProfileRef
from pipectl.artifacts.profile import ModelProfile
from pipectl.errors import ArtifactError, UserInputError
from pipectl.io import check_output_file, load_model, sha256_file, temporary_file, write_json_atomic


def profile_copy_name(sha256: str) -> str:
    return f"profile-{sha256[:12]}.json"


def _copy_once(source: Path, target: Path, sha256: str) -> None:
    """Copy `source` to `target` unless `target` already holds the same bytes (atomic rename)."""
    if target.is_file() and sha256_file(target) == sha256:
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = temporary_file(target.parent, target.name)
    os.close(fd)
    try:
        shutil.copyfile(source, tmp)
        if sha256_file(tmp) != sha256:
            raise ArtifactError(f"{source} changed while it was copied to {target}")
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_plan(path: str | os.PathLike[str], plan: Plan, *, profile_file: str | os.PathLike[str]) -> Plan:
    """Write plan.json with the profile read from `profile_file` copied beside it; returns the
    plan as written (with its `profile` reference)."""
    path = check_output_file(path)  # before the profile copy is written beside it
    source = Path(profile_file)
    sha256 = sha256_file(source)
    ref = ProfileRef(file=profile_copy_name(sha256), sha256=sha256, source=str(source))
    _copy_once(source, path.parent / ref.file, sha256)
    written = plan.model_copy(update={"profile": ref})
    write_json_atomic(path, written)
    return written


def copy_plan(plan: Plan, from_dir: str | os.PathLike[str], to_path: str | os.PathLike[str]) -> Path:
    """Write `plan` to `to_path` with its profile copy, taken from `from_dir` (verified first)."""
    to_path = Path(to_path)
    if plan.profile is not None:
        source = plan_profile_path(from_dir, plan)
        _copy_once(source, to_path.parent / plan.profile.file, plan.profile.sha256)
    return write_json_atomic(to_path, plan)


def plan_profile_path(plan_dir: str | os.PathLike[str], plan: Plan) -> Path:
    """The plan's profile copy in `plan_dir`, after checking its sha256; errors name the file."""
    if plan.profile is None:
        raise UserInputError(
            "the plan records no profile",
            hint="make it with pipectl plan --profile ..., which keeps a copy next to plan.json",
        )
    path = Path(plan_dir) / plan.profile.file
    if not path.is_file():
        raise UserInputError(
            f"the plan's profile {path} is missing (it was made from {plan.profile.source or 'an unnamed file'})",
            hint="keep the profile-<hash>.json file next to plan.json, or re-plan",
        )
    found = sha256_file(path)
    if found != plan.profile.sha256:
        raise ArtifactError(
            f"{path} has sha256 {found[:12]}…, the plan was made from {plan.profile.sha256[:12]}…",
            hint="the profile changed after planning: re-plan from it",
        )
    return path


def load_plan_profile(plan_path: str | os.PathLike[str], plan: Plan) -> ModelProfile:
    """The profile `plan` (read from `plan_path`) was made from, verified by its sha256."""
    return load_model(ModelProfile, plan_profile_path(Path(plan_path).parent, plan))

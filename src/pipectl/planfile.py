"""plan.json and the profile it was made from, kept together on disk.

A plan names its profile by content: the copy `profile-<sha256[:12]>.json` lies in plan.json's own
folder and `plan.profile.sha256` holds the full hash. Writing a plan writes that copy (once per
content); reading the profile back checks the hash. So `simulate`, `launch` and `resize` work from
any directory, and a plan is never re-priced with a profile it was not made from.

    write_plan("out/plan.json", plan, profile_file="profile.json")   # out/profile-1a2b3c4d5e6f.json too
    profile = load_plan_profile("out/plan.json", load_model(Plan, "out/plan.json"))

A plan for a cluster of several device kinds may hold one profile per kind: the first is
`plan.profile`, the others `plan.kind_profiles` (`load_kind_profiles`), kept the same way.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from pipectl.artifacts.plan import Candidate, ModelShape, Plan, ProfileRef
from pipectl.artifacts.profile import ModelProfile
from pipectl.errors import ArtifactError, UserInputError
from pipectl.io import check_output_file, load_model, sha256_file, temporary_file, write_json_atomic
from pipectl.words import count


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


def write_plan(
    path: str | os.PathLike[str],
    plan: Plan,
    *,
    profile_file: str | os.PathLike[str],
    kind_profile_files: Sequence[str | os.PathLike[str]] = (),
) -> Plan:
    """Write plan.json with the profile read from `profile_file` (and those of the cluster's other
    device kinds) copied beside it; returns the plan as written (with its references)."""
    path = check_output_file(path)  # before the profile copies are written beside it
    sources = [Path(source) for source in [profile_file, *kind_profile_files]]
    check_plan_output(path, sources)
    try:
        refs = [_copied(source, path.parent) for source in sources]
        written = plan.model_copy(update={"profile": refs[0], "kind_profiles": refs[1:]})
        write_json_atomic(path, written)
    except OSError as exc:
        if exc.filename is None:
            raise
        beside = "" if Path(exc.filename) == path else f" (writing {exc.filename} beside it)"
        raise UserInputError(f"cannot write the plan {path}: {exc.strerror}{beside}") from None
    return written


def check_plan_output(path: Path, profile_files: Sequence[Path]) -> None:
    """plan.json is not to be written under the name of a profile copy it keeps beside itself: the
    copy would be written, then the plan over it, and both lost."""
    if path.name in {profile_copy_name(sha256_file(source)) for source in profile_files}:
        raise UserInputError(f"-o {path} is the name of the profile copy the plan keeps beside itself",
                             hint="name the plan otherwise, e.g. -o plan.json")


def _copied(source: Path, folder: Path) -> ProfileRef:
    sha256 = sha256_file(source)
    # Absolute, as every path a user gives is stored (a flag's was kept relative, a config file's not).
    ref = ProfileRef(file=profile_copy_name(sha256), sha256=sha256, source=str(source.resolve()))
    _copy_once(source, folder / ref.file, sha256)
    return ref


def copy_plan(plan: Plan, from_dir: str | os.PathLike[str], to_path: str | os.PathLike[str]) -> Path:
    """Write `plan` to `to_path` with its profile copies, taken from `from_dir` (verified first)."""
    to_path = Path(to_path)
    for ref in _refs(plan):
        _copy_once(_verified(from_dir, ref), to_path.parent / ref.file, ref.sha256)
    return write_json_atomic(to_path, plan)


def _refs(plan: Plan) -> list[ProfileRef]:
    return ([plan.profile] if plan.profile is not None else []) + list(plan.kind_profiles)


def plan_profile_path(plan_dir: str | os.PathLike[str], plan: Plan) -> Path:
    """The plan's profile copy in `plan_dir`, after checking its sha256; errors name the file."""
    if plan.profile is None:
        raise UserInputError(
            "the plan records no profile",
            hint="make it with pipectl plan --profile ..., which keeps a copy next to plan.json",
        )
    return _verified(plan_dir, plan.profile)


def _verified(plan_dir: str | os.PathLike[str], ref: ProfileRef) -> Path:
    """The profile copy beside the plan, checked by its sha256; where the copy is not there (a plan
    copied alone), the file the plan was made from, if it still holds the same bytes."""
    path = Path(plan_dir) / ref.file
    if not path.is_file():
        if ref.source and Path(ref.source).is_file() and sha256_file(ref.source) == ref.sha256:
            return Path(ref.source)
        raise UserInputError(
            f"the plan's profile {path} is missing (it was made from {ref.source or 'an unnamed file'})",
            hint="keep the profile-<hash>.json file next to plan.json, or re-plan",
        )
    found = sha256_file(path)
    if found != ref.sha256:
        raise ArtifactError(
            f"{path} has sha256 {found[:12]}…, the plan was made from {ref.sha256[:12]}…",
            hint="the profile changed after planning: re-plan from it",
        )
    return path


def load_plan_profile(plan_path: str | os.PathLike[str], plan: Plan) -> ModelProfile:
    """The profile `plan` (read from `plan_path`) was made from, verified by its sha256."""
    return load_model(ModelProfile, plan_profile_path(Path(plan_path).parent, plan))


def load_kind_profiles(plan_path: str | os.PathLike[str], plan: Plan) -> list[ModelProfile]:
    """The profiles of the plan's other device kinds (`Plan.kind_profiles`), each verified."""
    return [load_model(ModelProfile, _verified(Path(plan_path).parent, ref)) for ref in plan.kind_profiles]


def check_kind_profiles(profiles: Sequence[tuple[str, ModelProfile]]) -> None:
    """Profiles given together (`plan --profile A --profile B`) describe one model in one precision,
    each on another device: the same layers and parameters, the same dtype. `profiles` pairs each
    with the name it was given by; the first different one is named."""
    (first_name, first), *others = profiles
    seen = {first.device: first_name}
    shape = ModelShape.of_profile(first)
    for name, profile in others:
        if profile.device in seen:
            raise UserInputError(
                f"{name} and {seen[profile.device]} are both profiles on {profile.device}",
                hint="give one profile per device kind",
            )
        seen[profile.device] = name
        if ModelShape.of_profile(profile) != shape:
            raise UserInputError(
                f"{name} is a profile of another model than {first_name} ({profile.model}, "
                f"{len(profile.layers)} layers; {first.model}, {len(first.layers)} layers)",
                hint="profile the same model on each device kind",
            )
        if profile.dtype != first.dtype:
            raise UserInputError(
                f"{name} was made in {profile.dtype} and {first_name} in {first.dtype}: one job trains in one precision",
                hint="profile every kind in the same dtype (pipectl profile --dtype)",
            )


def morph_layout(plan: Plan, devices: int) -> Candidate:
    """The morph table's layout for `devices`; a count it lacks, or one where nothing fits, is refused."""
    entry = plan.for_devices(devices)
    if entry is None:
        counts = [e.devices for e in plan.morph_table]
        raise UserInputError(
            f"the plan's morph table has no entry for {count(devices, 'device')}",
            hint=f"it covers {count_ranges(counts)}" if counts else "the plan has no morph table (re-plan without --no-morph)",
        )
    if entry.candidate is None:
        raise UserInputError(f"nothing fits on {count(devices, 'device')}: {entry.note or 'no feasible candidate'}")
    return entry.candidate


def count_ranges(counts: Sequence[int]) -> str:
    """Counts as ranges, a step named where it is not 1: a morph table's whole nodes read as one
    range, not 377 numbers.

    >>> count_ranges([16, 1, 2, 3, 8])
    '1-3, 8, 16'
    >>> count_ranges([*range(1, 9), *range(16, 3073, 8)])
    '1-8, 16-3072 every 8'
    """
    ordered = sorted(set(counts))
    out: list[str] = []
    i = 0
    while i < len(ordered):
        step = ordered[i + 1] - ordered[i] if i + 1 < len(ordered) else 1
        end = i
        while end + 1 < len(ordered) and ordered[end + 1] - ordered[end] == step:
            end += 1
        if end == i or (step != 1 and end - i < 2):  # one count, or two a step apart: themselves
            out.append(str(ordered[i]))
            i += 1
            continue
        out.append(f"{ordered[i]}-{ordered[end]}" + (f" every {step}" if step != 1 else ""))
        i = end + 1
    return ", ".join(out)

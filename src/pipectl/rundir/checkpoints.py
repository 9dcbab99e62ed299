"""Atomic, checksummed checkpoints that any later layout can load: weights AND optimizer state.

A checkpoint is one safetensors file per rank, each holding what that rank held (its fp32 master
partition, its optimizer state, an index of which parameter pieces they are:
`runtime.checkpoint.shards`), written in the background while training goes on
(`runtime.checkpoint.checkpointer`), and committed by rank 0 when every rank has reported its file
and hash. A load re-cuts as it reads: each rank assembles the parameters of its own stage and
tensor slice from whatever layout wrote them (`engine_state.restore`). This module is the store on disk, torch-free:
where checkpoints lie, what makes one committed, verification and pruning; the load, which every
rank does together, is `runtime.checkpoint.ranks`.

Layout of RUN/checkpoints/:

    .staging/WRITER/TAG/          the rank files of a save in flight (WRITER = w<rank 0's pid>-
                                  <random>: unique per job, so no two writers share a name;
                                  removed by the next job when its writer is dead)
    .staging/WRITER/TAG.reports/  one JSON per rank: its file's sha256 and size, or its error
    TAG/                          rank-NNNNN.safetensors ... + manifest.json (written last, in
                                  staging; then the folder is renamed into place)
    latest                        the newest committed tag (written after its manifest)

A load picks the newest tag whose manifest verifies and whose every file opens as a rank file; a
corrupted, truncated or foreign file is reported by name and the previous checkpoint is used (rank
0 decides, every rank loads the same tag):

    >>> loaded = ranks.load_latest(engine, run_dir)                                             # doctest: +SKIP
    >>> loaded.step, loaded.data_position, loaded.warnings                                # doctest: +SKIP
    (10, {'step': 10, 'samples': 80}, [])

Nothing in a checkpoint is executable: safetensors files are raw tensor bytes and a JSON header,
and only files whose sha256 matches what this run recorded are read.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from pipectl.artifacts.run import CHECKPOINTS_DIR, LOGS_DIR, MANIFEST_FILE, CheckpointEvent, CheckpointManifest, rank_file_name
from pipectl.errors import CheckpointError
from pipectl.io import load_model, sha256_file, write_json_atomic, write_text_atomic
from pipectl.rundir.heartbeats import pid_alive

# Torch-free: `pipectl status` and `resize` list and verify checkpoints without it (what needs
# torch, the load, is `runtime.checkpoint.ranks`).

log = logging.getLogger(__name__)

STAGING_DIR = ".staging"
LATEST_FILE = "latest"
STOP_FILE = "stop_requested"  # RUN/stop_requested: stop at the next step boundary (resize)
RESIZE_STOP = "pipectl resize asked it to stop"  # why the ranks stopped, when the stop file said so
SHARDS_FORMAT = "pipectl-shards"
EVENTS_FILE = "checkpoints.jsonl"  # in RUN/logs: one CheckpointEvent per save (rank 0)
DEFAULT_KEEP = 3
# In a tag a resume passed over (it did not verify or load): why. Such a tag is never loaded and
# not one of the `--keep-checkpoints` kept; it is removed once a newer checkpoint verifies.
REJECTED_FILE = "rejected"


def tag_for_step(step: int) -> str:
    """`step00000010` for step 10: tags sort by name in step order."""
    return f"step{step:08d}"


def checkpoints_dir(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR


# --------------------------------------------------------------------------- verification (pure)


def hash_tree(root: Path) -> dict[str, str]:
    """sha256 of every file under `root` (except a manifest), keyed by relative POSIX path."""
    return {
        path.relative_to(root).as_posix(): sha256_file(path)
        for path in sorted(root.rglob("*"))
        if path.is_file() and path.name != MANIFEST_FILE
    }


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint directory and what verification found (`problems` empty = usable)."""

    tag: str
    path: Path
    step: int | None
    manifest: CheckpointManifest | None
    problems: tuple[str, ...] = ()

    @property
    def verified(self) -> bool:
        return not self.problems and self.manifest is not None


def verify_checkpoint(tag_dir: str | os.PathLike[str], *, hash_files: bool = True) -> CheckpointInfo:
    """Check a tag directory against its manifest: the manifest names this folder, every file it
    lists lies inside it (no links), is present and has its sha256, and no other file is there.
    What is verified is what `load_latest` loads: the folder, by its name.

    With `hash_files=False` only presence and sizes are checked (fast; for listings).
    """
    tag_dir = Path(tag_dir)
    manifest_path = tag_dir / MANIFEST_FILE
    if not manifest_path.is_file():
        return CheckpointInfo(tag_dir.name, tag_dir, None, None, (f"{manifest_path}: no manifest (incomplete save)",))
    try:
        manifest = load_model(CheckpointManifest, manifest_path)
    except Exception as exc:  # a torn or edited manifest is a corrupted checkpoint, not a crash
        return CheckpointInfo(tag_dir.name, tag_dir, None, None, (f"{manifest_path}: unreadable manifest ({exc})",))
    problems: list[str] = []
    rejected = tag_dir / REJECTED_FILE
    if rejected.is_file():
        problems.append(f"{tag_dir}: a resume passed it over: {rejected.read_text().strip()}")
    if tag_dir.is_symlink():
        problems.append(f"{tag_dir}: a link (a checkpoint holds its own files)")
    if manifest.tag != tag_dir.name:
        # A copied folder (a backup) or an edited manifest: the load reads the folder by its tag,
        # so the two must name the same checkpoint.
        problems.append(f"{manifest_path}: names tag {manifest.tag!r}, but lies in folder {tag_dir.name!r}")
    for relative, expected in manifest.files.items():
        path = tag_dir / relative
        if path.resolve() != tag_dir.resolve() / relative:  # the file or a folder on its way is a link
            problems.append(f"{path}: a link (a checkpoint holds its own files)")
        elif not path.is_file():
            problems.append(f"{path}: missing")
        elif relative in manifest.file_bytes and path.stat().st_size != manifest.file_bytes[relative]:
            size = path.stat().st_size
            problems.append(f"{path}: {size:,} bytes, the manifest records {manifest.file_bytes[relative]:,} "
                            f"({'truncated' if size < manifest.file_bytes[relative] else 'grown'})")
        elif hash_files and sha256_file(path) != expected:
            problems.append(f"{path}: sha256 mismatch, the file corrupted or modified")
    if manifest.format == SHARDS_FORMAT and manifest.layout is not None:
        # Every rank of the layout it records wrote a file: one missing with its entry leaves a
        # checkpoint that hashes clean and cannot be loaded.
        world = manifest.layout.world_size
        listed = {Path(relative).name for relative in manifest.files}
        missing = [rank for rank in range(world) if rank_file_name(rank) not in listed]
        if missing:
            problems.append(
                f"{manifest_path}: lists no file of rank {', '.join(map(str, missing[:8]))}"
                f"{' ...' if len(missing) > 8 else ''} of the {world}-rank layout it records"
            )
    on_disk = {p.relative_to(tag_dir).as_posix() for p in tag_dir.rglob("*") if p.is_file() or p.is_symlink()}
    for extra in sorted(on_disk - set(manifest.files) - {MANIFEST_FILE, REJECTED_FILE}):
        problems.append(f"{tag_dir / extra}: not in the manifest")
    return CheckpointInfo(tag_dir.name, tag_dir, manifest.step, manifest, tuple(problems))


def list_checkpoints(run_dir: str | os.PathLike[str], *, hash_files: bool = False) -> list[CheckpointInfo]:
    """Every tag directory under RUN/checkpoints, oldest first (staging excluded)."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    tags = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    return [verify_checkpoint(tag, hash_files=hash_files) for tag in tags]


def skipped_message(info: CheckpointInfo, problems: Iterable[str]) -> str:
    """'checkpoint step 8 could not be loaded (FILE: why; ...)' (the tag when the step is unknown)."""
    name = f"step {info.step}" if info.step is not None else info.tag
    return f"checkpoint {name} could not be loaded ({'; '.join(problems)})"


def find_latest_verified(
    run_dir: str | os.PathLike[str],
    *,
    load_check: Callable[[CheckpointInfo], str | None] | None = None,
    skip: Iterable[str] = (),
    skipped: dict[str, str] | None = None,
) -> tuple[CheckpointInfo | None, list[str]]:
    """The newest checkpoint whose every file matches its manifest, and a message for each newer
    one skipped (`skipped_message`; by tag into `skipped` too, for those with a manifest). With
    `load_check` (the ranks pass `runtime.checkpoint.ranks.unloadable_problem`, which needs torch),
    every file must also load as data. The tags in `skip` (did not load) are passed over.

    >>> find_latest_verified("/nonexistent/run")
    (None, [])
    """
    warnings: list[str] = []
    passed = set(skip)
    for info in reversed(list_checkpoints(run_dir, hash_files=False)):
        if info.tag in passed:
            continue
        checked = verify_checkpoint(info.path, hash_files=True)
        problems = list(checked.problems)
        if not problems and checked.manifest is None:
            problems.append(f"{checked.path}: no manifest")
        if not problems and load_check is not None:
            unloadable = load_check(checked)
            problems += [unloadable] if unloadable else []
        if not problems:
            return checked, warnings
        warnings.append(skipped_message(checked, problems))
        if skipped is not None and checked.manifest is not None:
            skipped[checked.tag] = warnings[-1]
    return None, warnings


def mark_rejected(run_dir: str | os.PathLike[str], passed_over: dict[str, str]) -> None:
    """Record in each tag a resume passed over why (`REJECTED_FILE`): listed and verified as such
    from then on, so that it takes none of the kept places and a later prune removes it, instead
    of a good older checkpoint."""
    for tag, message in passed_over.items():
        path = checkpoints_dir(run_dir) / tag
        if path.is_dir() and not path.is_symlink() and not (path / REJECTED_FILE).exists():
            write_text_atomic(path / REJECTED_FILE, message + "\n", create_parent=False)  # a tag removed meanwhile stays gone


def has_checkpoint(run_dir: str | os.PathLike[str]) -> bool:
    """Whether the run committed a checkpoint (verified or not): something `--resume` starts from,
    or refuses with the checkpoints' problems (`resume_point`), rather than a run that never got
    that far and can only start over."""
    return any((c.path / MANIFEST_FILE).is_file() for c in list_checkpoints(run_dir))


def resume_point(
    run_dir: str | os.PathLike[str],
    *,
    load_check: Callable[[CheckpointInfo], str | None] | None = None,
    skip: Iterable[str] = (),
    skipped: dict[str, str] | None = None,
) -> tuple[CheckpointInfo | None, list[str]]:
    """The verified checkpoint a resume starts from (None when the run has none at all), and
    messages for the newer ones skipped (`find_latest_verified`).

    A folder without a manifest is a save that never committed and does not count. When the run
    has committed checkpoints and none of them verifies, starting from step 0 would repeat the
    steps they hold: that is refused, with every checkpoint's problems, never done silently.
    """
    info, warnings = find_latest_verified(run_dir, load_check=load_check, skip=skip, skipped=skipped)
    if info is None and has_checkpoint(run_dir) and not skip:
        raise CheckpointError(
            f"no checkpoint of {Path(run_dir)} can be loaded: " + "; ".join(warnings),
            hint="restore a good checkpoint, or start over deliberately with pipectl launch --force",
        )
    return info, warnings


# --------------------------------------------------------------------------- save


def commit_tag(root: Path, staged: Path, tag: str, manifest: CheckpointManifest) -> Path:
    """Write the manifest into the staged folder (its last file), rename the folder into place, then
    move the pointer. A folder in place is therefore always whole; a writer killed before the rename
    leaves a staged folder that `recover_staged` commits. A step already committed with the same
    files (hashes) is kept as it is and the staged copy dropped."""
    final = root / tag
    if final.is_dir() and not final.is_symlink():
        committed = verify_checkpoint(final)
        if committed.verified and committed.manifest.files == manifest.files:
            # The same files are committed already (a stop right after a checkpoint saves the step
            # again): keep them. Replacing them would leave no complete copy of this step between
            # moving the old one aside and writing the new one's manifest.
            shutil.rmtree(staged, ignore_errors=True)
            write_text_atomic(root / LATEST_FILE, tag)
            return final
    # A writer killed while writing this manifest left its temporary file here (`io.temporary_file`);
    # committed, the folder would hold a file its manifest does not list and never load.
    for leftover in staged.glob(f".{MANIFEST_FILE}.*.tmp"):
        leftover.unlink(missing_ok=True)
    write_json_atomic(staged / MANIFEST_FILE, manifest)
    if final.exists():  # re-saving a step (e.g. after a resume): move the old one aside first
        retired = staged.with_name(f"{tag}_retired")  # beside the staged copy: this writer's own
        shutil.rmtree(retired, ignore_errors=True)
        os.replace(final, retired)
        shutil.rmtree(retired, ignore_errors=True)
    os.replace(staged, final)
    write_text_atomic(root / LATEST_FILE, tag)
    return final


def staging_leftovers(run_dir: str | os.PathLike[str]) -> list[Path]:
    """What lies in RUN/checkpoints/.staging: saves in progress, or left by saves that died."""
    staging = checkpoints_dir(run_dir) / STAGING_DIR
    return sorted(staging.iterdir()) if staging.is_dir() else []


def _writer_is_dead(entry: Path) -> bool:
    """A staging folder whose writer (w<rank 0's pid>-...) is no longer a live process on this host,
    or one of the older fixed-name layout (a run is written by one job at a time)."""
    match = re.fullmatch(r"w(\d+)-[0-9a-f]+", entry.name)
    # alive (its save may be running) or not ours to signal: alive
    return not match or not pid_alive(int(match.group(1)))


def remove_dead_writers(staging: Path) -> None:
    """Remove the staging folders of dead writers (commit what they left whole first: `recover_staged`)."""
    for entry in staging.iterdir() if staging.is_dir() else []:
        if not _writer_is_dead(entry):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


REPORTS_SUFFIX = ".reports"


def reports_dir(staged: Path) -> Path:
    """`.staging/WRITER/TAG.reports/`: one `rank-NNNNN.json` per rank that finished its file."""
    return staged.with_name(staged.name + REPORTS_SUFFIX)


def report_path(staged: Path, rank: int) -> Path:
    """Where rank `rank` reports its file of the save staged at `staged`."""
    return reports_dir(staged) / f"rank-{rank:05d}.json"


def read_reports(staged: Path) -> dict[int, dict[str, Any]]:
    """The reports the ranks wrote for the save staged at `staged`, by rank (unreadable ones skipped)."""
    found = {}
    for path in sorted(reports_dir(staged).glob("rank-*.json")):
        try:
            report = json.loads(path.read_text())
            found[int(report["rank"])] = report
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return found


def manifest_from_reports(tag: str, reports: dict[int, dict[str, Any]], **fields: Any) -> CheckpointManifest:
    """The manifest of a save every rank reported: its files' hashes and sizes, rank 0's layout,
    step and data position (`fields` adds timings)."""
    first = reports[0]
    sizes = {report["file"]: int(report["bytes"]) for report in reports.values()}
    return CheckpointManifest(
        tag=tag,
        step=int(first["step"]),
        layout=first.get("layout"),
        data_position=first.get("data_position", {}),
        files={report["file"]: report["sha256"] for report in reports.values()},
        file_bytes=sizes,
        bytes=sum(sizes.values()),
        stall_seconds=float(first.get("stall_seconds", 0.0)),
        **fields,
    )


def complete_reports(staged: Path) -> dict[int, dict[str, Any]] | None:
    """Every rank's report of the save at `staged` when each says its file was written, and each
    file is there at its reported size and hash; None otherwise."""
    reports = read_reports(staged)
    world = {int(r.get("world_size", -1)) for r in reports.values()}
    if len(world) != 1 or set(reports) != set(range(world.pop())):
        return None
    for report in reports.values():
        if "error" in report or "file" not in report:
            return None
        path = staged / report["file"]
        if not path.is_file() or path.stat().st_size != int(report["bytes"]) or sha256_file(path) != report["sha256"]:
            return None
    return reports


def recover_staged(run_dir: str | os.PathLike[str]) -> list[Path]:
    """Commit the saves that dead writers left with every rank's file written and reported.

    Rank 0 commits a checkpoint once every rank has reported its file; a job that died in between
    (rank 0 killed, or the job ended by another rank's failure while the commit waited) leaves the
    checkpoint whole on disk but uncommitted. Its files carry their hashes in the reports, so the
    next job commits it exactly as rank 0 would have. Call with the run locked (launch, or rank 0
    of a starting job). Returns the tags committed.
    """
    root = checkpoints_dir(run_dir)
    staging = root / STAGING_DIR
    committed = []
    for writer in sorted(staging.iterdir()) if staging.is_dir() else []:
        if not writer.is_dir() or writer.is_symlink() or not _writer_is_dead(writer):
            continue
        for staged in sorted(p for p in writer.iterdir() if p.is_dir() and not p.name.endswith(REPORTS_SUFFIX)):
            reports = complete_reports(staged)
            if reports is None or verify_checkpoint(root / staged.name, hash_files=False).verified:
                continue
            try:
                manifest = manifest_from_reports(staged.name, reports, time_unix=time.time())
            except ValueError:  # a report that does not make a manifest: not ours to commit
                continue
            shutil.rmtree(reports_dir(staged), ignore_errors=True)
            committed.append(commit_tag(root, staged, staged.name, manifest))
            log.warning(f"committed checkpoint step {manifest.step}, which a job that ended had written but not committed")
    return committed


def prune_checkpoints(run_dir: str | os.PathLike[str], keep: int) -> list[Path]:
    """Remove all but the newest `keep` verified tags, incomplete tags older than the newest one,
    and tags a resume passed over (`REJECTED_FILE`) once a checkpoint committed after that resume
    verifies, whatever its step (a resume that fell back past step 60 commits step 24 next)."""
    infos = list_checkpoints(run_dir, hash_files=False)
    good = [i for i in infos if i.verified]
    keep_paths = {i.path for i in good[-keep:]} if keep > 0 else set()
    last_commit = max((_mtime(i.path / MANIFEST_FILE) for i in good), default=0.0)
    removed = []
    for info in infos:
        stale = not info.verified and bool(good) and (
            info.path.name < good[-1].tag or 0.0 < _mtime(info.path / REJECTED_FILE) < last_commit
        )
        if (info.verified and info.path not in keep_paths) or stale:
            shutil.rmtree(info.path, ignore_errors=True)
            removed.append(info.path)
    return removed


def _mtime(path: Path) -> float:
    """When `path` was last written (0.0: it is not there)."""
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def record_event(run_dir: str | os.PathLike[str], event: CheckpointEvent) -> None:
    """Append one line to RUN/logs/checkpoints.jsonl."""
    path = Path(run_dir) / LOGS_DIR / EVENTS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        handle.write(event.model_dump_json() + "\n")


def read_events(run_dir: str | os.PathLike[str]) -> list[CheckpointEvent]:
    """Every recorded checkpoint outcome, oldest first (a torn last line is skipped)."""
    path = Path(run_dir) / LOGS_DIR / EVENTS_FILE
    events = []
    for line in path.read_text(errors="replace").splitlines() if path.is_file() else []:
        try:
            events.append(CheckpointEvent.model_validate_json(line))
        except ValueError:
            continue
    return events

"""The files a live resize and the ranks exchange in the run directory: the request (RUN/resize_requested.json,
one generation per resize), each joining rank's ready file (RUN/live/ready-rank{R}), and the new
layout's run files staged in RUN/live/next/ until the first step on it commits them.

Torch-free: `pipectl resize` writes and reads these; the hand-over itself is
`runtime.elastic.live_resize`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from pipectl.artifacts.morph import LIVE_REQUEST_FILE, LiveResizeRequest
from pipectl.artifacts.run import JOB_FILE
from pipectl.io import load_model

if TYPE_CHECKING:  # torch: only in the ranks (the CLI's resize reads this module's file names)
    pass

log = logging.getLogger(__name__)

JOIN_DIR = "live"  # RUN/live/ready-rank{R}: joining rank R has started and waits for the hand-over
# RUN/live/next/: the new layout's run files (job.json, plan.json, ds_config.json, launch.sh), read
# by the ranks for the hand-over and moved into the run by rank 0 after the first step on it, so a
# resize that ends before then (killed, refused, timed out) leaves the run's files as they were.
STAGED_DIR = f"{JOIN_DIR}/next"
RESIZE_PID_VARIABLE = "PIPECTL_RESIZE_PID"  # a joining rank's resize: it gives up when that ends unasked


def request_path(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / LIVE_REQUEST_FILE


def ready_path(run_dir: str | os.PathLike[str], rank: int) -> Path:
    return Path(run_dir) / JOIN_DIR / f"ready-rank{rank}"


def pending_generation(run_dir: str | os.PathLike[str] | None, generation: int) -> int:
    """The generation of a live resize waiting for this job (one newer than `generation`), else 0.
    Every rank calls it at every step boundary: one `stat` when there is none."""
    if run_dir is None:
        return 0
    path = request_path(run_dir)
    if not path.is_file():
        return 0
    try:
        request = load_model(LiveResizeRequest, path)
    except Exception as exc:  # a damaged request is not taken; the job goes on
        log.warning("%s: not taken (%s)", path, exc)
        return 0
    # A recovery's request is taken only by ranks that lost a peer (`recovery.await_request`).
    return request.generation if request.generation > generation and not request.recovery else 0


def read_request(run_dir: str | os.PathLike[str]) -> LiveResizeRequest:
    return load_model(LiveResizeRequest, request_path(run_dir))


def files_of(run_dir: str | os.PathLike[str], request: LiveResizeRequest | None) -> Path:
    """Where the run files of `request`'s layout are: its staged folder, else the run itself."""
    return Path(run_dir) / request.staged if request is not None and request.staged else Path(run_dir)


def install_staged(run_dir: str | os.PathLike[str], request: LiveResizeRequest) -> None:
    """Rank 0, after the first step on the new layout: the staged run files replace the run's, each
    by an atomic rename, job.json last (it names the others)."""
    if not request.staged:
        return
    staged = Path(run_dir) / request.staged
    names = sorted((entry.name for entry in staged.iterdir() if entry.is_file()), key=lambda name: name == JOB_FILE)
    for name in names:
        os.replace(staged / name, Path(run_dir) / name)
    try:
        staged.rmdir()
    except OSError:
        pass

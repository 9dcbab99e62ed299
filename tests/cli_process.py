"""The `pipectl` command run as a user's shell runs it: a subprocess in a working directory of the
test's, on a pipe of a given width, one thread a rank, without a model path of the caller's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

_SCRIPT = Path(sys.executable).with_name("pipectl")
PIPECTL = [str(_SCRIPT)] if _SCRIPT.is_file() else [sys.executable, "-m", "pipectl"]


def pipectl(*args: object, cwd: Path, timeout: float = 300, columns: int = 100) -> subprocess.CompletedProcess:
    """`pipectl ARGS` in `cwd`, its output captured."""
    env = {**os.environ, "COLUMNS": str(columns), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    env.pop("PIPECTL_MODEL_PATH", None)
    return subprocess.run(
        [*PIPECTL, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env
    )


def succeeded(done: subprocess.CompletedProcess) -> bool:
    return done.returncode == 0


def said(done: subprocess.CompletedProcess) -> str:
    return f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"

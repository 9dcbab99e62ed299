"""Make tests/builders.py importable (`from builders import ...`) under --import-mode=importlib, and
run DeepSpeed on its CPU accelerator, as on the machine the suite is written for, also on a host with
a GPU (where DeepSpeed would pick CUDA for ranks the tests start as CPU ranks); tests of the CUDA
paths name their device themselves.

The suite runs in two pytest-xdist workers (`scripts/test.sh`), a test file per worker. A worker
sets COLUMNS=80 and LINES=24 for itself, while pipectl reads COLUMNS as the width a user asked for;
they are dropped here, before any console exists, so a worker sees what one pytest process sees."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
if "PYTEST_XDIST_WORKER" in os.environ:
    for name in ("COLUMNS", "LINES"):
        os.environ.pop(name, None)

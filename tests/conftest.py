"""Make tests/builders.py importable (`from builders import ...`) under --import-mode=importlib, and
pin every test to the CPU, as on the machine the suite is written for, also on a host with a GPU:
DeepSpeed runs on its CPU accelerator (it would pick CUDA for ranks the tests start as CPU ranks),
and no GPU is visible (CUDA_VISIBLE_DEVICES empty, inherited by every rank and child), so nothing
initialises CUDA in a process that later forks: a forked child cannot use CUDA its parent started,
which broke the engine calibration's children on an H100 host. Tests of the CUDA paths are marked
`gpu` and run only with PIPECTL_TEST_GPU=1 on a host with CUDA (`scripts/gpu-check.sh --tests`).

The suite runs in two pytest-xdist workers (`scripts/test.sh`), a test file per worker. A worker
sets COLUMNS=80 and LINES=24 for itself, while pipectl reads COLUMNS as the width a user asked for;
they are dropped here, before any console exists, so a worker sees what one pytest process sees.

A suite started in the background (`... &` from a script, or under nohup) inherits SIGINT, and
under nohup SIGHUP, ignored, and every pipectl a test starts would inherit that too (an ignored
signal stays ignored across exec): the tests of Ctrl-C and of a closed terminal need the defaults a
terminal gives, so they are restored here, in every worker, before any child starts."""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
GPU_RUN = os.environ.get("PIPECTL_TEST_GPU") == "1"
if not GPU_RUN:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
if "PYTEST_XDIST_WORKER" in os.environ:
    for name in ("COLUMNS", "LINES"):
        os.environ.pop(name, None)
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def pytest_collection_modifyitems(config, items):
    """`gpu` tests run only in a GPU run (PIPECTL_TEST_GPU=1) on a host whose CUDA torch sees."""
    import pytest

    if GPU_RUN:
        import torch

        if torch.cuda.is_available():
            return
        reason = "PIPECTL_TEST_GPU=1 but torch sees no CUDA device"
    else:
        reason = "a CUDA test: run with PIPECTL_TEST_GPU=1 on a GPU host (scripts/gpu-check.sh --tests)"
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))

"""Make tests/builders.py importable (`from builders import ...`) under --import-mode=importlib, and
run DeepSpeed on its CPU accelerator, as on the machine the suite is written for, also on a host with
a GPU (where DeepSpeed would pick CUDA for ranks the tests start as CPU ranks); tests of the CUDA
paths name their device themselves."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

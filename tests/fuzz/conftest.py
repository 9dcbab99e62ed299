"""Make tests/fuzz/mutations.py importable (`from mutations import ...`) under --import-mode=importlib."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

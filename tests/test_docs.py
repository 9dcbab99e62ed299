"""The documents a reader meets first stay short, true to the tree, and self-contained."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tracked_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / name for name in listed.splitlines() if (ROOT / name).is_file()]


def test_the_readme_is_short_and_its_links_lead_somewhere():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    for target in re.findall(r"\]\(([^)#]+)\)", text):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), target


def test_nothing_cites_a_document_outside_the_repository():
    """The formulas the code relies on are stated in docs/design.md, with their papers."""
    pattern = re.compile("SPEC" + r"( §|'s)")  # spelt apart, so that this file does not match itself
    citing = [str(path.relative_to(ROOT)) for path in tracked_files() if path.suffix in (".py", ".md", ".sh", ".yaml")
              and pattern.search(path.read_text(errors="replace"))]  # fmt: skip
    assert citing == []

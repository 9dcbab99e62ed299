"""Write `src/pipectl/emit/vendored.py`: the names other frameworks parse, read from pinned sources.

    python scripts/vendor_framework_names.py --megatron MEGATRON_GIT_DIR --torchtitan TORCHTITAN_GIT_DIR

Each directory is a git clone (or bare mirror) holding the pinned tags below. `pipectl.emit` writes
only names these lists hold (tests/emit check every emitted one), so a framework release that renames
an argument is caught by regenerating the lists at the new pin, not by a user's failed launch.
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
from pathlib import Path

MEGATRON_PIN = "core_v0.15.3"
MEGATRON_FILE = "megatron/training/arguments.py"
TORCHTITAN_PIN = "v0.2.2"
TORCHTITAN_FILE = "torchtitan/config/job_config.py"

OUT = Path(__file__).resolve().parent.parent / "src" / "pipectl" / "emit" / "vendored.py"


def _show(git_dir: str, ref: str, path: str) -> tuple[str, str]:
    commit = subprocess.run(["git", "-C", git_dir, "rev-parse", f"{ref}^{{commit}}"], check=True,
                            capture_output=True, text=True).stdout.strip()
    text = subprocess.run(["git", "-C", git_dir, "show", f"{commit}:{path}"], check=True,
                          capture_output=True, text=True).stdout
    return commit, text


def megatron_arguments(text: str) -> list[str]:
    """Every option string of an `add_argument(...)` call (aliases included)."""
    names: set[str] = set()
    for call in re.finditer(r"add_argument\(\s*((?:['\"]--?[\w-]+['\"]\s*,\s*)+)", text):
        names.update(re.findall(r"['\"](--[\w-]+)['\"]", call.group(1)))
    return sorted(names)


def torchtitan_fields(text: str) -> dict[str, list[str]]:
    """{section: [field, ...]} of `JobConfig`: each of its fields is a TOML section whose keys are
    the fields of that section's dataclass."""
    tree = ast.parse(text)
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}

    def fields(name: str) -> list[str]:
        body = classes[name].body
        return [item.target.id for item in body if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)]

    sections: dict[str, list[str]] = {}
    for item in classes["JobConfig"].body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            annotation = item.annotation.id if isinstance(item.annotation, ast.Name) else None
            if annotation in classes:
                sections[item.target.id] = fields(annotation)
    return sections


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron", required=True, help="a git directory of NVIDIA/Megatron-LM")
    parser.add_argument("--torchtitan", required=True, help="a git directory of pytorch/torchtitan")
    args = parser.parse_args()
    megatron_commit, megatron_text = _show(args.megatron, MEGATRON_PIN, MEGATRON_FILE)
    titan_commit, titan_text = _show(args.torchtitan, TORCHTITAN_PIN, TORCHTITAN_FILE)
    arguments = megatron_arguments(megatron_text)
    sections = torchtitan_fields(titan_text)
    lines = [
        '"""Names other frameworks parse, read from their sources at a pinned release (generated: do not edit).',
        "",
        "    python scripts/vendor_framework_names.py --megatron DIR --torchtitan DIR",
        "",
        "`pipectl.emit` writes only names listed here; tests/emit check every emitted one against them.",
        '"""',
        "",
        f'MEGATRON_SOURCE = "NVIDIA/Megatron-LM {MEGATRON_PIN} ({megatron_commit}), {MEGATRON_FILE}"',
        f'MEGATRON_RELEASE = "{MEGATRON_PIN}"',
        "MEGATRON_ARGUMENTS = frozenset({",
        *[f'    "{name}",' for name in arguments],
        "})",
        "",
        f'TORCHTITAN_SOURCE = "pytorch/torchtitan {TORCHTITAN_PIN} ({titan_commit}), {TORCHTITAN_FILE}"',
        f'TORCHTITAN_RELEASE = "{TORCHTITAN_PIN}"',
        "TORCHTITAN_SECTIONS = {",
        *[f'    "{section}": frozenset({{{", ".join(repr(f) for f in names)}}}),' for section, names in sections.items()],
        "}",
        "",
    ]
    OUT.write_text("\n".join(lines))
    print(f"wrote {OUT}: {len(arguments)} Megatron-LM arguments, {len(sections)} torchtitan sections")


if __name__ == "__main__":
    main()

"""The worked examples in docstrings hold: every module of pipectl whose source has one."""

import doctest
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "pipectl"

MODULES = sorted(
    ".".join(("pipectl",) + path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")
    for path in PACKAGE.rglob("*.py")
    if ">>>" in path.read_text()
)


def test_the_examples_are_found():
    assert "pipectl.plan.memory" in MODULES and "pipectl.profile.host_sharing" in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.failed == 0

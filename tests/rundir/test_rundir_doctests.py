"""The worked examples in the run directory's modules hold (every module of pipectl.rundir), and
those of the modules the house moves gave a file of their own."""

import doctest
import importlib
import pkgutil

import pytest

import pipectl.rundir

MODULES = sorted(module.name for module in pkgutil.walk_packages(pipectl.rundir.__path__, "pipectl.rundir."))
MOVED = ["pipectl.models.layer_facts", "pipectl.runtime.step_metrics"]


@pytest.mark.parametrize("name", MODULES + MOVED)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.failed == 0


def test_the_examples_are_found():
    """The test above can fail: the examples it runs exist."""
    attempted = sum(doctest.testmod(importlib.import_module(name)).attempted for name in MODULES + MOVED)
    assert attempted >= 5

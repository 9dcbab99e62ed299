"""The worked examples in the planner's docstrings hold (every module of pipectl.plan)."""

import doctest
import importlib
import pkgutil

import pytest

import pipectl.plan

MODULES = sorted(module.name for module in pkgutil.walk_packages(pipectl.plan.__path__, "pipectl.plan."))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.failed == 0

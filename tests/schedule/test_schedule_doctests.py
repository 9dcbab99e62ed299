"""The worked examples in the docstrings of the schedule, simulator and Gantt modules hold."""

import doctest
import importlib

import pytest

MODULES = [
    "pipectl.schedule",
    "pipectl.schedule.generators",
    "pipectl.schedule.grid",
    "pipectl.schedule.dag",
    "pipectl.schedule.validate",
    "pipectl.schedule.comm",
    "pipectl.schedule.varuna_order",
    "pipectl.plan.simulate",
    "pipectl.report.gantt",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted > 0
    assert result.failed == 0

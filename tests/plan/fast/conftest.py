"""Fixtures shared by the fast-path tests."""

import pytest

from pipectl.plan.fast import waves


@pytest.fixture
def repeat_searches(monkeypatch) -> list[int]:
    """Grows by one each time the wave pass searches its history for a repeat."""
    searches: list[int] = []
    original = waves._History._repeat

    def counting(self, *args):
        searches.append(1)
        return original(self, *args)

    monkeypatch.setattr(waves._History, "_repeat", counting)
    return searches

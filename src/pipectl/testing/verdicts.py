"""A pytest plugin: each test's verdict on a line of its own as soon as it is known.

    PIPECTL_TEST_VERDICTS=verdicts.jsonl python -m pytest -p pipectl.testing.verdicts ...

pytest writes its JUnit file when the run ends; a run that a time box kills (a GPU host lent for
minutes, `scripts/gpu-check.sh --tests`) leaves none. This plugin appends one JSON line per test
(`{"test", "outcome", "seconds"}`: passed, failed, error or skipped) as each ends, the file closed each time, from the
process that collects the reports (pytest-xdist's controller, not its workers), so what ran before
the kill is on disk. `summary_line` reads the file back into the line gpu-check prints.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

VERDICTS_ENV = "PIPECTL_TEST_VERDICTS"
OUTCOMES = ("passed", "failed", "error", "skipped")


def _verdict(report: Any) -> str | None:
    """The test's outcome from one of its reports, or None where this report settles nothing."""
    if report.when == "call":
        return report.outcome  # passed, failed or skipped
    if report.failed:  # a fixture's setup or teardown broke: pytest's "error"
        return "error"
    if report.when == "setup" and report.skipped:
        return "skipped"
    return None


_is_worker = False


def pytest_configure(config: Any) -> None:
    # An xdist worker has `workerinput`; the controller writes what the workers report. (Not the
    # PYTEST_XDIST_WORKER variable: a pytest started from inside a worker inherits it.)
    global _is_worker
    _is_worker = hasattr(config, "workerinput")


def pytest_runtest_logreport(report: Any) -> None:
    path = os.environ.get(VERDICTS_ENV)
    if not path or _is_worker:
        return
    outcome = _verdict(report)
    if outcome is None:
        return
    line = json.dumps({"test": report.nodeid, "outcome": outcome, "seconds": round(report.duration, 3)})
    with open(path, "a", encoding="utf-8") as handle:  # closed, so on disk, at once
        handle.write(line + "\n")


def summary_line(path: str | os.PathLike[str], budget_seconds: float | None = None) -> str:
    """'N passed, F failed, E errors, S skipped' of a verdicts file (a test with a passing call and
    a failing teardown counts as an error, once), plus the budget it ran under."""
    outcomes: dict[str, str] = {}
    text = Path(path).read_text(encoding="utf-8") if Path(path).exists() else ""
    for raw in text.splitlines():
        record = json.loads(raw)
        if outcomes.get(record["test"]) in ("failed", "error"):
            continue
        outcomes[record["test"]] = record["outcome"]
    counts = Counter(outcomes.values())
    words = {"passed": "passed", "failed": "failed", "error": "errors", "skipped": "skipped"}
    line = ", ".join(f"{counts[o]} {words[o]}" for o in OUTCOMES)
    return line + (f" (time box {budget_seconds:g} s)" if budget_seconds else "")

"""Hypothesis strategies that damage a valid file the way people and disks do, and the property
every command must keep on any input: exit 0, or exit 2 with one `error:` line; never a traceback.

A case is a valid document (a profile, a plan, a job.json, ...) with one to three mutations at
places drawn from the whole tree: a key dropped, a value replaced by a wrong type, a non-finite,
huge or negative number, an empty or deeply nested list, a duplicated or swapped list element,
unicode, an unknown key. Text-level damage is drawn in test_fuzz_inputs.py (`text_cases`).
"""

from __future__ import annotations

import copy
import json
import math
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

# The CI subset runs derandomized (the same cases every run, so a failure is reproducible from the
# log alone); the slow sweep (scripts/slow-tests.sh) draws fresh cases each time.
_COMMON = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck), print_blob=True)


def ci(examples: int):
    return settings(max_examples=examples, derandomize=True, **_COMMON)


def sweep(examples: int):
    return settings(max_examples=examples, derandomize=False, **_COMMON)


NON_FINITE = (math.nan, math.inf, -math.inf)
SPECIAL_VALUES = [
    True, False, None, "", " ", 0, -1, -(2**63), 2**63, 2**64, 10**40, 1e308, -1e308, 1e-320, 1e40, 0.5, -0.0,
    *NON_FINITE, [], {}, [[]], "∞", "ﬁle\u202e", "\x00", "é" * 50, "x" * 5000, "../../etc/passwd", "/dev/null",
    "sys:exit", "os:system", "1e400", "NaN",
]
values = st.one_of(
    st.sampled_from(SPECIAL_VALUES),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30),
    st.lists(st.integers(-3, 3), max_size=4),
)


# What the issue lists, aimed at numbers: non-finite, huge, negative, zero, a boolean, a string.
BAD_NUMBERS = [*NON_FINITE, 1e308, -1e308, 1e40, 10**40, 2**63, -1, -1.5, 0, True, False, "1", None, 1e-320]


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            found.append((*prefix, key))
            found.extend(_paths(value, (*prefix, key)))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found.append((*prefix, index))
            found.extend(_paths(value, (*prefix, index)))
    return found


def _parent(doc: Any, path: tuple) -> Any:
    for key in path[:-1]:
        doc = doc[key]
    return doc


@dataclass(frozen=True)
class Mutation:
    op: str
    path: tuple
    value: Any = None
    replaced_number: bool = False

    @property
    def field(self) -> str | None:
        """The innermost key named on the path (what a good message names)."""
        return next((str(k) for k in reversed(self.path) if isinstance(k, str)), None)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _replaced_number(original: dict, path: tuple, old: Any) -> bool:
    """Whether a mutation at `path` replaces a number the schema asks for: the value it replaces
    is one, and the original document did not hold a boolean there (an earlier mutation may have
    put a number where a boolean belongs; a boolean written back is then valid again)."""
    node: Any = original
    for key in path:
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            return _is_number(old)
    return _is_number(old) and not isinstance(node, bool)


@st.composite
def mutated(draw, document: dict, max_mutations: int = 3) -> tuple[dict, list[Mutation]]:
    """`document` with 1..max_mutations mutations, and the list of what was done."""
    doc = copy.deepcopy(document)
    done: list[Mutation] = []
    for _ in range(draw(st.integers(1, max_mutations))):
        paths = _paths(doc)
        if not paths:
            break
        op = draw(st.sampled_from(["number"] * 4 + ["drop", "replace", "replace", "scale", "duplicate", "duplicate",
                                                     "empty", "nest", "extra"]))  # fmt: skip
        numeric = [p for p in paths if _is_number(_parent(doc, p)[p[-1]])]
        path = draw(st.sampled_from(numeric if op in ("number", "scale") and numeric else paths))
        parent, key = _parent(doc, path), path[-1]
        old = parent[key]
        if op == "number":
            new = draw(st.sampled_from(BAD_NUMBERS))
            parent[key] = new
            done.append(Mutation("replace", path, new, replaced_number=_replaced_number(document, path, old)))
            continue
        if op == "drop":
            del parent[key]
        elif op == "replace":
            new = draw(values)
            parent[key] = new
            done.append(Mutation(op, path, new, replaced_number=_replaced_number(document, path, old)))
            continue
        elif op == "scale" and _is_number(old):
            factor = draw(st.sampled_from([-1, 10**6, 10**30, 1e300, 0]))
            new = old * factor
            parent[key] = new
            done.append(Mutation("replace", path, new, replaced_number=_replaced_number(document, path, old)))
            continue
        elif op == "duplicate" and isinstance(parent, list):
            parent.insert(key, copy.deepcopy(old))
        elif op == "empty" and isinstance(old, (list, dict)):
            parent[key] = type(old)()
        elif op == "nest":
            new = old
            for _ in range(draw(st.integers(1, 60))):
                new = [new]
            parent[key] = new
        elif op == "extra" and isinstance(old, dict):
            old[draw(st.text(min_size=1, max_size=10))] = draw(values)
        else:
            parent[key] = None
            op = "replace"
        done.append(Mutation(op, path))
    return doc, done


def dump(doc: Any, path: Path) -> Path:
    """Write `doc` as JSON (NaN/Infinity as JavaScript writes them) or YAML, by suffix."""
    if path.suffix == ".json":
        path.write_text(json.dumps(doc, indent=1, allow_nan=True))
    else:
        path.write_text(yaml.safe_dump(doc, allow_unicode=True, sort_keys=False))
    return path


def check_clean(result, *, what: str = "") -> None:
    """The property: exit 0, or exit 2 with an `error:` line; no other exception, no traceback."""
    exc = result.exception
    if exc is not None and not isinstance(exc, SystemExit):
        shown = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        raise AssertionError(f"{what}: uncaught {type(exc).__name__}\n{shown}\n--- output ---\n{result.output[-3000:]}")
    assert result.exit_code in (0, 2), f"{what}: exit {result.exit_code}\n{result.output[-3000:]}"
    assert "Traceback" not in result.output, f"{what}: traceback in the output\n{result.output[-3000:]}"
    if result.exit_code == 2:
        assert "error" in result.output.lower() or "usage" in result.output.lower(), result.output[-3000:]


def non_finite_inside(node: Any) -> bool:
    if isinstance(node, float):
        return not math.isfinite(node)
    if isinstance(node, dict):
        return any(non_finite_inside(v) for v in node.values())
    if isinstance(node, list):
        return any(non_finite_inside(v) for v in node)
    return False


def _holds(document: Any, mutation: Mutation) -> bool:
    """Whether the value `mutation` wrote is still where it wrote it (a later one may drop it)."""
    node = document
    for key in mutation.path:
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            return False
    return node is mutation.value


def check_refused(result, document: Any, mutations: list[Mutation], *, what: str = "") -> None:
    """`check_clean`, and: a file holding a non-finite number anywhere, or a boolean where it held
    a number, is refused, and the message names the field (its key)."""
    check_clean(result, what=what)
    booleans = [m for m in mutations if m.replaced_number and isinstance(m.value, bool) and _holds(document, m)]
    if not non_finite_inside(document) and not booleans:
        return
    assert result.exit_code == 2, f"{what}: accepted ({mutations})\n{result.output[-2000:]}"
    output = " ".join(result.output.split())
    fields = {m.field for m in mutations if m.field} | {str(m.path[-1]) for m in mutations}
    assert any(f in output for f in fields), f"{what}: the message names none of {sorted(fields)}\n{output[-2000:]}"

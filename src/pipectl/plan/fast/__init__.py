"""Exact fast paths for a step's time, and lower bounds that prune candidates before timing them.

Each fast path gives the figures of a reference simulation of the generated schedule without
building it; each bound is never above that reference. The tests named here hold them to it.

- `waves` — GPipe (closed form), 1F1B, PipeDream-2BW and interleaved 1F1B, no jitter:
  `simulate(generate(kind, p, m, v, recompute), costs)` to 1e-12 relative
  (tests/plan/fast/test_waves.py, test_waves_head_start.py).
- `varuna` — Varuna, no jitter: `simulate(generate(VARUNA, p, m), costs)` to 1e-12 relative
  (tests/plan/fast/test_varuna.py, test_varuna_head_start.py).
- `bounds` — 1F1B's in-flight loops: never above `simulate(...)` (tests/plan/fast/test_bounds.py).
- `periodic` — what `waves` and `varuna` share: skipping repeating stretches of a step.
"""

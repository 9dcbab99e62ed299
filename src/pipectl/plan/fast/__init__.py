"""Exact fast paths for a step's time, and lower bounds that prune candidates before timing them.

A step's time is defined by the simulation of the generated schedule (`pipectl.plan.simulate`;
`pipectl.plan.timing` says which schedule and picks the path). Each fast path here gives that
simulation's figures without building the schedule; each bound is never above them. The tests
named here hold them to it.

- `waves` — GPipe (closed form), 1F1B, PipeDream-2BW and interleaved 1F1B, no jitter,
  asynchronous transfers: equals `simulate(generate(kind, p, m, v, recompute), costs)` to 1e-12
  relative (tests/plan/fast/test_waves.py, test_waves_head_start.py). For 2BW that is one
  flushed step, the figure its notes compare with.
- `twobw` — PipeDream-2BW's steady state per update, no flush (how the planner prices 2BW):
  equals `pipectl.plan.twobw_steady_state.two_bw_steady_state` to 1e-12 relative
  (tests/plan/test_twobw_pricing.py).
- `varuna` — Varuna, no jitter, asynchronous transfers: equals
  `simulate(generate(VARUNA, p, m), costs)` to 1e-12 relative (tests/plan/fast/test_varuna.py,
  test_varuna_head_start.py).
- `varuna_flags` — Varuna's order for every m, cut from its periodic form: equals the
  definition, `pipectl.schedule.varuna_order`, exactly (tests/plan/fast/test_varuna_flags.py).
- `bounds` — lower bounds, never above `simulate(...)`: the chains through every rank (each
  spec's `lower_bound_seconds`; for 2BW, its stages' work per update, never above its steady
  state), 1F1B's in-flight loops and Varuna's warm-up and cool-down
  (tests/plan/fast/test_bounds.py, tests/plan/test_search.py, tests/plan/test_twobw_pricing.py).
- `periodic` — what `waves`, `twobw` and `varuna` share: skipping a step's repeating stretches.

Blocking transfers (gloo) have no fast path: `simulate` times them as rendezvous on the schedule
with its sends and receives, which is their reference.

End to end, tests/plan/test_reference_mode.py plans searches with the fast paths and in
reference mode (`PIPECTL_PLAN_REFERENCE=1`, every candidate simulated) and finds the same plans,
to rounding: "to 1e-12" is not bit for bit, so the figures differ in their last digits and
candidates whose times tie exactly may swap places.
"""

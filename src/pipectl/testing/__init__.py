"""Fixtures for tests, doctests and benchmarks: model profiles built in code (`profiles`), and the
fault trials (`fault_trials`, on real launches run by `fault_harness`) with their model, a user's
factory in `user_model/`."""

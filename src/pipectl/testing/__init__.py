"""Fixtures for tests and doctests: small model profiles built in code, not measured."""

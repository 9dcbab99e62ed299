"""Predictions checked against training runs measured on real clusters: `pipectl validate`."""

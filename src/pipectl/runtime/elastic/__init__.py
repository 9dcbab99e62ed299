"""A job that changes size while it runs: the live hand-over, recovery from a neighbour replica, and
the morph table's layout for a new world size."""

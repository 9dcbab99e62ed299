"""Checkpoints from inside the ranks: each rank's shard, the engine's state, the background writer,
when to save, and what the ranks do together at a step boundary."""

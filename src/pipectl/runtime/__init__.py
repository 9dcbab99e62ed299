"""What runs inside each rank: the DeepSpeed pipeline cut at the plan (`pipeline`), our schedule
executed by DeepSpeed's engine (`executor`), deterministic data (`data`), DeepSpeed start-up
work-arounds (`dsinit`), checkpoints and metrics, and the worker entry point (`worker`).

Nothing is imported here: `import pipectl.runtime.data` must not pull in DeepSpeed.
"""

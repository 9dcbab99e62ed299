"""pipectl: profile, plan, launch and resize pipeline-parallel training jobs.

The global batch size is the user's hyper-parameter and never changes with the hardware.
"""

__version__ = "0.1.0"

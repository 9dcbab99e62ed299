"""Profiles of a model: measured layer by layer (`measure`), link calibration (`links`), or derived
from the model's shape and a device datasheet (`derive`).

Kept free of imports so that `import pipectl.profile.derive` (used by the planner) never loads torch.
"""

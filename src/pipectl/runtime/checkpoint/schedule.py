"""When to checkpoint: every K steps, every wall-time interval, or an interval chosen from what a
checkpoint costs and how often the job is expected to fail (Young/Daly).

With checkpoints written in the background, what a checkpoint costs training is its stall (the
copy to host memory, `checkpointer`); what a failure costs is the work since the last committed
checkpoint. The first-order optimum between the two is sqrt(2 x stall x MTBF), so a cheap
checkpoint on a large (often failing) job is taken every few minutes and the same checkpoint on one
device every hour or so. Pure: no torch, so `status` reads it too.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

# About one failure per device every 5.7 years: Llama 3's 54-day run on 16,384 H100s had 419
# unexpected interruptions (Dubey et al., "The Llama 3 Herd of Models", 2024, §3.3.4), i.e.
# 16,384 x 54 x 24 / 419 = 50,700 device-hours between failures. A job of N devices: / N.
DEVICE_MTBF_HOURS = 50_000.0
AUTO_MIN_INTERVAL_SECONDS = 60.0  # auto never checkpoints more often than this


def young_daly_seconds(cost_seconds: float, mtbf_seconds: float) -> float:
    """The checkpoint interval that minimises the time lost to checkpoints plus the work redone
    after a failure, to first order (Young 1974; Daly 2006): sqrt(2 C M).

    >>> round(young_daly_seconds(0.5, 50_000 * 3600 / 3072))   # 0.5 s stall, 3,072 devices
    242
    """
    return math.sqrt(2.0 * cost_seconds * mtbf_seconds)


@dataclass
class CheckpointSchedule:
    """When to checkpoint: every K steps, and/or once a wall time has passed since the last one,
    fixed or chosen by Young/Daly from the stall the last checkpoint measured (`auto`; its first
    checkpoint comes after the first step, to measure it)."""

    every_steps: int = 0
    every_seconds: float = 0.0
    auto: bool = False
    mtbf_seconds: float = math.inf
    last_time: float = field(default_factory=lambda: time.monotonic())  # the job's start, then each save
    last_stall: float | None = None

    @classmethod
    def for_job(cls, every_steps: int, every_seconds: float, auto: bool, mtbf_hours: float | None, devices: int):
        hours = mtbf_hours if mtbf_hours is not None else DEVICE_MTBF_HOURS / max(1, devices)
        return cls(every_steps, every_seconds, auto, hours * 3600.0)

    def interval_seconds(self) -> float | None:
        """The wall-time interval in force (None: steps only, or auto before its first measure)."""
        if self.auto:
            if self.last_stall is None:
                return None
            return max(AUTO_MIN_INTERVAL_SECONDS, young_daly_seconds(self.last_stall, self.mtbf_seconds))
        return self.every_seconds or None

    def step_due(self, step: int, total_steps: int) -> bool:
        return bool(self.every_steps) and step % self.every_steps == 0 and step < total_steps

    def time_due(self, steps_done: int) -> bool:
        if self.auto and self.last_stall is None:
            return steps_done >= 1  # measure the cost once, early
        interval = self.interval_seconds()
        return interval is not None and time.monotonic() - self.last_time >= interval

    def saved(self, stall_seconds: float) -> None:
        self.last_time = time.monotonic()
        self.last_stall = stall_seconds

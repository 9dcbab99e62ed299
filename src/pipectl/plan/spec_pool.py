"""Every spec of a search as columns, each `Spec` object built on first need.

A search at scale finds ~3 x 10^5 feasible specs (GPT-3 175B on 3,072 GPUs, benchmarks/plan_scale.py).
The ranking and the morph table read every spec's lower bound, device count and the engines that
run it, but simulate a few hundred: reading those figures as numpy columns (sorting, filtering)
instead of one Python object per spec, and building the objects they visit only, keeps the serial
end of a search short.

    >>> from pipectl.testing.profiles import synthetic_profile
    >>> from pipectl.cluster import local_cluster
    >>> from pipectl.plan.costs import hardware_for
    >>> from pipectl.plan.candidates import ShapeBuilder, ScheduleVariant
    >>> from pipectl.plan.spec_costs import specs_from_points
    >>> from pipectl.schedule import ScheduleKind
    >>> profile = synthetic_profile(blocks=4, micro_batch_sizes=[1])
    >>> hardware = hardware_for(local_cluster(4), profile)
    >>> shape = ShapeBuilder(profile, hardware).shape(1, 1, False, 2, 1)
    >>> variant = ScheduleVariant(ScheduleKind.ONE_F_ONE_B)
    >>> specs = specs_from_points(
    ...     [(shape, variant, (2, 4, 1, 7.0, (2, 1))), (shape, variant, (1, 8, 0, 16.0, (2, 1)))], hardware, profile.dtype
    ... )
    >>> pool = SpecPool.of(specs)
    >>> pool.devices.tolist(), pool.take(pool.devices <= 2)[0] is specs[1]
    ([4, 2], True)
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence, overload

import numpy as np

from pipectl.artifacts.plan import Engine
from pipectl.plan.candidates import Spec


class _Built:
    """The spec objects of a pool: built by `build(i)` on first need and kept, so that one spec
    is one object (the ranking compares entries by identity)."""

    __slots__ = ("_build", "_specs")

    def __init__(self, count: int, build: Callable[[int], Spec]) -> None:
        self._build = build
        self._specs: list[Spec | None] = [None] * count

    def spec(self, index: int) -> Spec:
        spec = self._specs[index]
        if spec is None:
            spec = self._specs[index] = self._build(index)
        return spec


class SpecPool(Sequence[Spec]):
    """Specs as columns: `bounds` (lower bound seconds), `devices`, `pipeline_parallel`,
    `zero_stages`, and which engines run each (`runs_on`); `pool[i]` is the spec itself.

    `take` selects a sub-pool (a mask or positions) that shares the spec objects.
    """

    __slots__ = ("_built", "_index", "bounds", "devices", "pipeline_parallel", "zero_stages", "_deepspeed", "_torch")

    def __init__(
        self, built: _Built, index: np.ndarray, bounds: np.ndarray, devices: np.ndarray,
        pipeline_parallel: np.ndarray, zero_stages: np.ndarray, deepspeed: np.ndarray, torch: np.ndarray,
    ) -> None:
        self._built, self._index = built, index
        self.bounds, self.devices, self.pipeline_parallel, self.zero_stages = bounds, devices, pipeline_parallel, zero_stages
        self._deepspeed, self._torch = deepspeed, torch

    @classmethod
    def build(
        cls, count: int, build: Callable[[int], Spec], *, bounds: Sequence[float], devices: Sequence[int],
        pipeline_parallel: Sequence[int], zero_stages: Sequence[int], deepspeed: Sequence[bool], torch: Sequence[bool],
    ) -> SpecPool:
        """`count` specs whose figures the columns give, spec i built by `build(i)` when read."""
        return cls(
            _Built(count, build), np.arange(count), np.asarray(bounds, dtype=float).reshape(count),
            np.asarray(devices, dtype=np.int64).reshape(count), np.asarray(pipeline_parallel, dtype=np.int64).reshape(count),
            np.asarray(zero_stages, dtype=np.int64).reshape(count), np.asarray(deepspeed, dtype=bool).reshape(count),
            np.asarray(torch, dtype=bool).reshape(count),
        )

    @classmethod
    def of(cls, specs: Sequence[Spec]) -> SpecPool:
        """A pool of specs built already (itself when it is one)."""
        if isinstance(specs, SpecPool):
            return specs
        specs = list(specs)
        return cls.build(
            len(specs), specs.__getitem__,
            bounds=[spec.lower_bound_seconds for spec in specs], devices=[spec.devices for spec in specs],
            pipeline_parallel=[spec.shape.pipeline_parallel for spec in specs],
            zero_stages=[spec.zero_stage for spec in specs], deepspeed=[spec.deepspeed_runnable for spec in specs],
            torch=[spec.torch_runnable for spec in specs],
        )

    def __len__(self) -> int:
        return len(self._index)

    @overload
    def __getitem__(self, position: int) -> Spec: ...

    @overload
    def __getitem__(self, position: slice) -> list[Spec]: ...

    def __getitem__(self, position: int | slice) -> Spec | list[Spec]:
        if isinstance(position, slice):
            return [self._built.spec(index) for index in self._index[position].tolist()]
        return self._built.spec(int(self._index[position]))

    def __iter__(self) -> Iterator[Spec]:
        spec = self._built.spec
        for index in self._index.tolist():
            yield spec(index)

    def take(self, selector: np.ndarray) -> SpecPool:
        """The specs a boolean mask or an array of positions selects, in that order."""
        return SpecPool(
            self._built, self._index[selector], self.bounds[selector], self.devices[selector],
            self.pipeline_parallel[selector], self.zero_stages[selector], self._deepspeed[selector], self._torch[selector],
        )

    def runs_on(self, engine: Engine) -> np.ndarray:
        """Per spec: whether the plan may choose it under a request for `engine` (`Spec.runs_on`)."""
        if engine is Engine.DEEPSPEED:
            return self._deepspeed
        if engine is Engine.TORCH:
            return self._torch
        return np.ones(len(self), dtype=bool)

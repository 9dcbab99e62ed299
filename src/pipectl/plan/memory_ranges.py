"""Stage memory for every layer range at once, for the partitioner: `plan.memory`'s expressions
evaluated from precomputed rows.

The memory-constrained partitioner asks "do layers [start, end) fit on this stage?" millions of
times at scale. `RangeMemory` holds each term of `StageMemory` for every range of one layer table
and t (the same float operations, so a stage alone on its rank gets exactly the same bytes), and
`FurthestFittingEnds` remembers, per start and memory demand, the furthest end that still fits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipectl.artifacts.plan import Recompute


@dataclass(frozen=True)
class RangeMemory:
    """The terms of one stage's memory for every layer range [start, end) of one table and t, as lists.

    The memory-constrained partitioner asks "does layers [start, end) fit on stage i?" millions of
    times at scale; reading these rows costs a few list look-ups instead of the table's range
    queries. Values are computed with the same operations as `StageMemory.build` from the table
    (parameter counts are exact in float64 below 2**53), so a stage alone on its rank gets
    exactly the same bytes.
    """

    parameters: list[list[float]]  # [start][end]: parameters on a rank (/ t, `LayerTable.divisor`; 0 where end <= start)
    saved: list[list[float]]  # [start][end]: saved activations on a rank (/ t likewise)
    input_bytes: list[float]  # [start]: the activation a stage starting there receives
    working: list[list[float]]  # [start][end]: the largest working memory of layers [start, end)
    # [start][end]: what layers [start, end) keep per micro-batch under per-layer checkpointing
    # (`LayerTable.layer_inputs`: their inputs; the head's saved activations / t)
    layer_inputs: list[list[float]]
    largest_saved: list[list[float]]  # [start][end]: the largest saved activations of one checkpointed layer (/ t)
    # [start][end]: what layers [start, end) keep per micro-batch under selective recomputation
    # (`LayerTable.selective_saved`), and their largest attention core's saved bytes (/ t)
    selective_saved: list[list[float]]
    largest_core: list[list[float]]
    # The same values as arrays, for looking up every stage of a cut at once.
    parameter_matrix: np.ndarray
    saved_matrix: np.ndarray
    input_array: np.ndarray
    working_matrix: np.ndarray
    layer_input_matrix: np.ndarray
    largest_saved_matrix: np.ndarray
    selective_saved_matrix: np.ndarray
    largest_core_matrix: np.ndarray
    parameter_prefix: np.ndarray  # the table's parameter counts, as float64 prefix sums (not divided)

    @classmethod
    def build(cls, table, tensor_parallel: int) -> "RangeMemory":
        layers = table.layers
        divisor = table.divisor(tensor_parallel)  # t for whole layers, 1 for one tensor rank's figures
        parameter_prefix = np.asarray(table.parameter_prefix, dtype=float)
        saved_prefix = np.asarray(table.saved_prefix, dtype=float)
        parameters = (parameter_prefix[None, :] - parameter_prefix[:, None]) / divisor
        saved = (saved_prefix[None, :] - saved_prefix[:, None]) / divisor
        rows = parameters.tolist()
        # Ranges holding two members of a shared group (a tied embedding) count it once.
        shared = np.zeros(layers + 1, dtype=int)
        for index in table.shared_layer_indices:
            shared[index + 1:] += 1
        for start, end in zip(*np.nonzero(shared[None, :] - shared[:, None] >= 2)):
            rows[start][end] = table.parameters(int(start), int(end)) / divisor
        inputs = [table.input_activation_bytes(start) for start in range(layers)] + [0.0]
        working = np.zeros((layers + 1, layers + 1))
        per_layer = np.asarray(table.working_bytes, dtype=float)
        largest = np.zeros((layers + 1, layers + 1))
        per_layer_saved = np.asarray(
            [saved if table.checkpointed(i) else 0.0 for i, saved in enumerate(table.saved_activation_bytes)], dtype=float
        )
        for start in range(layers):
            working[start, start + 1:] = np.maximum.accumulate(per_layer[start:])
            largest[start, start + 1:] = np.maximum.accumulate(per_layer_saved[start:])
        largest /= divisor
        # What layers [start, end) keep under per-layer checkpointing, added in layer order as
        # `LayerTable.layer_inputs` adds them (a cumulative sum is the same sequence of float additions).
        layer_input = np.zeros((layers + 1, layers + 1))
        per_layer_input = np.asarray([table.checkpoint_kept(i, divisor) for i in range(layers)], dtype=float)
        for start in range(layers):
            layer_input[start, start + 1:] = np.cumsum(per_layer_input[start:])
        # Selective recomputation, as `LayerTable.selective_saved` and `largest_attention_core` add
        # and compare them.
        selective = np.zeros((layers + 1, layers + 1))
        per_layer_selective = np.asarray([table.selective_kept(i, divisor) for i in range(layers)], dtype=float)
        largest_core = np.zeros((layers + 1, layers + 1))
        per_layer_core = np.asarray([table.attention_core_saved(i) for i in range(layers)], dtype=float)
        for start in range(layers):
            selective[start, start + 1:] = np.cumsum(per_layer_selective[start:])
            largest_core[start, start + 1:] = np.maximum.accumulate(per_layer_core[start:])
        largest_core /= divisor
        return cls(
            rows, saved.tolist(), inputs, working.tolist(), layer_input.tolist(), largest.tolist(),
            selective.tolist(), largest_core.tolist(),
            np.array(rows), saved, np.array(inputs), working, layer_input, largest, selective, largest_core,
            parameter_prefix,
        )

    def stage_bytes(
        self, start: int, end: int, *, state_bytes: float, step_bytes: float, units: int,
        recompute: Recompute | bool,
    ) -> float:
        """Peak bytes of a stage holding layers [start, end) with `units` micro-batches in flight:
        the larger of parameters × step bytes (the optimizer step) and parameters × state bytes +
        units × what one keeps + what recomputing holds + its largest working memory (docs/design.md,
        'Memory model'). Pass `recompute=False` (NONE) for the last stage of a pipeline that
        recomputes whole stages: it never does."""
        parameters = self.parameters[start][end]
        if recompute is Recompute.LAYER:
            training = (
                parameters * state_bytes + units * self.layer_inputs[start][end] + self.largest_saved[start][end]
            )
        elif recompute is Recompute.SELECTIVE:
            training = (
                parameters * state_bytes + units * self.selective_saved[start][end] + self.largest_core[start][end]
            )
        elif recompute:
            training = parameters * state_bytes + units * self.input_bytes[start] + self.saved[start][end]
        else:
            training = parameters * state_bytes + units * self.saved[start][end]
        return max(training + self.working[start][end], parameters * step_bytes)


class FurthestFittingEnds:
    """For a stage starting at a layer: the furthest end whose stage still fits, memoised.

    `end(start, state_bytes, step_bytes, units, keeps_input_only)` is the largest `end` in
    (start, layers] with `RangeMemory.stage_bytes(start, end, ...) <= capacity` (the same float
    expressions the partitioner's memory test evaluates), or `start` when not even one layer fits.
    A stage's bytes never shrink as its range grows (parameters, saved activations and working
    memory are non-negative; a shared group counts once), so bisection finds it. The search asks
    the same question for many pipelines of one (t, b): the stage memory only depends on the
    start, the bytes per parameter (training and step), the in-flight units and what the stage
    keeps (`keeps_input_only`: False/NONE its saved activations, True/STAGE only its input,
    `Recompute.LAYER` its layers' inputs, `Recompute.SELECTIVE` its saved activations less the
    attention cores') — so the answers are remembered by exactly those values.

        >>> from pipectl.testing.profiles import synthetic_profile
        >>> from pipectl.plan.layer_table import layer_table
        >>> rows = RangeMemory.build(layer_table(synthetic_profile(blocks=4, micro_batch_sizes=[1]), 1), 1)
        >>> ends = FurthestFittingEnds(rows, capacity_bytes=10**12)
        >>> ends.end(0, 16.0, 24.0, 1, False)  # everything fits: up to the last layer
        7
        >>> FurthestFittingEnds(rows, capacity_bytes=0).end(0, 16.0, 24.0, 1, False)  # nothing fits
        0
    """

    def __init__(self, rows: RangeMemory, capacity_bytes: float) -> None:
        self.rows = rows
        self.capacity_bytes = capacity_bytes
        self.layers = len(rows.input_bytes) - 1
        # (state bytes, step bytes, keeps input only) -> units -> end per start (-1: not yet
        # asked). Callers on hot paths read these rows directly; nested by kind of key so a
        # look-up hashes an int.
        self._rows: dict[tuple[float, float, Recompute | bool], dict[int, list[int]]] = {}
        self._lengths: dict[tuple[float, float, int, Recompute | bool], int] = {}  # last fitting stage length per demand

    def by_units(self, state_bytes: float, step_bytes: float, keeps_input_only: Recompute | bool) -> dict[int, list[int]]:
        """The memo rows of one (bytes per parameter, keeps input only), by in-flight units."""
        key = (state_bytes, step_bytes, keeps_input_only)
        rows = self._rows.get(key)
        if rows is None:
            rows = self._rows[key] = {}
        return rows

    def row(self, state_bytes: float, step_bytes: float, units: int, keeps_input_only: Recompute | bool) -> list[int]:
        """The memo row of one demand: the end for each start, -1 where not yet asked."""
        rows = self.by_units(state_bytes, step_bytes, keeps_input_only)
        row = rows.get(units)
        if row is None:
            row = rows[units] = [-1] * (self.layers + 1)
        return row

    def end(self, start: int, state_bytes: float, step_bytes: float, units: int, keeps_input_only: Recompute | bool) -> int:
        row = self.row(state_bytes, step_bytes, units, keeps_input_only)
        end = row[start]
        if end < 0:
            end = row[start] = self.search(start, state_bytes, step_bytes, units, keeps_input_only)
        return end

    def search(self, start: int, state_bytes: float, step_bytes: float, units: int, keeps_input_only: Recompute | bool) -> int:
        """`end` without the memo (callers holding a memo row store the answer themselves)."""
        rows = self.rows
        parameters, saved, working = rows.parameters[start], rows.saved[start], rows.working[start]
        capacity = self.capacity_bytes
        if keeps_input_only is Recompute.LAYER or keeps_input_only is Recompute.SELECTIVE:
            # `RangeMemory.stage_bytes`'s per-layer checkpointing: `P*s + u*inputs + largest + W`;
            # selective recomputation: `P*s + u*(saved - cores) + largest core + W`.
            if keeps_input_only is Recompute.LAYER:
                layer_inputs, largest = rows.layer_inputs[start], rows.largest_saved[start]
            else:
                layer_inputs, largest = rows.selective_saved[start], rows.largest_core[start]

            def fits(end: int) -> bool:
                held = parameters[end]
                return (
                    held * state_bytes + units * layer_inputs[end] + largest[end] + working[end] <= capacity
                    and held * step_bytes <= capacity
                )

        else:
            # One expression for both other kinds of stage: `P*s + u*I + S + W` keeping only the
            # input, else `P*s + 0.0 + u*S + W`; adding 0.0 and multiplying by 1 are exact, so each
            # equals `RangeMemory.stage_bytes`'s training peak; the optimizer step's `P*step` is the other.
            if keeps_input_only:
                held_input, saved_coefficient = units * rows.input_bytes[start], 1
            else:
                held_input, saved_coefficient = 0.0, units

            def fits(end: int) -> bool:
                held = parameters[end]
                return (
                    held * state_bytes + held_input + saved_coefficient * saved[end] + working[end] <= capacity
                    and held * step_bytes <= capacity
                )

        low, high = start, self.layers  # low fits (or is `start`); every end above `high` fails
        # Bracket first around the length last found for this demand (stages of a model's
        # repeated blocks fit the same number of layers), then bisect what is left.
        demand = (state_bytes, step_bytes, units, keeps_input_only)
        length = self._lengths.get(demand)
        if length is not None and start + length <= high:
            guess = start + length
            if fits(guess):
                low = guess
                if guess + 1 <= high and not fits(guess + 1):
                    high = guess
            else:
                high = guess - 1
        while low < high:
            middle = (low + high + 1) // 2
            if fits(middle):
                low = middle
            else:
                high = middle - 1
        if low > start:
            self._lengths[demand] = low - start
        return low

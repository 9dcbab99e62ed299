"""pipectl's prediction of each measured run, its layout pinned, under the runs' conditions.

A row's model is derived for the conditions' device (`profile.derive`, the kernel model) as the
framework ran it (`EngineFeatures`: Megatron's vocabulary-parallel embedding and head, its fused
element-wise kernels and dropout, blocks split evenly over the stages; DeepSpeed's pipeline engine
holding both ranks through a transfer), on a cluster of the row's GPUs with the conditions' links,
and planned with everything the row fixes pinned: t, p, d, b, the schedule, the recomputation and
the ZeRO stage (`plan.search.plan`, nothing re-searched but the cut). Nothing is fitted to the rows.

A run that was measured did fit its GPUs. Where pipectl's memory model refuses its layout anyway,
the step is still predicted (the memory check set aside) and the row says what the model refused:
a memory model wrong about a run that ran is a finding of its own, not a reason to drop the row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from pydantic import ValidationError

from pipectl.artifacts.cluster import ClusterSpec
from pipectl.artifacts.model import ModelConfig, ModelFamily
from pipectl.artifacts.plan import Candidate, PlanRequest, Recompute, RecomputeChoice
from pipectl.artifacts.profile import EngineFeatures, ModelProfile
from pipectl.catalog import DeviceSpec, get_device
from pipectl.errors import PipectlError, UserInputError
from pipectl.io import validation_message
from pipectl.artifacts.calibration import CalibratedTerms, RunsCalibration
from pipectl.measured.runs import REQUIRED_COLUMNS, MeasuredRun, RunConditions
from pipectl.plan.flops import PRECISION_DTYPE
from pipectl.plan.search import plan
from pipectl.profile.derive import derive_profile

# A device no layout outgrows: the time model alone, for rows the memory model refuses.
UNBOUNDED_MEMORY_BYTES = 2**50
# Frameworks whose pipeline transfers hold both ranks until the receive is posted: DeepSpeed's
# pipeline engine sends and receives synchronously (deepspeed/runtime/pipe/p2p.py).
BLOCKING_PIPELINES = ("megatron-deepspeed", "deepspeed")
_RECOMPUTE = {
    "none": (RecomputeChoice.NEVER, Recompute.NONE),
    "full": (RecomputeChoice.LAYER, Recompute.LAYER),  # Megatron's "full": per-layer checkpointing
    "selective": (RecomputeChoice.SELECTIVE, Recompute.SELECTIVE),
}


@dataclass(frozen=True)
class Prediction:
    """A row and what pipectl predicts of it: its step (None with `problem` when it cannot be
    predicted), its predicted peak memory, and whether the memory model accepts the layout."""

    run: MeasuredRun
    predicted_seconds: float | None
    peak_memory_gib: float | None = None
    memory_refused: str | None = None  # the memory model's reason, for a run that did run
    problem: str | None = None
    # For a refused run: the lowest higher ZeRO stage under which the memory model fits it (None: none does).
    fits_with_zero_stage: int | None = None

    @property
    def error(self) -> float | None:
        """(predicted - measured) / measured."""
        if self.predicted_seconds is None:
            return None
        return self.predicted_seconds / self.run.measured_seconds - 1.0


def engine_features(conditions: RunConditions) -> EngineFeatures | None:
    """How the conditions' framework ran the model, in the planner's terms; None: as pipectl's own
    runtime runs it."""
    framework = conditions.framework.lower()
    megatron = framework.startswith("megatron")
    if not megatron and framework not in BLOCKING_PIPELINES:
        return None
    return EngineFeatures(
        name=conditions.framework,
        vocab_parallel=conditions.vocab_parallel,
        # Megatron fuses the scale-mask-softmax and the bias-GeLU (megatron/model/fused_*).
        fused_elementwise=megatron,
        dropout=conditions.dropout > 0,
        # Megatron partitions the blocks evenly over the stages ('type:transformer' in
        # Megatron-DeepSpeed's pipeline model).
        uniform_stages=megatron,
        gradient_reduce_overlap=conditions.gradient_reduce_overlap,
        blocking_p2p=framework in BLOCKING_PIPELINES,
        megatron_deepspeed_layer=framework == "megatron-deepspeed",
        source=conditions.source,
    )


@dataclass(frozen=True)
class Calibrated:
    """Fitted terms (`pipectl calibrate MEASURED.csv`, or a fit in progress) and the device whose rows take them."""

    device: str
    terms: CalibratedTerms

    @classmethod
    def of(cls, calibration: RunsCalibration | None) -> Calibrated | None:
        return None if calibration is None else cls(calibration.device, calibration.terms)


# The model's, cluster's and request's fields that a row's cells become, called by their columns
# (a figure beyond what one may hold is the cell's, not a field the user never wrote).
COLUMN_OF = {
    **{field: f"'{header}'" for field, header in REQUIRED_COLUMNS.items()},
    "micro_batch_size": f"'{REQUIRED_COLUMNS['micro_batch']}'",
    "devices": f"'{REQUIRED_COLUMNS['gpus']}'",
    "nodes": f"'{REQUIRED_COLUMNS['gpus']}' (as nodes)",
}


class Predictor:
    """Predicts rows under one set of conditions, deriving each model shape's profile once; with
    `calibration`, the rows of its device take its device, link and engine terms."""

    def __init__(self, conditions: RunConditions, runs: list[MeasuredRun], calibration: Calibrated | None = None) -> None:
        self.conditions = conditions
        self.calibration = calibration
        self.engine = engine_features(conditions)
        # Every micro-batch size a shape is measured at, derived at once.
        self.sizes: dict[tuple, set[int]] = {}
        for run in runs:
            self.sizes.setdefault((run.shape, self._device(run)), set()).add(run.micro_batch)
        self.profiles: dict[tuple, ModelProfile] = {}

    def _device(self, run: MeasuredRun) -> str:
        return run.device or self.conditions.device

    def _calibrated(self, run: MeasuredRun) -> bool:
        return self.calibration is not None and self.calibration.device == self._device(run)

    def device_spec(self, run: MeasuredRun) -> DeviceSpec:
        """The row's device: the catalog's entry, with the calibration's figures where they are of it."""
        device = get_device(self._device(run))
        return self.calibration.terms.device_spec(device) if self._calibrated(run) else device

    def engine_of(self, run: MeasuredRun) -> EngineFeatures | None:
        if not self._calibrated(run):
            return self.engine
        return self.calibration.terms.engine(self.engine, self.conditions.framework)

    def profile(self, run: MeasuredRun) -> ModelProfile:
        key = (run.shape, self._device(run))
        if key not in self.profiles:
            hidden, heads, layers, seq_len = run.shape
            config = ModelConfig(
                name=f"h{hidden}-a{heads}-l{layers}-s{seq_len}",
                family=ModelFamily.GPT,
                layers=layers,
                hidden=hidden,
                heads=heads,
                seq_len=seq_len,
                vocab=self.conditions.vocab,
                tied_embeddings=self.conditions.tied_embeddings,
                shape_only=True,
            )
            self.profiles[key] = derive_profile(
                config, self.device_spec(run), sorted(self.sizes[key]),
                dtype=PRECISION_DTYPE[self.conditions.precision], attention=self.conditions.attention,
                engine=self.engine_of(run),
            )  # fmt: skip
        return self.profiles[key]

    def cluster(self, run: MeasuredRun) -> ClusterSpec:
        per_node = self.conditions.devices_per_node
        links = self.conditions.cluster_links(self._device(run))
        node_type = {
            "name": "measured-nodes",
            "device": self._device(run),
            "devices_per_node": per_node,
            "nodes": math.ceil(run.gpus / per_node),
        }
        if self._calibrated(run):
            links.update(self.calibration.terms.links())
        if links:
            node_type["links"] = links
        return ClusterSpec(name="measured", node_types=[node_type])

    def request(self, run: MeasuredRun) -> PlanRequest:
        choice, _ = _RECOMPUTE[run.recompute or self.conditions.recompute]
        return PlanRequest(
            global_batch=run.global_batch,
            devices=run.gpus,
            tensor_parallel=run.tensor_parallel,
            pipeline_parallel=run.pipeline_parallel,
            data_parallel=run.data_parallel,
            micro_batch_size=run.micro_batch,
            schedule=run.schedule or self.conditions.schedule,
            zero_stages=[self.conditions.zero_stage if run.zero_stage is None else run.zero_stage],
            recompute=choice,
            include_all=True,
            for_deepspeed=False,
            morph=False,
            workers=1,
        )

    def predict(self, run: MeasuredRun) -> Prediction:
        try:
            profile, cluster, request = self.profile(run), self.cluster(run), self.request(run)
            pinned, refused = self._pinned(run, profile, cluster, request)
            if pinned is None:  # the memory model refuses a run that ran: the time model alone
                unbounded = profile.model_copy(update={"device_memory_bytes": UNBOUNDED_MEMORY_BYTES})
                pinned, _ = self._pinned(run, unbounded, cluster, request)
        except PipectlError as error:  # a shape or layout this version cannot plan: said on its row
            return Prediction(run, None, problem=error.message)
        except ValidationError as error:  # a figure beyond what a model, cluster or request may hold
            where = f"{run.source} line {run.line}".lstrip()
            raise UserInputError(f"{where}: {validation_message(error, names=COLUMN_OF)}") from None
        if pinned is None:
            return Prediction(run, None, problem=refused or "no candidate with this layout")
        return Prediction(
            run,
            pinned.predicted_step_seconds,
            peak_memory_gib=max(pinned.peak_memory_bytes) / 2**30,
            memory_refused=refused,
        )

    def _pinned(
        self, run: MeasuredRun, profile: ModelProfile, cluster: ClusterSpec, request: PlanRequest
    ) -> tuple[Candidate | None, str | None]:
        """The fastest candidate of the pinned layout with the row's recomputation, or None and why
        not (the planner's refusal, which names its first example)."""
        _, granularity = _RECOMPUTE[run.recompute or self.conditions.recompute]
        try:
            result = plan(profile, cluster, request)
        except PipectlError as error:
            return None, error.message
        matching = [c for c in result.candidates if c.recompute_granularity is granularity]
        if matching:
            return min(matching, key=lambda c: c.predicted_step_seconds), None
        return None, f"no candidate with {granularity.label} recomputation"

    def fitting_zero_stage(self, run: MeasuredRun) -> int | None:
        """The lowest ZeRO stage above the row's under which the memory model fits its layout, or None.

        A layout the memory model refuses though it ran says the model or the row's conditions are
        wrong. Under ZeRO-0 the model holds DeepSpeed's fp16 step at 24 bytes a parameter (its fp16
        optimizer converts every gradient to fp32, then concatenates the copies into one flat fp32
        gradient, while master weights and Adam's state are held: docs/design.md, 'Memory model'); a
        stage that splits that state over d fitting where stage 0 does not points at the conditions.
        """
        stage = self.conditions.zero_stage if run.zero_stage is None else run.zero_stage
        if run.data_parallel < 2:  # nothing to split
            return None
        profile, cluster, request = self.profile(run), self.cluster(run), self.request(run)
        for higher in range(stage + 1, 4):
            pinned, _ = self._pinned(run, profile, cluster, request.model_copy(update={"zero_stages": [higher]}))
            if pinned is not None:
                return higher
        return None


def predict_runs(
    runs: list[MeasuredRun], conditions: RunConditions, calibration: RunsCalibration | None = None,
    *, stage_hints: bool = False,
) -> list[Prediction]:
    """Every row's prediction, in the rows' order; with `stage_hints`, a row the memory model refuses
    also says the lowest higher ZeRO stage it fits under (`Predictor.fitting_zero_stage`)."""
    predictor = Predictor(conditions, runs, Calibrated.of(calibration))
    predictions = [predictor.predict(run) for run in runs]
    if stage_hints:
        predictions = [
            replace(p, fits_with_zero_stage=predictor.fitting_zero_stage(p.run)) if p.memory_refused else p
            for p in predictions
        ]
    return predictions

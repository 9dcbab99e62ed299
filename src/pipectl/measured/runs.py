"""Training runs measured on a cluster: a CSV of layouts and step times, and the conditions they share.

A row is one run: the model's shape, the GPUs, the global batch and the layout (t, d, p, micro-batch)
with its measured iteration time. Columns are read by their header, in any order, case and spacing
aside, so a cluster's own job log can be read as it is. Headers (those of vTrain's ground truth,
Bang et al., MICRO'24):

    # GPUs, global batch, micro batch, hidden size, attention heads, # layers, sequence length,
    tensor parallelism, data parallelism, pipeline parallelism, iteration time (ms)

and, optionally, per-row overrides of the conditions: `schedule`, `recompute`, `zero stage`,
`device`. Any other column is ignored (`Parameters (billion)` is read, a positive number, not used: pipectl
counts a shape's parameters itself). Two columns of one header are refused.

The conditions (`RunConditions`, a YAML file) say what every row shares and the CSV does not: the
device, the node size and links, the framework and how it ran the model (schedule, recomputation,
attention kernel, vocabulary, tied embeddings, vocabulary-parallel layers, dropout), the precision
and the ZeRO stage. A field this version does not know is refused, naming it: a condition silently
ignored would make every prediction wrong the same way.

    >>> import io
    >>> text = "# GPUs,global batch,micro batch,hidden size,attention heads,# layers,sequence length,"
    >>> text += "tensor parallelism,data parallelism,pipeline parallelism,iteration time (ms)\\n"
    >>> text += "8,32,4,1024,16,24,1024,2,2,2,219.73\\n"
    >>> [run] = parse_runs(io.StringIO(text), source="runs.csv")
    >>> run.layout_label, round(run.measured_seconds, 5), run.group
    ('t2 d2 p2 b4', 0.21973, 'h1024 a16 l24 s1024, 8 GPUs, B 32')
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from typing import IO, Literal

from pydantic import ConfigDict, Field, model_validator

from pipectl.artifacts.base import Strict
from pipectl.artifacts.calibration import RunsCalibration
from pipectl.artifacts.cluster import MAX_DEVICES_PER_NODE, MAX_GBYTES_PER_SECOND, MIN_GBYTES_PER_SECOND
from pipectl.artifacts.model import MAX_WIDTH
from pipectl.catalog import get_device
from pipectl.errors import UserInputError
from pipectl.io import input_file, load_model

# field -> header, as normalised by `_normal` (lower case, single spaces).
REQUIRED_COLUMNS = {
    "gpus": "# gpus",
    "global_batch": "global batch",
    "micro_batch": "micro batch",
    "hidden": "hidden size",
    "heads": "attention heads",
    "layers": "# layers",
    "seq_len": "sequence length",
    "tensor_parallel": "tensor parallelism",
    "data_parallel": "data parallelism",
    "pipeline_parallel": "pipeline parallelism",
    "iteration_ms": "iteration time (ms)",
}
OPTIONAL_COLUMNS = {
    "parameters_billion": "parameters (billion)",
    "schedule": "schedule",
    "recompute": "recompute",
    "zero_stage": "zero stage",
    "device": "device",
}
RECOMPUTE_VALUES = ("none", "full", "selective")
# Schedules a row can pin: a CSV says nothing of interleaving's chunks, so interleaved is not one of them.
SCHEDULE_VALUES = ("1f1b", "gpipe")
# Frameworks whose way of running a model pipectl knows (`predict.engine_features`); pipectl: its own.
FRAMEWORKS = ("megatron-deepspeed", "megatron-lm", "deepspeed", "pipectl")


class _Closed(Strict):
    # As every pipectl file: YAML's `true` is no vocabulary of 1, nor `.inf` a link's rate.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ConditionLinks(_Closed):
    """The links every row's nodes had (None: the catalog's figures for the device)."""

    intra_node_gbytes_per_second: float | None = Field(
        default=None, ge=MIN_GBYTES_PER_SECOND, le=MAX_GBYTES_PER_SECOND,
        description="GPU to GPU in a node, GB/s: the pipeline's transfers inside a node.",
    )
    intra_node_allreduce_gbytes_per_second: float | None = Field(
        default=None, ge=MIN_GBYTES_PER_SECOND, le=MAX_GBYTES_PER_SECOND,
        description="NCCL's bus bandwidth of a collective inside a node, GB/s (tensor-parallel all-reduces, "
        "gradient reductions within a node). Default: the catalog's measured figure for the row's device, else "
        "intra_node_gbytes_per_second.",
    )
    inter_node_gbits_per_second_per_node: float | None = Field(
        default=None, ge=8 * MIN_GBYTES_PER_SECOND, le=8 * MAX_GBYTES_PER_SECOND,
        description="A node's network bandwidth, Gb/s (all its GPUs together).",
    )


class RunConditions(_Closed):
    """What every row of a measured CSV shares (a row's own `schedule`, `recompute`, `zero stage` or
    `device` column overrides the field of that name)."""

    source: str | None = Field(default=None, description="Where the runs were measured: a paper, a cluster, a log.")
    device: str = Field(description="Catalog name of the GPUs (pipectl's configs/devices.yaml).")
    devices_per_node: int = Field(gt=0, le=MAX_DEVICES_PER_NODE, description="GPUs per node.")
    links: ConditionLinks = Field(default_factory=ConditionLinks)
    framework: Literal["megatron-deepspeed", "megatron-lm", "deepspeed", "pipectl"] = Field(
        description="The training framework that ran the rows."
    )
    schedule: Literal["1f1b", "gpipe"] = Field(default="1f1b", description="Pipeline schedule.")
    recompute: Literal["none", "full", "selective"] = Field(
        default="none", description="Activation recomputation: Megatron's full (per layer) or selective."
    )
    gradient_reduce_overlap: bool = Field(
        default=False, description="Whether the data-parallel all-reduce overlapped the last backward."
    )
    attention: Literal["flash", "unfused"] = Field(default="flash", description="The attention kernel.")
    vocab: int = Field(gt=0, le=MAX_WIDTH, description="Vocabulary size.")
    tied_embeddings: bool = Field(default=True, description="Whether the head reuses the token embedding.")
    vocab_parallel: bool = Field(
        default=False, description="Whether embedding, logits and loss are split by vocabulary over t (Megatron)."
    )
    dropout: float = Field(default=0.0, ge=0, lt=1, description="Dropout probability.")
    precision: Literal["fp16", "bf16", "fp32"] = Field(description="Training precision.")
    zero_stage: int = Field(default=0, ge=0, le=3, description="ZeRO stage.")

    @model_validator(mode="after")
    def _network_per_gpu_is_a_rate(self) -> "RunConditions":
        """A node's network shared by its GPUs is each one's share: that share must be a link's rate."""
        network = self.links.inter_node_gbits_per_second_per_node
        if network is not None and network / 8 / self.devices_per_node < MIN_GBYTES_PER_SECOND:
            raise ValueError(
                f"links.inter_node_gbits_per_second_per_node {network:g} over {self.devices_per_node} GPUs a node is "
                f"{network / 8 / self.devices_per_node:.3g} GB/s a GPU, under {MIN_GBYTES_PER_SECOND:g}"
            )
        return self

    def cluster_links(self, device: str | None = None) -> dict[str, float]:
        """The links the conditions state, as a cluster YAML's node type states them (GB/s; the
        network as a GPU's share of its node's); those they leave out are the catalog's.

        A GPU-to-GPU figure prices the transfers inside a node, not its collectives: an all-reduce
        inside a node runs at NCCL's bus bandwidth, which is neither the link's rate nor one figure
        a simulator may use for every group (vTrain, whose conditions state 150 GB/s, applies it
        only to all-reduces over more than 8 GPUs and its measured NCCL table below that). So
        collectives take the conditions' own all-reduce figure, else the catalog's measured one for
        `device` (a row's own device; default the conditions'), else the link's.
        """
        links: dict[str, float] = {}
        if self.links.intra_node_gbytes_per_second is not None:
            links["intra_node_bandwidth_gbytes_per_second"] = self.links.intra_node_gbytes_per_second
        allreduce = self.links.intra_node_allreduce_gbytes_per_second
        if allreduce is None and self.links.intra_node_gbytes_per_second is not None:
            allreduce = (get_device(device or self.device).intra_node_allreduce_bandwidth_gbytes_per_second
                         or self.links.intra_node_gbytes_per_second)
        if allreduce is not None:
            links["intra_node_allreduce_bandwidth_gbytes_per_second"] = allreduce
        if self.links.inter_node_gbits_per_second_per_node is not None:
            # A node's network in Gb/s, shared by its GPUs.
            links["inter_node_bandwidth_gbytes_per_second"] = (
                self.links.inter_node_gbits_per_second_per_node / 8 / self.devices_per_node
            )
        return links


def _device_named(name: str):
    """The catalog's device of `name`, in the catalog's own case or in lower case (`A100-80GB`)."""
    try:
        return get_device(name)
    except UserInputError:
        if name.lower() == name:
            raise
        return get_device(name.lower())


def load_conditions(path: str | os.PathLike[str]) -> RunConditions:
    """The conditions file, checked: a wrong or unknown field, or a device the catalog does not
    know, is one error naming it."""
    conditions = load_model(RunConditions, path)
    try:
        device = _device_named(conditions.device)
    except UserInputError as exc:
        raise UserInputError(f"{path}: device: {exc.message}", hint=exc.hint) from None
    return conditions.model_copy(update={"device": device.name})


@dataclass(frozen=True)
class MeasuredRun:
    """One row: the model's shape, the layout and what it measured (seconds)."""

    line: int  # in the CSV, for messages
    gpus: int
    global_batch: int
    micro_batch: int
    hidden: int
    heads: int
    layers: int
    seq_len: int
    tensor_parallel: int
    data_parallel: int
    pipeline_parallel: int
    measured_seconds: float
    parameters_billion: float | None = None
    schedule: str | None = None
    recompute: str | None = None
    zero_stage: int | None = None
    device: str | None = None
    source: str = ""  # the CSV as given, for messages

    @property
    def layout_label(self) -> str:
        return f"t{self.tensor_parallel} d{self.data_parallel} p{self.pipeline_parallel} b{self.micro_batch}"

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.hidden, self.heads, self.layers, self.seq_len)

    @property
    def group(self) -> str:
        """The rows whose layouts compete: one model shape on one GPU count (of one kind, where a row
        names its device) at one global batch."""
        gpus = f"{self.gpus} {self.device} GPUs" if self.device else f"{self.gpus} GPUs"
        return f"h{self.hidden} a{self.heads} l{self.layers} s{self.seq_len}, {gpus}, B {self.global_batch}"


def read_runs(path: str | os.PathLike[str]) -> list[MeasuredRun]:
    """Every row of a measured CSV (see the module docstring)."""
    try:
        with open(input_file(path), newline="", encoding="utf-8-sig") as handle:
            return parse_runs(handle, source=str(path))
    except UnicodeDecodeError:
        raise UserInputError(f"{path} is not UTF-8 text: save the CSV as UTF-8") from None


def _normal(header: str) -> str:
    return " ".join(header.strip().lower().split())


def parse_runs(handle: IO[str], *, source: str) -> list[MeasuredRun]:
    reader = csv.reader(handle)
    header = next(reader, None)
    while header is not None and not any(cell.strip() for cell in header):  # blank lines before the header
        header = next(reader, None)
    if header is None:
        raise UserInputError(f"{source} is empty: no header row")
    names = [_normal(name) for name in header]
    position = {name: index for index, name in enumerate(names)}
    repeated = sorted({name for name in names if name and names.count(name) > 1})
    if repeated:
        raise UserInputError(f"{source} has two columns named {', '.join(repr(r) for r in repeated)}")
    missing = [name for name in REQUIRED_COLUMNS.values() if name not in position]
    if len(missing) == len(REQUIRED_COLUMNS):  # not a column of ours: not this file's header
        separator = next((c for c in ";\t|" if len(header) == 1 and c in header[0]), None)
        raise UserInputError(
            f"{source} line {reader.line_num} is not the header of measured runs: "
            + (f"its columns are separated by {separator!r}, not commas" if separator else "it names none of their columns"),
            hint="the first line names the columns, comma-separated: " + ", ".join(REQUIRED_COLUMNS.values()),
        )
    if missing:
        raise UserInputError(
            f"{source} has no column {', '.join(repr(m) for m in missing)}",
            hint="the header must name: " + ", ".join(REQUIRED_COLUMNS.values()),
        )
    runs = []
    try:
        for row in reader:
            if len(row) > len(header) and any(cell.strip() for cell in row[len(header):]):
                # A value without a column (a decimal comma, `372,16`, splits one): read, it would shift nothing
                # but be dropped, and the row's time would be 372 ms.
                raise UserInputError(f"{source} line {reader.line_num}: {len(row)} values, the header names "
                                     f"{len(header)} columns", hint="a decimal comma? write 372.16, or quote the value")
            if row and any(cell.strip() for cell in row):
                runs.append(_run_of(row, position, reader.line_num, source))
    except csv.Error as error:
        raise UserInputError(f"{source} line {reader.line_num}: {error}") from None
    if not runs:
        raise UserInputError(f"{source} has a header but no rows")
    return runs


def _cell(row: list[str], position: dict[str, int], header: str) -> str | None:
    index = position.get(header)
    if index is None or index >= len(row) or not row[index].strip():
        return None
    return row[index].strip()


# A step shorter than this is no measurement (one kernel launch takes longer): a unit or a typo, and
# relative errors against it overflow.
SHORTEST_STEP_MS = 1e-3


def _run_of(row: list[str], position: dict[str, int], line: int, source: str) -> MeasuredRun:
    where = f"{source} line {line}"
    values: dict[str, object] = {}
    for field, header in REQUIRED_COLUMNS.items():
        text = _cell(row, position, header)
        if text is None:
            raise UserInputError(f"{where}: no value in column '{header}'")
        if field == "iteration_ms":
            milliseconds = _positive_number(text, header, where)
            if milliseconds < SHORTEST_STEP_MS:
                raise UserInputError(f"{where}: '{header}' is {text!r}: no training step takes under a microsecond",
                                     hint="the column holds milliseconds per iteration")
            values["measured_seconds"] = milliseconds / 1e3
        else:
            values[field] = _positive_integer(text, header, where)
    optional = {field: _cell(row, position, header) for field, header in OPTIONAL_COLUMNS.items()}
    if optional["parameters_billion"] is not None:
        values["parameters_billion"] = _positive_number(optional["parameters_billion"], "parameters (billion)", where)
    if optional["zero_stage"] is not None:
        stage = _positive_integer(optional["zero_stage"], "zero stage", where, allow_zero=True)
        if stage > 3:
            raise UserInputError(f"{where}: zero stage {stage} is not 0, 1, 2 or 3")
        values["zero_stage"] = stage
    if optional["recompute"] is not None:
        recompute = optional["recompute"].lower()
        if recompute not in RECOMPUTE_VALUES:
            raise UserInputError(f"{where}: recompute '{optional['recompute']}' is not one of {', '.join(RECOMPUTE_VALUES)}")
        values["recompute"] = recompute
    if optional["schedule"] is not None:
        schedule = optional["schedule"].lower()
        if schedule not in SCHEDULE_VALUES:
            raise UserInputError(f"{where}: schedule '{optional['schedule']}' is not one of {', '.join(SCHEDULE_VALUES)}")
        values["schedule"] = schedule
    if optional["device"] is not None:
        try:
            values["device"] = _device_named(optional["device"]).name
        except UserInputError as exc:
            raise UserInputError(f"{where}: device: {exc.message}", hint=exc.hint) from None
    run = MeasuredRun(line=line, source=source, **values)  # type: ignore[arg-type]
    if run.hidden % run.heads:
        raise UserInputError(f"{where}: hidden size {run.hidden} is not a multiple of its {run.heads} attention heads")
    devices = run.tensor_parallel * run.data_parallel * run.pipeline_parallel
    if devices != run.gpus:
        raise UserInputError(
            f"{where}: t x d x p = {run.tensor_parallel} x {run.data_parallel} x {run.pipeline_parallel} = {devices}, "
            f"not the row's {run.gpus} GPUs"
        )
    per_step = run.micro_batch * run.data_parallel  # Megatron and DeepSpeed run B = b x m x d, m whole
    if run.global_batch % per_step:
        raise UserInputError(
            f"{where}: global batch {run.global_batch} is not a multiple of micro batch x data parallelism = "
            f"{run.micro_batch} x {run.data_parallel} = {per_step}"
        )
    return run


def _positive_integer(text: str, header: str, where: str, *, allow_zero: bool = False) -> int:
    try:
        number = float(text)
    except ValueError:
        number = float("nan")
    if not number.is_integer() or number < (0 if allow_zero else 1):
        kind = "a whole number >= 0" if allow_zero else "a positive whole number"
        raise UserInputError(f"{where}: '{header}' is {text!r}, not {kind}")
    return int(number)


def _positive_number(text: str, header: str, where: str) -> float:
    try:
        number = float(text)
    except ValueError:
        number = float("nan")
    if not number > 0 or number == float("inf"):
        raise UserInputError(f"{where}: '{header}' is {text!r}, not a positive number")
    return number


def load_calibration(path: str | os.PathLike[str], conditions: RunConditions | None = None) -> RunsCalibration:
    """The calibration file, checked; with `conditions`, refused unless fitted to runs of their
    framework (its engine terms are that framework's)."""
    calibration = load_model(RunsCalibration, path)
    if conditions is not None and calibration.framework != conditions.framework:
        raise UserInputError(
            f"{path} was fitted to {calibration.framework} runs, these ran on {conditions.framework}: its engine "
            "terms are another framework's",
            hint="calibrate with runs of this framework: pipectl calibrate MEASURED.csv --conditions CONDITIONS.yaml",
        )
    return calibration

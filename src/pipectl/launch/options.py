"""`LaunchOptions`: everything `pipectl launch` takes besides the plan, declared once.

Each field is one option: its description is its `--help` text, its `Opt` the flag and the
config-file section and key that set it (`pipectl.config`). job.json stores the effective options
by section (`JobSpec.options`); `launch --resume` reads them back, so that a resume continues the
run instead of re-defaulting it, and `launch --print-config` writes them as a commented TOML file.

Values arrive as a person types them (`--checkpoint-every 15m`, `--hosts n1,n2`, `--data
corpus.txt`); the validators parse them into what the job needs, and the serialisers write them
back in that same form, so that a printed config reads back to the same options.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any

from pydantic import ConfigDict, Field, ValidationInfo, field_serializer, field_validator

from pipectl.artifacts.base import Strict
from pipectl.artifacts.cluster import SlurmSpec
from pipectl.artifacts.run import (
    MAX_SEED,
    DataKind,
    DataSpec,
    ElasticRange,
    Engine,
    LrSchedule,
    Precision,
    TrainingSettings,
    check_host_address,
)
from pipectl.config import Layered, Opt, OptionValueError, given, layered, stored_layer
from pipectl.errors import PipectlError, UserInputError
from pipectl.words import count
from pipectl.io import read_mapping
from pipectl.paths import given_file, is_factory_reference, stored_reference

TRAINING_DEFAULTS = TrainingSettings()
LOCAL_STEPS = 20  # a run on this machine's CPU: a try-out, not a training
# At scale (GPUs, or several nodes) the defaults of GPT-3's training (Brown et al. 2020, appendix
# B): AdamW with weight decay 0.1, a linear warm-up, then cosine decay to 10 % of the peak.
SCALE_WEIGHT_DECAY = 0.1
SCALE_MIN_LR_RATIO = 0.1
SCALE_WARMUP_FRACTION = 0.01

_INTERVAL_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}
MAX_INTERVAL_SECONDS = 366 * 24 * 3600.0


def parse_checkpoint_interval(text: str) -> tuple[int, float, bool]:
    """`--checkpoint-every`: K steps, a wall time (`90s`, `15m`, `2h`), or `auto` (Young/Daly from
    the measured stall and the job's expected time between failures); returns (steps, seconds, auto).

    >>> parse_checkpoint_interval("100"), parse_checkpoint_interval("15m"), parse_checkpoint_interval("auto")
    ((100, 0.0, False), (0, 900.0, False), (0, 0.0, True))
    """
    value = text.strip().lower()
    if value == "auto":
        return 0, 0.0, True
    if value.isdigit():
        if len(value) > 18:  # job.json holds a 64-bit integer
            raise OptionValueError("more steps than a 64-bit integer holds")
        return int(value), 0.0, False
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([smh])", value)
    if match is None or float(match.group(1)) <= 0:
        raise OptionValueError(
            "not a step count, a wall time or 'auto'", hint="e.g. --checkpoint-every 100 (steps), 15m, 90s, 2h, or auto"
        )
    seconds = float(match.group(1)) * _INTERVAL_UNITS[match.group(2)]
    if seconds > MAX_INTERVAL_SECONDS:
        raise OptionValueError("longer than a year", hint="a run checkpoints at its end anyway: give 0 for that alone")
    return 0, seconds, False


def parse_data(text: str) -> DataSpec:
    """`builtin` (default corpus), `synthetic`, a path to a token or text file, or a dataset
    function `package.module:function`."""
    if text in (DataKind.BUILTIN.value, DataKind.SYNTHETIC.value):
        return DataSpec(kind=DataKind(text))
    path = given_file(text)
    if path is not None:
        return DataSpec(kind=DataKind.FILE, path=str(path))
    if is_factory_reference(text):
        return DataSpec(kind=DataKind.DATASET, reference=text)
    if Path(text).is_dir():
        raise OptionValueError("a directory, not a data file")
    if Path(text).suffix:  # a file name: one that is not there
        raise OptionValueError("no such data file")
    raise OptionValueError("neither 'builtin', 'synthetic', an existing file nor a dataset 'package.module:function'")


def data_text(data: DataSpec) -> str:
    """What `parse_data` reads back as `data`."""
    return data.path or data.reference or data.kind.value


def parse_elastic(text: str) -> ElasticRange:
    """`MIN:MAX` node counts, e.g. `1:2`."""
    low, sep, high = text.partition(":")
    if not sep or not low.isdigit() or not high.isdigit() or int(low) < 1 or int(low) > int(high):
        raise OptionValueError("not MIN:MAX node counts with 1 <= MIN <= MAX (e.g. 1:2)")
    return ElasticRange(min_nodes=int(low), max_nodes=int(high))


def parse_hosts(text: str) -> list[str]:
    """`--hosts h1,h2,...`: each host once, none empty.

    >>> parse_hosts("n1, n2")
    ['n1', 'n2']
    """
    hosts = [h.strip() for h in text.split(",")] if isinstance(text, str) else [str(h) for h in text]
    if any(not h for h in hosts):
        raise OptionValueError("an empty entry", hint="give host names separated by commas")
    # A host name or address: letters, digits, '.', '-', '_' (and ':' of an IPv6 address); it goes
    # into launch commands and hostfiles, where a blank or a ';' would mean something else.
    odd = next((h for h in hosts if not re.fullmatch(r"[A-Za-z0-9._:-]+", h)), None)
    if odd is not None:
        raise OptionValueError(f"{odd!r} is not a host name (letters, digits, '.', '-', '_')",
                               hint="give host names separated by commas")
    repeated = next((h for i, h in enumerate(hosts) if h in hosts[:i]), None)
    if repeated is not None:
        raise OptionValueError(f"names {repeated} twice: one entry per node", hint="a node's ranks are its slots, not repeated names")
    return hosts


def read_hostfile(path: str | os.PathLike[str]) -> list[tuple[str, int]]:
    """A hostfile in DeepSpeed's format: one `host slots=N` line per node, `#` comments; (host,
    slots) in the file's order.

    >>> import tempfile, pathlib
    >>> f = pathlib.Path(tempfile.mkdtemp()) / "hostfile"
    >>> _ = f.write_text("# two nodes\\nnode1 slots=8\\nnode2 slots=8  # spare\\n")
    >>> read_hostfile(f)
    [('node1', 8), ('node2', 8)]
    """
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise OptionValueError(f"cannot be read ({exc.__class__.__name__}: {exc})") from None
    entries = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"(\S+)\s+slots\s*=\s*(\d+)", line)
        if match is None or int(match.group(2)) < 1:
            raise OptionValueError(f"line {number} is not 'host slots=N': {line[:80]!r}", hint="DeepSpeed's hostfile format")
        entries.append((match.group(1), int(match.group(2))))
    if not entries:
        raise OptionValueError("names no host", hint="one 'host slots=N' line per node")
    parse_hosts([host for host, _ in entries])  # each host once
    return entries


class LaunchOptions(Strict, Layered):
    """What the user chose besides the plan: `pipectl launch`'s flags, its config file's values,
    or a resumed run's. (`Strict`: numbers are finite numbers, never a boolean read as one.)"""

    model_config = ConfigDict(frozen=True, validate_default=False)

    # Flags of one invocation: never read from a file nor stored.
    resume: Annotated[bool, Opt(None)] = Field(default=False, description="Continue an existing run from its checkpoint.")
    force: Annotated[bool, Opt(None)] = Field(default=False, description="Delete an existing run directory first.")
    change_global_batch: Annotated[bool, Opt(None)] = Field(
        default=False,
        description="With --resume: the plan's global batch differs from the run's on purpose (recorded in job.json).",
    )

    model: Annotated[str | None, Opt("model", key="reference", path=True)] = Field(
        default=None,
        description="Model reference: a shipped name, a model YAML, hf:DIR or package.module:factory (default: the "
        "plan's).",
    )
    data: Annotated[DataSpec, Opt("data", key="source", cli=str, path=True)] = Field(
        default_factory=DataSpec,
        description="'builtin' corpus, 'synthetic', a token file (.npy, .bin), a text file (.txt, .md), or a dataset "
        "function package.module:function.",
    )

    steps: Annotated[int | None, Opt("training")] = Field(
        default=None,
        gt=0,
        le=2**63 - 1,
        description=f"Optimizer steps in total (default {LOCAL_STEPS} for a run on this machine's CPU; a GPU or "
        "multi-node job must say).",
    )
    seed: Annotated[int, Opt("training")] = Field(default=0, ge=0, le=MAX_SEED, description="Seed of weights and data order.")
    precision: Annotated[Precision | None, Opt("training")] = Field(
        default=None, description="fp32, bf16 or fp16; default: the plan's (its profile's dtype), which it must match."
    )
    learning_rate: Annotated[float | None, Opt("training", key="lr", flag="--lr")] = Field(
        default=None, gt=0, le=10, description=f"AdamW (peak) learning rate (default {TRAINING_DEFAULTS.learning_rate:g})."
    )
    weight_decay: Annotated[float | None, Opt("training")] = Field(
        default=None,
        ge=0,
        le=10,
        description=f"AdamW weight decay (default {SCALE_WEIGHT_DECAY:g} on GPUs or several nodes, else 0).",
    )
    gradient_clipping: Annotated[float, Opt("training")] = Field(
        default=TRAINING_DEFAULTS.gradient_clipping, ge=0, le=1e6, description="Clip the global gradient norm to this (0: no clipping)."
    )
    lr_schedule: Annotated[LrSchedule | None, Opt("training")] = Field(
        default=None,
        description="constant (WarmupLR with --warmup-steps), warmup-decay or warmup-cosine (default: warmup-cosine on "
        "GPUs or several nodes, else constant).",
    )
    warmup_steps: Annotated[int | None, Opt("training")] = Field(
        default=None,
        ge=0,
        le=2**31,
        description="Steps of linear learning-rate warm-up (default: 1% of the steps with a decaying schedule, else 0).",
    )

    checkpoint_every: Annotated[str | None, Opt("checkpoint", key="every")] = Field(
        default=None,
        description="Checkpoint every K steps, every wall time (15m, 90s, 2h), or 'auto' (Young/Daly from the measured "
        "stall and --mtbf-hours); 0: only at the end and on SIGTERM (default: auto on GPUs or several nodes, else 0).",
    )
    keep_checkpoints: Annotated[int, Opt("checkpoint", key="keep")] = Field(
        default=3, gt=0, le=2**31, description="Verified checkpoints to keep."
    )
    mtbf_hours: Annotated[float | None, Opt("checkpoint")] = Field(
        default=None,
        ge=0.001,
        description="Expected hours between failures of the whole job, for --checkpoint-every auto (default: 50,000 "
        "device-hours / devices).",
    )
    train_without_checkpoints: Annotated[bool, Opt("checkpoint")] = Field(
        default=False,
        description="When the disk has no room for the run's first checkpoint, train on without one instead of "
        "stopping there (a failure then loses every step trained).",
    )
    recover_in_memory: Annotated[bool, Opt("checkpoint")] = Field(
        default=False,
        description="Engine local, d >= 2: one torchrun per data-parallel replica, each rank keeping a copy of its "
        "neighbour replica's state after every step, so that a lost replica is recovered from the survivors' memory "
        "without a checkpoint.",
    )

    engine: Annotated[Engine, Opt("cluster")] = Field(default=Engine.LOCAL, description="How to start the ranks.")
    cluster: Annotated[str | None, Opt("cluster", key="name", path=True)] = Field(
        default=None, description="Cluster name or YAML the job runs on (default: the plan's)."
    )
    nodes: Annotated[int | None, Opt("cluster")] = Field(
        default=None,
        gt=0,
        le=2**31,
        description="Nodes for torchrun/deepspeed/slurm (default: the plan's devices over the cluster's devices per node).",
    )
    hosts: Annotated[list[str] | None, Opt("cluster", cli=str)] = Field(
        default=None,
        description="Comma-separated node names, the first the rendezvous head (torchrun) and the DeepSpeed "
        "hostfile's hosts (default: the Slurm allocation's nodes, when launch runs inside one).",
    )
    hostfile: Annotated[str | None, Opt("cluster", path=True)] = Field(
        default=None, description="The nodes as a DeepSpeed hostfile ('host slots=N' per line), instead of --hosts."
    )
    master_addr: Annotated[str | None, Opt("cluster")] = Field(
        default=None,
        description="Rendezvous/master address (default: loopback on one node, this host for torchrun, the first --hosts "
        "entry for deepspeed, the allocation's first node for slurm).",
    )
    master_port: Annotated[int | None, Opt("cluster")] = Field(
        default=None, ge=1, le=65535, description="Rendezvous/master port 1..65535 (default: a free one)."
    )
    elastic: Annotated[ElasticRange | None, Opt("cluster", cli=str)] = Field(
        default=None, description="torchrun elastic node range MIN:MAX (engine torchrun)."
    )
    slurm: Annotated[
        SlurmSpec, Opt("slurm", table=True, flags=(("partition", "--partition"), ("account", "--account"), ("time", "--time-limit"),
                                      ("requeue_limit", "--requeue-limit")))
    ] = Field(default_factory=SlurmSpec, description="The sbatch script's settings, over the cluster file's slurm: section.")

    collective_timeout: Annotated[float | None, Opt("monitor")] = Field(
        default=None,
        ge=1.0,
        le=7 * 24 * 3600.0,
        description="Seconds a rank waits in a collective for a silent peer before the job fails (default: 10 predicted "
        "steps, at least 120 s, plus a checkpoint write).",
    )

    log_every: Annotated[int, Opt("monitor")] = Field(
        default=10,
        ge=0,
        le=2**31,
        description="Rank 0 prints a one-line step summary (loss, lr, gradient norm, tokens/s, MFU, step time) every "
        "this many steps to its output: logs/engine.log, or a Slurm job's slurm-ID.out (0: never).",
    )
    tensorboard: Annotated[bool, Opt("monitor")] = Field(
        default=False,
        description="Write TensorBoard scalars against the step to RUN/tensorboard/ (the tensorboard package: "
        "pip install 'pipectl[monitor]').",
    )
    wandb: Annotated[str | None, Opt("monitor")] = Field(
        default=None,
        pattern=r"^[A-Za-z0-9_.-]{1,128}$",
        description="Log each step to Weights & Biases in this project, one W&B run for the whole run (resumes, "
        "requeues and resizes included); WANDB_MODE=offline writes it under RUN/wandb/ (pip install 'pipectl[wandb]').",
    )

    ds_config_overlay: Annotated[dict[str, Any], Opt("deepspeed", key="overlay", cli=Path, path=True)] = Field(
        default_factory=dict,
        description="JSON or YAML merged into the DeepSpeed config (monitor, optimizer params, ...); keys the plan owns "
        "are refused. Validated by DeepSpeed's parser. In a config file: a file's path, or the keys inline.",
    )

    # What the run records about itself, not options: set by launch, kept by every resume.
    import_root: str | None = None  # where a factory is imported from; default: this process's working directory
    wandb_run_id: str | None = None  # the W&B run this run logs to, made at its first launch
    as_given: dict[str, str] = Field(default_factory=dict)  # the model and data as typed (job.json's `as_given`)

    @field_validator("model")
    @classmethod
    def _model_resolved(cls, value: str | None) -> str | None:
        """A YAML or hf: directory by path: absolute, once (ranks, resume and resize run elsewhere)."""
        return None if value is None else stored_reference(value)

    @field_validator("hostfile")
    @classmethod
    def _hostfile_read(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None or (info.context or {}).get("stored"):
            return value
        read_hostfile(value)
        return str(Path(value).resolve())

    @field_validator("master_addr")
    @classmethod
    def _host_address(cls, value: str | None) -> str | None:
        return None if value is None else check_host_address(value)

    @field_validator("data", mode="before")
    @classmethod
    def _data_parsed(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, str) and (info.context or {}).get("stored") and Path(value).is_absolute():
            return DataSpec(kind=DataKind.FILE, path=value)  # a run's record: the file may be gone since
        if isinstance(value, dict):  # a config file's table: not how a source is named (it read as 'builtin')
            raise ValueError("the data is named by a string: builtin, synthetic, a file's path or package.module:function")
        return parse_data(value) if isinstance(value, str) else value

    @field_serializer("data")
    def _data_text(self, data: DataSpec) -> str:
        return data_text(data)

    @field_validator("checkpoint_every", mode="before")
    @classmethod
    def _interval_parsed(cls, value: Any) -> Any:
        if isinstance(value, (int, float)) and not isinstance(value, bool):  # a config file's number
            value = str(value)  # parsed as typed: -4 and 4.5 are refused in its words, not as "not a string"
        if isinstance(value, str):
            parse_checkpoint_interval(value)
            return value.strip().lower()
        return value

    @field_validator("hosts", mode="before")
    @classmethod
    def _hosts_parsed(cls, value: Any) -> Any:
        return parse_hosts(value) if isinstance(value, (str, list)) else value

    @field_validator("elastic", mode="before")
    @classmethod
    def _elastic_parsed(cls, value: Any) -> Any:
        return parse_elastic(value) if isinstance(value, str) else value

    @field_serializer("elastic")
    def _elastic_text(self, elastic: ElasticRange | None) -> str | None:
        return None if elastic is None else f"{elastic.min_nodes}:{elastic.max_nodes}"

    @field_validator("ds_config_overlay", mode="before")
    @classmethod
    def _overlay_read(cls, value: Any) -> Any:
        """A file's path is read (its contents are data, kept in job.json); a mapping is the overlay."""
        if isinstance(value, (str, Path)):
            try:
                return read_mapping(value)
            except PipectlError as exc:
                raise OptionValueError(exc.message, exc.hint) from None
        return value

    @property
    def interval(self) -> tuple[int, float, bool]:
        """`checkpoint_every` as (steps, seconds, auto)."""
        return parse_checkpoint_interval(self.checkpoint_every or "0")


def resolve_defaults(options: LaunchOptions, *, at_scale: bool, what: str) -> tuple[LaunchOptions, list[str]]:
    """`options` with every training default left unset filled in, and one note per default
    chosen (`launch` prints them as its effective settings). A job `at_scale` (GPUs, or several
    nodes) must name its steps, and gets a warmed-up cosine schedule with weight decay and
    `--checkpoint-every auto`; a run on this machine's CPU gets a try-out's defaults. `what` names
    the job in the refusal, e.g. 'a job on 384 nodes of 8 GPUs'.

    >>> o, notes = resolve_defaults(LaunchOptions(), at_scale=False, what="")
    >>> o.steps, o.lr_schedule.value, o.checkpoint_every, len(notes)
    (20, 'constant', '0', 6)
    >>> o, _ = resolve_defaults(LaunchOptions(steps=1000), at_scale=True, what="")
    >>> o.lr_schedule.value, o.warmup_steps, o.weight_decay, o.checkpoint_every
    ('warmup-cosine', 10, 0.1, 'auto')
    """
    if options.steps is None and at_scale:
        raise UserInputError(
            f"{what} needs its length: --steps N (or training.steps in --config)",
            hint=f"the {LOCAL_STEPS} steps of a try-out on this machine are no default for a real training",
        )
    steps = options.steps or LOCAL_STEPS
    schedule = options.lr_schedule or (LrSchedule.WARMUP_COSINE if at_scale else LrSchedule.CONSTANT)
    decays = schedule is not LrSchedule.CONSTANT
    chosen = {
        "steps": steps,
        "learning_rate": options.learning_rate or TRAINING_DEFAULTS.learning_rate,
        "lr_schedule": schedule,
        "warmup_steps": options.warmup_steps if options.warmup_steps is not None
        else (min(steps - 1, max(1, round(steps * SCALE_WARMUP_FRACTION))) if decays else 0),
        "weight_decay": options.weight_decay if options.weight_decay is not None
        else (SCALE_WEIGHT_DECAY if at_scale else TRAINING_DEFAULTS.weight_decay),
        "checkpoint_every": options.checkpoint_every or ("auto" if at_scale else "0"),
    }  # fmt: skip
    if options.mtbf_hours is not None and chosen["checkpoint_every"] != "auto" and not options.resume:
        # Only `auto` reads it: a figure that changes nothing would be believed to.
        interval = given(options, "checkpoint_every") if options.checkpoint_every else "--checkpoint-every 0 (the default here)"
        raise UserInputError(
            f"{given(options, 'mtbf_hours')} chooses the interval of --checkpoint-every auto, but the interval is {interval}",
            hint="add --checkpoint-every auto, or leave out --mtbf-hours",
        )
    words = {
        "steps": f"steps {steps}" + ("" if at_scale else " (a try-out on this machine)"),
        "learning_rate": f"lr {chosen['learning_rate']:g}",
        "lr_schedule": f"lr schedule {schedule.value}",
        "warmup_steps": f"warm-up {count(chosen['warmup_steps'], 'step')}",
        "weight_decay": f"weight decay {chosen['weight_decay']:g}",
        "checkpoint_every": "checkpoint every " + ("auto (Young/Daly)" if chosen["checkpoint_every"] == "auto"
                                                  else "0 (only at the end and on a stop)"),
    }  # fmt: skip
    notes = [words[name] for name in chosen if getattr(options, name) is None]
    return options.model_copy(update=chosen), notes


def resumed_failure_rate(options: LaunchOptions, passed: set[str]) -> LaunchOptions:
    """A resume's `--mtbf-hours`, which only `--checkpoint-every auto` reads: given on this launch
    (a flag or its config file) beside another interval, refused, as `resolve_defaults` refuses it
    for a new run; the run's own, once its interval is no longer auto, dropped (kept, it would be
    stored and printed by `--print-config` beside the interval that ignores it)."""
    if options.mtbf_hours is None or options.checkpoint_every == "auto":
        return options
    if "mtbf_hours" not in passed:
        return options.model_copy(update={"mtbf_hours": None})
    interval = given(options, "checkpoint_every") if "checkpoint_every" in passed else (
        f"the run's --checkpoint-every {options.checkpoint_every}")
    raise UserInputError(
        f"{given(options, 'mtbf_hours')} chooses the interval of --checkpoint-every auto, but the interval is {interval}",
        hint="add --checkpoint-every auto, or leave out --mtbf-hours",
    )


def check_stored_options(sections: dict[str, dict[str, Any]], source: str | os.PathLike[str]) -> LaunchOptions:
    """A run's stored options (job.json's `options`) as `LaunchOptions`; a value they cannot hold
    is refused naming the file, section and key. Files they name need not exist any more."""
    return layered(LaunchOptions, [stored_layer(LaunchOptions, sections, source)], context={"stored": True})

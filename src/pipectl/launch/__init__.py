"""`pipectl launch`: a plan -> a validated DeepSpeed config, a run directory, a real launcher command.

    prepared = prepare_launch(plan, "runs/demo", LaunchOptions(steps=20, checkpoint_every=5))
    exit_code = run_engine(prepared.command, prepared.run_dir, lock=prepared.lock)

Everything that can be checked is checked before any process starts: the model builds and has the
plan's layer count, the schedule is runnable in DeepSpeed's engine, the global batch is kept, the
precision is the one the plan was made for, a node has a GPU for each of its ranks, and DeepSpeed's
own parser accepts the config (`dsconfig`).
"""

from __future__ import annotations

import importlib.util
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from pipectl import __version__
from pipectl.artifacts.cluster import ClusterSpec, SlurmSpec
from pipectl.artifacts.layout import layout_label
from pipectl.artifacts.plan import Candidate, Plan, Engine as PlanEngine
from pipectl.artifacts.profile import ModelProfile
from pipectl.artifacts.run import JOB_FILE, DataKind, DataSpec, Engine, JobSpec, NodeGroup, Precision, TrainingSettings
from pipectl.cluster import busier_note, host_state, load_cluster, plan_cluster_spec
from pipectl.errors import PipectlError, UserInputError
from pipectl.config import Layer, given, layered, option_fields, stored_layer, to_sections
from pipectl.io import load_model, validation_message
from pipectl.launch.options import SCALE_MIN_LR_RATIO, LaunchOptions, resolve_defaults, resumed_failure_rate
from pipectl.runtime.engines.dsconfig import overlay_adam, validated_config
from pipectl.launch.engines import LaunchCommand, build_command
from pipectl.launch.supervise import run_engine
from pipectl.launch.nodes import check_hostfile_slots, check_named_nodes, job_nodes, master_address, node_hosts
from pipectl.launch.placement import check_cluster_runs, compute_slowdowns, node_groups, plan_accelerator, plan_kinds
from pipectl.rundir.lock import RunLock, lock_run_dir
from pipectl.launch.prepare import check_run_dir, forced_away, prepare_run_dir, write_run_files
from pipectl.rundir.run import is_run_dir
from pipectl.launch.prepare import read_run
from pipectl.rundir.checkpoints import recover_staged, resume_point
from pipectl.runtime.engines.dsinit import free_port
from pipectl.paths import hf_tokenizer_file, import_root, stored_reference
from pipectl.planfile import plan_profile_path
from pipectl.words import count

__all__ = ["LaunchOptions", "PreparedLaunch", "build_job", "effective_options", "prepare_launch", "run_engine"]


# Where the options naming the job's nodes are stored (job.json's `options`): field -> (section, key).
NODE_NAMES = {f.name: (f.section, f.key) for f in option_fields(LaunchOptions) if f.name in ("hosts", "hostfile")}


def effective_options(
    run_dir: str | os.PathLike[str], layers: list[Layer], plan: Plan | None = None, *, as_given: dict[str, str] | None = None
) -> LaunchOptions:
    """This launch's options: `layers` (a config file, the flags) over the model's defaults and, on
    `--resume`, over the run's stored options (job.json's `options`): a resume continues the run,
    it does not re-default it. `plan`: the plan resumed (an in-memory recovery is kept only while
    it has replicas); `as_given`: the model and data as typed, for job.json."""
    path = Path(run_dir)
    passed = {name for layer in layers for name in layer.values}
    resume = any(layer.values.get("resume") for layer in layers)
    if not resume or not is_run_dir(path):
        return layered(LaunchOptions, layers, as_given=as_given or {})
    files = read_run(path)
    job = files.job
    stored = job.options or legacy_options(job, files.ds_config)
    engine = next((layer.values["engine"] for layer in reversed(layers) if "engine" in layer.values), None)
    if passed & set(NODE_NAMES) or engine in (Engine.SLURM, Engine.SLURM.value):
        # Nodes named anew, or a Slurm job (whose nodes Slurm gives it), replace the nodes the run
        # named: kept, they would be named twice (`nodes.check_named_nodes`), and no flag unsets them.
        stored = {section: {key: value for key, value in keys.items() if (section, key) not in NODE_NAMES.values()}
                  for section, keys in stored.items()}
    options = layered(
        LaunchOptions,
        # What the run was given, over what it chose by default then: a resume keeps both.
        [stored_layer(LaunchOptions, chosen_defaults(job, files.ds_config), path / JOB_FILE),
         stored_layer(LaunchOptions, stored, path / JOB_FILE), *layers],  # fmt: skip
        import_root=job.import_root,
        wandb_run_id=job.wandb_run_id,  # one W&B run for the whole run
        as_given={**job.as_given, **(as_given or {})},  # what this resume names anew replaces the run's
    )
    options = resumed_failure_rate(options, passed)
    if "recover_in_memory" not in passed and plan is not None and plan.chosen.data_parallel < 2:
        options = options.model_copy(update={"recover_in_memory": False})  # no replica left to recover from
    return options


def chosen_defaults(job: JobSpec, ds_config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The settings `resolve_defaults` fills in, as the run has them (job.json), by section."""
    training = run_training(job, ds_config)
    return {
        "training": {"steps": job.steps, "lr": training.learning_rate, "weight_decay": training.weight_decay,
                     "lr_schedule": training.lr_schedule.value, "warmup_steps": training.warmup_steps},
        "checkpoint": {"every": interval_text(job)},
    }  # fmt: skip


def interval_text(job: JobSpec) -> str:
    """The run's checkpoint interval as `--checkpoint-every` takes it."""
    if job.checkpoint_auto:
        return "auto"
    if job.checkpoint_every_seconds:
        return f"{job.checkpoint_every_seconds:g}s"
    return str(job.checkpoint_every)


def legacy_options(job: JobSpec, ds_config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The options of a run whose job.json predates `options`, from the job's own fields."""
    training = run_training(job, ds_config)
    interval = interval_text(job)
    options = LaunchOptions(
        engine=job.engine, model=job.model, steps=job.steps, checkpoint_every=interval, mtbf_hours=job.mtbf_hours,
        keep_checkpoints=job.keep_checkpoints, train_without_checkpoints=job.train_without_checkpoints, seed=job.seed, data=job.data, precision=job.precision,
        learning_rate=training.learning_rate, weight_decay=training.weight_decay,
        gradient_clipping=training.gradient_clipping, lr_schedule=training.lr_schedule,
        warmup_steps=training.warmup_steps, ds_config_overlay=job.ds_config_overlay, elastic=job.elastic,
        recover_in_memory=job.recover_in_memory, nodes=job.nodes, master_addr=job.master_addr or None,
        collective_timeout=job.collective_timeout_seconds,
    )  # fmt: skip
    return to_sections(options)


def run_training(job: JobSpec, ds_config: dict[str, Any]) -> TrainingSettings:
    """A run's training settings: job.json's, or for a run written before job.json held them, the
    learning rate its ds_config.json trains with."""
    if "training" in job.model_fields_set:
        return job.training
    lr = ds_config.get("optimizer", {}).get("params", {}).get("lr")
    return TrainingSettings(learning_rate=lr) if isinstance(lr, (int, float)) and lr > 0 else job.training


def check_resume_contract(run_dir: Path, plan: Plan, job: JobSpec, options: LaunchOptions) -> JobSpec:
    """A resume keeps the run's global batch B unless `change_global_batch` says otherwise; the
    change is then recorded in job.json (kept over later resumes). Returns the job to write."""
    if not options.resume or not is_run_dir(run_dir):
        return job
    previous = read_run(run_dir)
    if previous.plan.model_shape != plan.model_shape:
        # Its checkpoint holds another model's tensors: the ranks would fail loading it, after the
        # run's files had been rewritten for this plan.
        raise UserInputError(
            f"the plan is for model '{plan.model}', the run at {run_dir} trains '{previous.plan.model}' "
            "(another shape): a resume continues the run's own model",
            hint=f"resume with a plan of '{previous.plan.model}' (its own: {run_dir / 'plan.json'}), or start a new "
            "run for this plan",
        )
    before, after = previous.plan.global_batch, plan.global_batch
    changes = list(previous.job.global_batch_changes)
    if before != after:
        if not options.change_global_batch:
            raise UserInputError(
                f"the plan's global batch is {after}, the run at {run_dir} trains with {before}: a resume keeps "
                "the global batch (it is a hyper-parameter, not a layout)",
                hint="resume with a plan for the same global batch, or change it deliberately with "
                "--change-global-batch (recorded in job.json)",
            )
        info, _ = resume_point(run_dir)
        changes.append(f"B {before} -> {after} after step {info.step if info is not None else 0}")
    return job.model_copy(update={"global_batch_changes": changes})


@dataclass(frozen=True)
class PreparedLaunch:
    run_dir: Path
    plan: Plan
    job: JobSpec
    ds_config: dict[str, Any]
    command: LaunchCommand
    lock: RunLock | None = None  # held for the job's life (None for a dry run); see `rundir.lock`
    hosts: list[str] | None = None  # DeepSpeed's hostfile, in order
    busier: str | None = None  # the host is much busier or quieter than when profiled (`cluster.busier_note`)
    defaults: list[str] = field(default_factory=list)  # the settings launch chose, unasked (`resolve_defaults`)
    forced_away: str | None = None  # the run --force deletes (deleted, unless a dry run): `prepare.forced_away`


def check_model(plan: Plan, model_reference: str) -> None:
    """The model must build here and be the one the plan was made for: the same layers with the
    same parameters (the cut indexes them, the memory figures count them) and the same shape."""
    from pipectl.models import build_model  # torch: only when launching
    from pipectl.models.base import shape_of
    from pipectl.models.layer_facts import check_tensor_parallel

    model = build_model(model_reference, allow_shape_only=True)  # counted on the meta device; ranks build a stage each
    built = shape_of(model)
    counts = built.layer_parameter_counts
    expected = plan.model_shape
    hint = "plan from a profile of this model, or pass the matching --model"
    if len(counts) != expected.layers:
        raise UserInputError(
            f"model '{model_reference}' has {len(counts)} layers but the plan cuts {expected.layers}", hint=hint
        )
    for name in ("seq_len", "hidden", "vocab"):
        found, planned = getattr(built, name), getattr(expected, name)
        if found is not None and planned is not None and found != planned:
            raise UserInputError(
                f"model '{model_reference}' has {name.replace('_', ' ')} {found}, the plan was made for {planned}",
                hint=hint,
            )
    for index, (found, planned) in enumerate(zip(counts, expected.layer_parameter_counts)):
        if found != planned:
            raise UserInputError(
                f"model '{model_reference}' layer {index} ({model.layers[index].name}) has {found:,} parameters, "
                f"the plan was made for {planned:,} (model: {built.parameter_count:,} parameters, plan: "
                f"{expected.parameter_count:,})",
                hint=hint,
            )
    # Every distinct block split as the ranks will split it, on the meta device (heads, key/value
    # heads and widths t divides; no dropout in a Hugging Face layer): refused before any rank starts.
    check_tensor_parallel(model, [plan.chosen.tensor_parallel])


def check_data(plan: Plan, data: DataSpec, model_reference: str) -> None:
    """The training data must be readable as the ranks will read it, and fit the model: a token or
    text file's ids inside the vocabulary and a sample of seq_len + 1 tokens, a dataset's first
    sample collated (its code runs here too), and the built-in byte corpus only for a vocabulary
    of 256 or more."""
    vocab = plan.model_shape.vocab
    if data.path is not None:
        from pipectl.runtime.data import check_token_file  # numpy and torch: only when a file is given

        if not Path(data.path).is_file():
            raise UserInputError(f"data file not found: {data.path}")
        check_token_file(data.path, plan.model_shape.seq_len, vocab, tokenizer=hf_tokenizer_file(model_reference))
    elif data.reference is not None:
        from pipectl.runtime.data import check_dataset

        check_dataset(data.reference)
    elif data.kind is DataKind.BUILTIN and vocab is not None and vocab < 256:
        raise UserInputError(
            f"the built-in corpus is bytes, and the model's vocabulary is {vocab} (fewer than 256)",
            hint="give --data a token file, a text file the model's tokenizer covers, a dataset, or synthetic",
        )


# A profile's dtype -> the precision a run trains in.
_PRECISION_OF_DTYPE = {"float32": Precision.FP32, "bfloat16": Precision.BF16, "float16": Precision.FP16}
_DTYPE_OF_PRECISION = {precision: dtype for dtype, precision in _PRECISION_OF_DTYPE.items()}


def planned_precision(
    profile_dtype: str | None, asked: Precision | None, named: str | None = None, *, torch_engine: bool = False
) -> Precision:
    """The precision to train in: the plan's (its profile's dtype), which `asked` must match
    (`named`: how the user gave it, for the refusal). The torch engine trains in fp32 only: its
    plan of a 16-bit profile is refused, with a way out (profile again), not another precision.

    The plan's memory and step-time figures hold for its profile's dtype only (fp32 weights and
    activations take twice the bytes of bf16 ones), so another precision is refused rather than
    run against figures that do not hold. A plan without a profile (made in memory) trains in
    what was asked, fp32 by default.

        >>> planned_precision("bfloat16", None)
        <Precision.BF16: 'bf16'>
    """
    if profile_dtype is None:
        return asked or Precision.FP32
    planned = _PRECISION_OF_DTYPE.get(profile_dtype)
    if planned is None:
        raise UserInputError(
            f"the plan was made for {profile_dtype}, which pipectl's runtime does not train in yet",
            hint="profile and plan again with --dtype bfloat16 or --dtype float32",
        )
    if torch_engine and planned is not Precision.FP32:
        raise UserInputError(
            f"the plan was made for {profile_dtype} ({planned.value}) and its engine, torch (PyTorch's pipelining "
            "runtime), trains in fp32 only",
            hint="profile and plan again with --dtype float32, or re-plan with --engine deepspeed",
        )
    if asked is not None and asked is not planned:
        raise UserInputError(
            f"{named or '--precision ' + asked.value}: the plan was made for {profile_dtype} ({planned.value}); its memory and "
            f"step-time predictions hold for that precision only",
            hint=f"launch without --precision, or profile and plan again with --dtype {_DTYPE_OF_PRECISION[asked]}",
        )
    return planned


def check_gpus_for_ranks(ranks_per_node: int, visible_gpus: int) -> None:
    """A node running the job's ranks needs a GPU for each (NCCL: one device per rank).

        >>> check_gpus_for_ranks(2, 1)
        Traceback (most recent call last):
        ...
        pipectl.errors.UserInputError: the plan runs 2 ranks on this node but it has 1 visible GPU
    """
    if ranks_per_node > visible_gpus:
        raise UserInputError(
            f"the plan runs {count(ranks_per_node, 'rank')} on this node but it has {count(visible_gpus, 'visible GPU')}",
            hint="plan for the GPUs this node has (pipectl plan --devices N), spread the ranks over more "
            "nodes (--nodes), or check CUDA_VISIBLE_DEVICES",
        )


def cpu_trains_fp16() -> bool:
    """Whether DeepSpeed's CPU accelerator takes fp16 here (it asks oneDNN; False on CPUs without
    AVX-512 fp16, such as the one the tests run on)."""
    import torch  # only when launching

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False


def _visible_gpus() -> int | None:
    """GPUs this process can use, or None when it runs on CPU (no CUDA, or DS_ACCELERATOR=cpu)."""
    if os.environ.get("DS_ACCELERATOR") == "cpu":
        return None
    import torch  # only when launching

    return torch.cuda.device_count() if torch.cuda.is_available() else None


def plan_cluster(plan: Plan, asked: str | None) -> ClusterSpec | None:
    """The cluster the job runs on: `--cluster` if given, else the plan's (None if that cannot be
    read here: a YAML path from another machine)."""
    if asked is not None:
        cluster = load_cluster(asked)
        check_cluster_runs(plan, cluster, asked)
        return cluster
    try:
        return plan_cluster_spec(plan)
    except PipectlError:
        return None


def slurm_settings(cluster: ClusterSpec | None, flags: SlurmSpec, node_type: str | None = None) -> SlurmSpec:
    """The cluster file's `slurm:` section, the partition and constraint of `node_type` (the nodes
    a job or a heterogeneous job's component runs on) over it, launch's flags over both.

        >>> slurm_settings(None, SlurmSpec(partition="gpu")).partition
        'gpu'
    """
    base = cluster.slurm if cluster is not None else SlurmSpec()
    own = {}
    if cluster is not None and node_type is not None:
        own = next(n for n in cluster.node_types if n.name == node_type).slurm.model_dump(exclude_none=True)
    set_by_flags = {k: v for k, v in flags.model_dump().items() if v is not None}
    return base.model_copy(update={**own, **set_by_flags})


def job_node_type(plan: Plan, cluster: ClusterSpec | None) -> str | None:
    """The node type a plan of one device kind runs on (the first of its kind in the cluster)."""
    kinds = plan_kinds(plan)
    if cluster is None or len(kinds) != 1:
        return None
    nodes = cluster.nodes_of_kind(kinds[0])
    return nodes[0].name if nodes else None


def slurm_components(cluster: ClusterSpec | None, flags: SlurmSpec, groups: list[NodeGroup]) -> list[SlurmSpec] | None:
    """Per node group of a split plan, its heterogeneous job component's settings (`slurm_settings`)."""
    if not groups or cluster is None:
        return None
    return [slurm_settings(cluster, flags, group.node_type) for group in groups]


def check_recoverable(
    candidate: Candidate, engine: Engine, groups: list[NodeGroup], named: str = "--recover-in-memory"
) -> None:
    """`--recover-in-memory` needs another replica to recover from, and one torchrun per replica on
    this machine (the local engine); raises `UserInputError` naming what is missing (the option as
    given: `named`)."""
    if engine is not Engine.LOCAL:
        raise UserInputError(
            f"{named} runs one torchrun per replica on this machine (engine local), not {engine.value}",
            hint="a multi-node job recovers from its checkpoint (launch --resume, or --elastic)",
        )
    if candidate.data_parallel < 2:
        raise UserInputError(
            f"{named} needs data-parallel replicas to recover from; the plan's layout "
            f"{layout_label(candidate)} has d = {candidate.data_parallel}",
            hint="plan with --data-parallel 2 or more, or recover from checkpoints (launch --resume)",
        )
    if groups:
        raise UserInputError(f"{named} runs on one host; the plan splits the job over groups of nodes")


def at_scale(nodes: int, accelerator: str | None) -> bool:
    """A real training, not a try-out on this machine's CPU: GPUs, or several nodes."""
    return nodes > 1 or accelerator == "cuda"


def job_words(plan: Plan, nodes: int, accelerator: str | None) -> str:
    """'a job on 384 nodes of 8 a100-80gb GPUs' (for messages)."""
    kind = f"{plan.chosen.device} GPU" if accelerator == "cuda" else "CPU rank"
    return f"a job on {count(nodes, 'node')} of {count(plan.chosen.devices // nodes, kind)}"


def check_data_at_scale(data: DataSpec, accelerator: str | None) -> None:
    """The builtin corpus (a few MB of Python's own source) is a try-out's data, refused on GPUs."""
    if data.kind is DataKind.BUILTIN and accelerator == "cuda":
        raise UserInputError(
            "a GPU job needs its data: --data PATH (a token or text file) or package.module:function; "
            "the builtin corpus is a few MB for try-outs on this machine",
            hint="--data synthetic measures speed alone",
        )


WANDB_LOCAL_MODES = ("offline", "disabled", "dryrun")


def check_wandb_login(named: str = "--wandb") -> None:
    """`--wandb` online needs a W&B key (WANDB_API_KEY, or `wandb login`'s entry in ~/.netrc); rank
    0 would otherwise fail as it starts, after every rank has built its engine."""
    if os.environ.get("WANDB_MODE", "").lower() in WANDB_LOCAL_MODES or os.environ.get("WANDB_API_KEY"):
        return
    try:
        import netrc

        if netrc.netrc().authenticators(os.environ.get("WANDB_BASE_URL", "api.wandb.ai").split("//")[-1]):
            return
    except (OSError, netrc.NetrcParseError):
        pass
    raise UserInputError(
        f"{named} needs a Weights & Biases login: no WANDB_API_KEY and no `wandb login` entry in ~/.netrc",
        hint="run wandb login (or set WANDB_API_KEY), or log offline with WANDB_MODE=offline (wandb sync uploads it later)",
    )


def build_job(plan: Plan, name: str, options: LaunchOptions, cluster: ClusterSpec | None = None) -> JobSpec:
    """job.json for `plan.chosen` under `options`, on `cluster` (default: the plan's, if readable)."""
    devices = plan.chosen.devices
    if cluster is None:
        cluster = plan_cluster(plan, options.cluster)
    groups = node_groups(plan, cluster, options.engine, elastic=options.elastic is not None)
    nodes = job_nodes(plan, options, cluster, groups)
    if options.engine is Engine.LOCAL and nodes != 1:
        raise UserInputError(
            f"the local engine runs on this machine only, not {count(nodes, 'node')}", hint="use --engine torchrun"
        )
    if options.recover_in_memory:
        check_recoverable(plan.chosen, options.engine, groups, given(options, "recover_in_memory"))
    accelerator = plan_accelerator(plan, cluster)
    scale = at_scale(nodes, accelerator)
    options, _ = resolve_defaults(options, at_scale=scale, what=job_words(plan, nodes, accelerator))
    if options.data.kind is DataKind.BUILTIN and plan.model_shape.vocab is None:  # bytes feed language models only:
        options = options.model_copy(update={"data": DataSpec(kind=DataKind.SYNTHETIC)})  # its own batches, said so
    check_data_at_scale(options.data, accelerator)
    if options.wandb:
        check_wandb_login(given(options, "wandb"))
    for wanted, package, extra in ((options.tensorboard, "tensorboard", "monitor"), (options.wandb, "wandb", "wandb")):
        if wanted and importlib.util.find_spec(package) is None:
            raise UserInputError(
                f"{given(options, package)} needs the {package} package, which is not installed",
                hint=f"pip install 'pipectl[{extra}]' (or {package}) where the ranks run",
            )
    every_steps, every_seconds, every_auto = options.interval
    # A new run whose interval outlasts it was likely mistyped; a resumed run keeps its own
    # interval (job.json's) whatever total it now trains to: its end is checkpointed either way.
    if every_steps > options.steps and not options.resume:
        raise UserInputError(
            f"{given(options, 'checkpoint_every')} exceeds {given(options, 'steps')}",
            hint="the run checkpoints at the end anyway; use a smaller K or 0",
        )
    model_given = options.model or plan.model_reference or plan.model
    as_given = {"model": model_given, **options.as_given}
    try:
        return JobSpec(
            name=name,
            model=stored_reference(model_given),
            import_root=options.import_root or os.getcwd(),
            as_given=as_given,
            steps=options.steps,
            checkpoint_every=every_steps,
            checkpoint_every_seconds=every_seconds,
            checkpoint_auto=every_auto,
            mtbf_hours=options.mtbf_hours,
            keep_checkpoints=options.keep_checkpoints,
            train_without_checkpoints=options.train_without_checkpoints,
            seed=options.seed,
            data=options.data,
            engine=options.engine,
            world_size=devices,
            nodes=nodes,
            ranks_per_node=devices // nodes,
            master_addr=master_address(options, nodes),
            master_port=options.master_port or free_port(),
            precision=options.precision or Precision.FP32,
            accelerator=accelerator,
            compute_slowdowns=compute_slowdowns(plan, cluster),
            node_groups=groups,
            elastic=options.elastic,
            recover_in_memory=options.recover_in_memory,
            collective_timeout_seconds=options.collective_timeout,
            log_every=options.log_every,
            tensorboard=options.tensorboard,
            wandb_project=options.wandb,
            wandb_run_id=(options.wandb_run_id or secrets.token_hex(8)) if options.wandb else options.wandb_run_id,
            training=TrainingSettings(
                learning_rate=options.learning_rate,
                weight_decay=options.weight_decay,
                gradient_clipping=options.gradient_clipping,
                lr_schedule=options.lr_schedule,
                warmup_steps=options.warmup_steps,
                min_lr_ratio=SCALE_MIN_LR_RATIO if scale else 0.0,
                **overlay_adam(options.ds_config_overlay),  # the betas and eps the run trains with
            ),
            ds_config_overlay=options.ds_config_overlay,
            options=to_sections(options),
            pipectl_version=__version__,
        )
    except ValidationError as exc:  # a value the job's schema refuses (the options' bounds are the same)
        raise UserInputError(validation_message(exc)) from None


def prepare_launch(
    plan: Plan,
    run_dir: str | os.PathLike[str],
    options: LaunchOptions,
    *,
    plan_dir: str | os.PathLike[str] | None = None,
    write: bool = True,
) -> PreparedLaunch:
    """Validate everything, then (unless `write=False`, a dry run) create the run directory.

    `plan_dir` is where plan.json was read from: its profile copy goes into the run directory too,
    so a resize can re-plan from it (default: the run directory, which holds it when resuming).
    """
    path = Path(run_dir).resolve()
    profile = None
    if plan.profile is not None:  # present and unchanged, before anything is written
        profile = load_model(ModelProfile, plan_profile_path(path if plan_dir is None else plan_dir, plan))
    profile_dtype = profile.dtype if profile is not None else None
    as_chosen = options  # what job.json stores: the options as chosen, before the plan and the host fill them in
    named = given(options, "precision")
    precision = planned_precision(profile_dtype, options.precision, named, torch_engine=plan.chosen.engine is PlanEngine.TORCH)
    options = options.model_copy(update={"precision": precision})
    check_named_nodes(options)
    if options.engine in (Engine.DEEPSPEED, Engine.TORCHRUN):
        options = options.model_copy(update={"hosts": node_hosts(options)})
    cluster = plan_cluster(plan, options.cluster)
    job = build_job(plan, path.name, options, cluster).model_copy(update={"options": to_sections(as_chosen)})
    check_hostfile_slots(options, job.ranks_per_node)
    if job.engine is Engine.LOCAL:  # the ranks run here: how busy this host is, beside the profile's
        job = job.model_copy(update={"host_at_launch": host_state()})
    with import_root(job.import_root):  # the model and the data resolved as the ranks will resolve them
        check_model(plan, job.model)
        check_data(plan, job.data, job.model)
    stored = read_run(path).job.ds_config_overlay if options.resume and is_run_dir(path) else None
    ds_config = validated_config(plan, precision=job.precision, training=job.training, total_steps=job.steps,
                                 overlay=job.ds_config_overlay, stored_overlay=stored)  # fmt: skip
    command = build_command(
        job,
        path,
        hosts=options.hosts,
        slurm=slurm_settings(cluster, options.slurm, job_node_type(plan, cluster)),
        components=slurm_components(cluster, options.slurm, job.node_groups),
    )
    if command.runnable_here and write:  # a dry run shows the files for the nodes that will run them
        visible = _visible_gpus()
        if job.accelerator == "cuda" and visible is None:
            raise UserInputError(
                f"the plan is for {count(plan.chosen.devices, plan.chosen.device + ' GPU')} and this host has none",
                hint="write the files for the cluster with --engine slurm (or torchrun/deepspeed on its nodes); "
                "--dry-run shows them",
            )
        if visible is not None:
            check_gpus_for_ranks(job.ranks_per_node, visible)
        elif job.precision is Precision.FP16 and not cpu_trains_fp16():
            raise UserInputError(
                "the plan trains in fp16, which DeepSpeed's CPU accelerator cannot on this host",
                hint="run it on its GPUs (--engine slurm|torchrun|deepspeed), or plan from an fp32 or bf16 profile",
            )
    if options.resume and options.force:
        raise UserInputError("--resume and --force contradict each other: keep the run, or start over")
    if options.force and plan_dir is not None and is_run_dir(path) and Path(plan_dir).resolve().is_relative_to(path):
        # --force empties the run directory first: the plan and its profile copy would go with it.
        raise UserInputError(
            f"--force would delete the plan this launch reads: it lies in the run directory {path}",
            hint=f"copy plan.json and its profile-*.json out of {path} first, or continue the run with --resume",
        )
    # A folder that is not a run is refused before the lock is taken, which would leave its job.lock
    # among the user's files (a dry run touches nothing at all); a run is locked first, so that a
    # live job's is named by its pid. Under the lock, `prepare_run_dir` asks again.
    if not write or not is_run_dir(path) or options.force:  # --force: is its job.json a run's?
        check_run_dir(path, resume=options.resume, force=options.force)
    # One job per run directory: taken before anything is read for a resume or deleted by --force.
    lock = lock_run_dir(path) if write else None
    try:
        if options.resume and is_run_dir(path) and write:
            recover_staged(path)  # a checkpoint written whole by a job that died before committing it
        if options.resume and is_run_dir(path) and resume_point(path)[0] is None:
            raise UserInputError(
                f"cannot resume {path}: it has no checkpoint, so it would start over from step 0",
                hint="start over deliberately with --force",
            )
        job = check_resume_contract(path, plan, job, options)
        replaced = forced_away(path) if options.force else None
        if write:
            prepare_run_dir(path, resume=options.resume, force=options.force)
            write_run_files(path, plan=plan, job=job, ds_config=ds_config, command=command, plan_dir=plan_dir)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    busier = busier_note(profile.host if profile is not None else None, job.host_at_launch)
    _, defaults = resolve_defaults(options, at_scale=at_scale(job.nodes, job.accelerator), what="")  # build_job checked it
    return PreparedLaunch(path, plan, job, ds_config, command, lock, options.hosts, busier, defaults, replaced)

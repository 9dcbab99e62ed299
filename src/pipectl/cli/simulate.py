"""`pipectl simulate`: time one step of a plan (or of a uniform pipeline) and draw it.

    pipectl simulate plan.json --gantt step.png          # the plan's chosen candidate
    pipectl simulate plan.json --devices 4 --terminal    # its morph-table entry for 4 devices
    pipectl simulate --schedule 1f1b --pipeline-parallel 4 --micro-batches 8 --terminal
    pipectl simulate --schedule 2bw --pipeline-parallel 4 --micro-batches 4   # + 2BW's steady state

PipeDream-2BW (`--schedule 2bw`, or a plan that chose it): the table times one step with a flush;
under it, 2BW across steps without one (`pipectl.plan.twobw_steady_state`): the steady-state time per update,
the weight version each micro-batch's forward and backward use, the two stashed versions' memory
(with a plan), and that pipectl's runtime cannot run it.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich import box
from rich.table import Table
from rich.text import Text

from pipectl.artifacts.layout import RECOMPUTE_MARKS, recomputed
from pipectl.artifacts.plan import Plan
from pipectl.artifacts.profile import ModelProfile
from pipectl.cli.context import JsonFlag, console, output_file, print_json
from pipectl.cluster import (
    calibrated_cluster, load_calibration_for, load_cluster, plan_calibration, plan_cluster_spec, plan_files_changed,
)
from pipectl.errors import ScheduleError, UserInputError
from pipectl.io import load_model
from pipectl.plan.hetero import replica_stage_costs
from pipectl.plan.stage_costs import StageCosts, uniform_costs
from pipectl.plan.simulate import Timeline, simulate, simulate_step_seconds
from pipectl.plan.memory import stage_parameter_and_activation_bytes
from pipectl.planfile import load_kind_profiles, load_plan_profile, morph_layout
from pipectl.report.gantt import terminal_gantt, write_gantt
from pipectl.report.plan_table import format_step
from pipectl.report.twobw_table import RUNTIME, SEMANTICS, two_bw_payload, two_bw_report
from pipectl.schedule import ScheduleKind, generate
from pipectl.schedule.comm import add_communication
from pipectl.schedule.generators import generate_for_stage_times
from pipectl.schedule.ir import ActionKind, Schedule
from pipectl.plan.twobw_steady_state import TwoBWSteadyState, two_bw_memory, two_bw_steady_state
from pipectl.schedule.twobw import order_text, two_bw_order
from pipectl.words import count


# A uniform pipeline of more forward passes than this takes minutes to simulate and draw.
MAX_SIMULATED_ACTIONS = 1_000_000


def _uniform_options_given(**options: Any) -> list[str]:
    return [name for name, value in options.items() if value is not None]


def _from_plan(
    plan_path: Path, profile_path: Optional[Path], cluster_name: Optional[str], devices: Optional[int],
    calibration: Optional[Path] = None,
) -> tuple[Schedule, StageCosts, dict[str, Any]]:
    """The schedule and cost table of a plan's candidate (the chosen one, or the morph entry)."""
    plan = load_model(Plan, plan_path)
    candidate = plan.chosen
    note = ""
    if devices is not None:
        candidate = morph_layout(plan, devices)
        entry = plan.for_devices(devices)
        if candidate.devices != devices:
            # the morph entry's own reason ("no configuration of exactly 1000 devices divides ...")
            note = f"the plan's entry for {count(devices, 'device')} uses {candidate.devices}: " + (
                entry.note.split(": ", 1)[-1] if entry.note else "the fastest configuration it found"
            )
    kind_profiles = []
    if profile_path is None:
        profile = load_plan_profile(plan_path, plan)
        kind_profiles = load_kind_profiles(plan_path, plan)
    else:
        profile = load_model(ModelProfile, profile_path)
    cluster = load_cluster(cluster_name) if cluster_name else plan_cluster_spec(plan)
    if cluster_name is None:
        for path in plan_files_changed(plan):
            note = (note + "; " if note else "") + f"{path} changed since planning: priced as it is now"
    own = plan_calibration(plan) if calibration is None else None
    if own is not None and own.device in cluster.device_kinds:
        if cluster_name:  # another cluster, with the calibration the plan was made with
            cluster = calibrated_cluster(cluster, own)
        if profile_path is not None and Path(plan.calibration_file).is_file():  # one view of the GPU, as plan's
            load_calibration_for(plan.calibration_file, [(str(profile_path), profile)], cluster,
                                 said=f"the plan's calibration {plan.calibration_file}")
    if calibration is not None:  # the plan's own calibration, if any, is in its cluster already
        named = [(str(profile_path or "the plan's profile"), profile), *((f"the plan's {p.device} profile", p) for p in kind_profiles)]
        cluster = calibrated_cluster(cluster, load_calibration_for(calibration, named, cluster))
    # A split over device kinds: each kind's replicas run their own micro-batches on their own
    # kind; the slowest sets the step, and is the one shown.
    runs = []
    for kind, micro_batches, costs in replica_stage_costs(candidate, profile, cluster, kind_profiles):
        schedule = generate(
            candidate.schedule, candidate.pipeline_parallel, micro_batches, candidate.chunks, candidate.recompute
        )
        runs.append((simulate_step_seconds(schedule, costs), kind, micro_batches, schedule, costs))
    _, kind, micro_batches, schedule, costs = max(runs, key=lambda run: run[0])
    if len({run[1] for run in runs}) > 1:
        note = (note + "; " if note else "") + (
            f"a split over device kinds: its slowest replica ({kind}, {micro_batches} micro-batches) sets the step "
            "and is shown"
        )
    elif len(runs) > 1:
        shares = " or ".join(str(run[2]) for run in runs)
        note = (note + "; " if note else "") + (
            f"uneven replicas run {shares} micro-batches: one of {micro_batches} sets the step and is shown"
        )
    context = {
        "source": str(plan_path),
        "devices": candidate.devices,
        "tensor_parallel": candidate.tensor_parallel,
        "data_parallel": candidate.data_parallel,
        "micro_batch_size": candidate.micro_batch_size,
        "predicted_step_seconds": candidate.predicted_step_seconds,
    }
    recompute = recomputed(candidate)
    if recompute is not None:  # what the layout recomputes, named in the table's title as the plan's table does
        context["recompute"] = recompute
    if devices is not None:
        context["requested_devices"] = devices
    if schedule.kind is ScheduleKind.PIPEDREAM_2BW:
        parameters, activations = stage_parameter_and_activation_bytes(candidate, profile)
        context["stage_parameter_bytes"] = parameters
        context["stage_activation_bytes"] = activations
        context["plan_peak_memory_bytes"] = list(candidate.peak_memory_bytes)
    if note:
        context["note"] = note
    return schedule, costs, context


def _timeline_payload(schedule: Schedule, timeline: Timeline, context: dict[str, Any]) -> dict[str, Any]:
    return {
        "schedule": schedule.kind.value,
        "pipeline_parallel": schedule.pipeline_parallel,
        "micro_batches": schedule.micro_batches,
        "chunks": schedule.chunks,
        **context,
        "step_seconds": timeline.step_seconds,
        "bubble_fraction": list(timeline.bubble_fraction),
        "bubble_ratio": list(timeline.bubble_ratio),
        "communication_seconds": timeline.communication_seconds,
        "communication_seconds_per_rank": list(timeline.communication_seconds_per_rank),
        "peak_in_flight": list(timeline.peak_in_flight),
        "peak_stashed_inputs": list(timeline.peak_stashed_inputs),
        "records": [
            {"rank": r.rank, "action": str(r.action), "start": r.start, "end": r.end} for r in timeline.records
        ],
    }


def _recomputes(schedule: Schedule) -> bool:
    return any(a.kind is ActionKind.RECOMPUTE for actions in schedule.actions.values() for a in actions)


def _two_bw_state(schedule: Schedule, costs: StageCosts) -> TwoBWSteadyState:
    """2BW across steps for the schedule's stage costs (v = 1: a virtual stage is a rank)."""
    return two_bw_steady_state(
        schedule.pipeline_parallel, schedule.micro_batches,
        forward_seconds=costs.forward_seconds, backward_seconds=costs.backward_seconds,
        recompute_seconds=costs.recompute_seconds,
        send_forward_seconds=costs.send_forward_seconds, send_backward_seconds=costs.send_backward_seconds,
        update_seconds=[a + o for a, o in zip(costs.allreduce_seconds, costs.optimizer_seconds)],
        recompute=_recomputes(schedule),
    )  # fmt: skip


def _uniform_pipeline(
    schedule_kind: Optional[ScheduleKind],
    pipeline_parallel: Optional[int],
    micro_batches: Optional[int],
    chunks: Optional[int],
    recompute: Optional[bool],
    *,
    forward_ms: Optional[float],
    backward_ms: Optional[float],
    send_ms: Optional[float],
    allreduce_ms: Optional[float],
    optimizer_ms: Optional[float],
    jitter_ms: float,
    seed: int,
) -> tuple[Schedule, StageCosts]:
    """The schedule and cost table of a uniform pipeline (no plan): every rank the same costs."""
    if schedule_kind is None or pipeline_parallel is None or micro_batches is None:
        raise UserInputError(
            "give a PLAN.json, or --schedule, --pipeline-parallel and --micro-batches",
            hint="pipectl simulate --schedule 1f1b --pipeline-parallel 4 --micro-batches 8 --terminal",
        )
    # zbv is a V of two chunks; interleaved's chunks default to 2, its least that differs from 1F1B
    v = chunks or (2 if schedule_kind in (ScheduleKind.ZBV, ScheduleKind.INTERLEAVED) else 1)
    if schedule_kind.splits_backward and recompute:
        raise UserInputError(
            f"the {schedule_kind.value} schedule does not recompute: its W keeps each micro-batch's "
            "activations until the drain, so a recompute would run the forward again for nothing",
            hint=f"pipectl simulate --schedule {schedule_kind.value} without --recompute",
        )
    if pipeline_parallel * micro_batches * v > MAX_SIMULATED_ACTIONS:
        raise UserInputError(
            f"p {pipeline_parallel} x m {micro_batches} x v {v} = {pipeline_parallel * micro_batches * v:,} "
            f"forward passes to simulate, more than {MAX_SIMULATED_ACTIONS:,}"
        )
    forward_s = (1.0 if forward_ms is None else forward_ms) / 1e3
    backward_s = (2.0 if backward_ms is None else backward_ms) / 1e3
    schedule = generate_for_stage_times(
        schedule_kind, pipeline_parallel, micro_batches, v, bool(recompute),
        forward_seconds=forward_s, backward_seconds=backward_s,
    )
    costs = uniform_costs(
        pipeline_parallel, v, forward_s, backward_s,
        send=(send_ms or 0.0) / 1e3,
        allreduce=(allreduce_ms or 0.0) / 1e3,
        optimizer=(optimizer_ms or 0.0) / 1e3,
        jitter=jitter_ms / 1e3,
        seed=seed,
    )
    return schedule, costs


def _two_bw_across_steps(
    schedule: Schedule, costs: StageCosts, context: dict[str, Any]
) -> tuple[Optional[TwoBWSteadyState], list[str]]:
    """A 2bw schedule's steady state (None where it cannot be computed, or for another schedule) and
    the notes that go with it: why it is missing, and where the table above times transfers otherwise."""
    if schedule.kind is not ScheduleKind.PIPEDREAM_2BW:
        return None, []
    two_bw: Optional[TwoBWSteadyState] = None
    notes: list[str] = []
    try:
        two_bw = _two_bw_state(schedule, costs)
    except ScheduleError as exc:
        notes.append(f"2BW's steady state: {exc.message}" + (f" ({exc.hint})" if exc.hint else ""))
        if context.get("predicted_step_seconds"):
            notes.append(f"the plan predicted {context['predicted_step_seconds']:.6g} s per update in "
                         "steady state (the planner computes it without simulating every operation)")
    differences = (["blocking (gloo) transfers"] if costs.blocking_p2p else []) + (
        ["transfer jitter"] if costs.jitter_seconds else []
    )
    if differences:
        notes.append(
            f"the table above times {' and '.join(differences)}; 2BW's figures below time transfers as "
            "asynchronous and exact"
        )
    return two_bw, notes


def _summary_table(schedule: Schedule, timeline: Timeline, context: dict[str, Any]) -> Table:
    """Per rank: busy time, bubble, idle per compute, exposed communication and peak in flight; times
    in one unit for the whole table (ms below a 1 s step, else s), 4 significant digits."""
    # 2BW's table times one step with a flush; its steady state is reported under it.
    step = "flushed step" if schedule.kind is ScheduleKind.PIPEDREAM_2BW else "step"
    mark = RECOMPUTE_MARKS.get(context.get("recompute", ""), "")
    title = (
        f"{schedule.kind.value}{mark}  p={schedule.pipeline_parallel} m={schedule.micro_batches} "
        f"v={schedule.chunks}  {step} {format_step(timeline.step_seconds)}"
    )
    if context.get("predicted_step_seconds") and schedule.kind is not ScheduleKind.PIPEDREAM_2BW:
        # (a 2bw plan predicts its steady state per update: shown beside it, under the table)
        title += f" (plan predicted {format_step(context['predicted_step_seconds'])})"
    unit, scale = ("ms", 1e3) if timeline.step_seconds < 1 else ("s", 1.0)
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False)
    for column in ("rank", f"busy {unit}", "bubble % of step", "idle / compute", f"exposed comm {unit}", "peak in flight"):
        table.add_column(column, justify="right")
    for rank in range(schedule.pipeline_parallel):
        busy = sum(r.end - r.start for r in timeline.rank_records(rank))
        table.add_row(
            str(rank),
            f"{busy * scale:.4g}",
            f"{100 * timeline.bubble_fraction[rank]:.1f}",
            f"{timeline.bubble_ratio[rank]:.3f}",
            f"{timeline.communication_seconds_per_rank[rank] * scale:.4g}",
            str(timeline.peak_in_flight[rank]),
        )
    return table


def register(app: typer.Typer) -> None:
    """Add `pipectl simulate` to the root app."""

    @app.command("simulate")
    def simulate_command(
        plan_path: Annotated[
            Optional[Path], typer.Argument(help="plan.json from `pipectl plan`.", metavar="PLAN.json")
        ] = None,
        profile: Annotated[
            Optional[Path], typer.Option(help="Profile to cost the plan with (default: the plan's own).")
        ] = None,
        cluster: Annotated[
            Optional[str], typer.Option(help="Cluster name or YAML (default: the plan's cluster).")
        ] = None,
        calibration: Annotated[
            Optional[Path], typer.Option(help="A calibration (pipectl calibrate MEASURED.csv) whose links price "
                                         "the plan (default: the one it was planned with, if any).")
        ] = None,
        devices: Annotated[
            Optional[int], typer.Option(min=1, help="Simulate the plan's morph-table entry for N devices.")
        ] = None,
        schedule_kind: Annotated[
            Optional[ScheduleKind], typer.Option("--schedule", help="Without a plan: the schedule to simulate.")
        ] = None,
        pipeline_parallel: Annotated[Optional[int], typer.Option(min=1, help="Without a plan: ranks p.")] = None,
        micro_batches: Annotated[Optional[int], typer.Option(min=1, help="Without a plan: micro-batches m.")] = None,
        chunks: Annotated[Optional[int], typer.Option(min=1, help="Without a plan: chunks per rank v (interleaved, default 2; zbv holds 2).")] = None,
        recompute: Annotated[
            Optional[bool], typer.Option("--recompute/--no-recompute", help="Without a plan: recompute before backward.")
        ] = None,
        forward_ms: Annotated[
            Optional[float], typer.Option(min=0.0, help="Forward of one micro-batch through a rank's share, ms (default 1).")
        ] = None,
        backward_ms: Annotated[
            Optional[float], typer.Option(min=0.0, help="Backward of one micro-batch through a rank's share, ms (default 2).")
        ] = None,
        send_ms: Annotated[Optional[float], typer.Option(min=0.0, help="One p2p transfer per boundary, ms (default 0).")] = None,
        allreduce_ms: Annotated[Optional[float], typer.Option(min=0.0, help="Data-parallel all-reduce per rank, ms (default 0).")] = None,
        optimizer_ms: Annotated[Optional[float], typer.Option(min=0.0, help="Optimizer step per rank, ms (default 0).")] = None,
        jitter_ms: Annotated[float, typer.Option(min=0.0, help="Std. dev. of extra delay per p2p transfer, ms.")] = 0.0,
        seed: Annotated[int, typer.Option(help="Seed of the jitter.")] = 0,
        gantt: Annotated[
            Optional[Path], typer.Option(help="Write the Gantt chart here (.png, .svg or .pdf).", metavar="FILE", callback=output_file)
        ] = None,
        terminal: Annotated[bool, typer.Option("--terminal", help="Draw the Gantt chart in the terminal.")] = False,
        width: Annotated[int, typer.Option(min=10, max=10_000, help="Characters per row of the terminal chart.")] = 100,
        print_schedule: Annotated[
            bool, typer.Option("--print-schedule", help="Print each rank's actions, sends and receives included.")
        ] = False,
        as_json: JsonFlag = False,
    ) -> None:
        """Simulate one step: step time, bubbles, exposed communication, in-flight micro-batches.

        With --schedule 2bw (or a 2bw plan), also PipeDream-2BW's steady state without a flush.
        """
        uniform = _uniform_options_given(
            schedule=schedule_kind, pipeline_parallel=pipeline_parallel, micro_batches=micro_batches,
            chunks=chunks, recompute=recompute, forward_ms=forward_ms, backward_ms=backward_ms,
            send_ms=send_ms, allreduce_ms=allreduce_ms, optimizer_ms=optimizer_ms,
        )
        if plan_path is not None:
            if uniform:
                raise UserInputError(
                    f"--{uniform[0].replace('_', '-')} describes a uniform pipeline; it cannot be combined with a plan",
                    hint="drop PLAN.json, or drop the uniform-pipeline options",
                )
            schedule, costs, context = _from_plan(plan_path, profile, cluster, devices, calibration)
            if jitter_ms:
                costs = replace(costs, jitter_seconds=jitter_ms / 1e3, seed=seed)
        else:
            plan_only = [n for n, v in (("profile", profile), ("cluster", cluster), ("devices", devices),
                                        ("calibration", calibration)) if v is not None]
            if plan_only:
                raise UserInputError(f"--{plan_only[0]} needs a PLAN.json")
            schedule, costs = _uniform_pipeline(
                schedule_kind, pipeline_parallel, micro_batches, chunks, recompute,
                forward_ms=forward_ms, backward_ms=backward_ms, send_ms=send_ms, allreduce_ms=allreduce_ms,
                optimizer_ms=optimizer_ms, jitter_ms=jitter_ms, seed=seed,
            )  # fmt: skip
            context = {"source": "uniform"}
        timeline = simulate(schedule, costs)
        two_bw, two_bw_notes = _two_bw_across_steps(schedule, costs, context)
        two_bw_memory_rows = None
        if two_bw is not None and context.get("stage_parameter_bytes") is not None:
            two_bw_memory_rows = two_bw_memory(
                two_bw, context["stage_parameter_bytes"], context.get("stage_activation_bytes")
            )
        if gantt is not None:
            title = f"{schedule.kind.value} p={schedule.pipeline_parallel} m={schedule.micro_batches}"
            title += f" v={schedule.chunks}" if schedule.chunks > 1 else ""
            written = write_gantt(timeline, gantt, title=title)
        if as_json:
            payload = _timeline_payload(schedule, timeline, context)
            if gantt is not None:
                payload["gantt"] = str(written)
            if schedule.kind is ScheduleKind.PIPEDREAM_2BW:
                payload["two_bw"] = two_bw_payload(two_bw, two_bw_memory_rows, two_bw_notes)
            print_json(payload)
            return
        if print_schedule:
            typer.echo(add_communication(schedule).to_text(), nl=False)
            if two_bw is not None:
                typer.echo("# 2bw across 3 updates, no flush (U j: the stage's update j, making weight version j)")
                order = two_bw_order(schedule.pipeline_parallel, schedule.micro_batches, 3, _recomputes(schedule))
                typer.echo(order_text(order))
        if context.get("note"):
            console.print(f"note: {context['note']}", style="yellow", highlight=False)
        console.print(_summary_table(schedule, timeline, context))
        if terminal:
            console.print(terminal_gantt(timeline, width=width), soft_wrap=True)
        for line in two_bw_notes:
            console.print(f"note: {line}", style="yellow", highlight=False)
        if two_bw is not None:
            console.print(two_bw_report(two_bw, two_bw_memory_rows, context.get("plan_peak_memory_bytes"),
                                        context.get("predicted_step_seconds")))
        elif schedule.kind is ScheduleKind.PIPEDREAM_2BW:
            console.print(Text(SEMANTICS, style="yellow"), Text(RUNTIME, style="yellow"), sep="\n")
        if gantt is not None:
            console.print(f"Gantt chart written to {written}")

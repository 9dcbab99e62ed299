"""`pipectl export-plan plan.json --to megatron|torchtitan|deepspeed -o DIR`: an existing plan as
another framework's settings (`pipectl.emit`).

A layout the framework cannot run is refused naming the feature, with the nearest layout it can:
the plan's request re-planned within the framework's layouts (`plan --emit` writes that one).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipectl.artifacts.plan import Candidate, Framework, Plan, RecomputeChoice
from pipectl.artifacts.profile import ModelProfile
from pipectl.cli.context import JsonFlag, console, print_json
from pipectl.cli.plan import parse_morph_counts
from pipectl.cluster import plan_cluster_spec
from pipectl.emit import emitted_files, emitted_layouts, fewer_devices_notes, write_files
from pipectl.emit.common import layout_words
from pipectl.report.tables import format_bytes
from pipectl.errors import PipectlError, UserInputError
from pipectl.io import load_model
from pipectl.plan.frameworks import framework_request, space_of
from pipectl.plan.search import plan as make_plan
from pipectl.planfile import load_kind_profiles, load_plan_profile


def export_plan_command(
    plan_file: Annotated[Path, typer.Argument(help="plan.json from `pipectl plan`.")],
    to: Annotated[Framework, typer.Option("--to", help="megatron, torchtitan or deepspeed.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="The folder to write the files into.")] = Path("."),
    devices: Annotated[
        str | None, typer.Option("--devices", help="Also the morph table's layouts for these counts (12,64-66), into devices-N/.")
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Write a plan's layout as Megatron-LM arguments, a torchtitan config or a DeepSpeed config and partition."""
    plan = load_model(Plan, plan_file)
    counts, _ = parse_morph_counts(devices, "--devices", allow_all=False)
    profile = load_plan_profile(plan_file, plan)
    layouts = emitted_layouts(plan, to, profile, counts,
                              hint=lambda count, layout: _nearest(plan, plan_file, profile, to, count or plan.request.devices,
                                                                  layout))
    if output.exists() and not output.is_dir():
        raise UserInputError(f"-o {output} is a file; give the folder to write into")
    written = write_files(output, emitted_files(plan, plan_file, to, devices=counts, profile=profile))
    if as_json:
        print_json({"framework": to.value, "written": [str(path) for path in written]})
        return
    for path in written:
        console.print(f"wrote {path}", markup=False)
    for note in fewer_devices_notes(plan, layouts):
        console.print(note, highlight=False, soft_wrap=True)


def _nearest(
    plan: Plan, plan_file: Path, profile: ModelProfile, framework: Framework, devices: int | None, layout: Candidate
) -> str:
    """The plan's request re-planned within the framework's layouts at `devices`, in words, against `layout`."""
    space = space_of(framework)
    asked = plan.request
    request = framework_request(asked.model_copy(update={
        "devices": devices,
        "morph": False,
        # What the plan pinned or listed that the framework lacks is let go: the nearest layout it runs.
        "schedule": asked.schedule if asked.schedule in space.schedules else None,
        "schedules": [kind for kind in asked.schedules or [] if kind in space.schedules] or None,
        "recompute": RecomputeChoice.AUTO,
        "allow_recompute": True,
    }), framework, zero_stages_given=False)
    try:
        nearest = make_plan(profile, plan_cluster_spec(plan), request, kind_profiles=load_kind_profiles(plan_file, plan))
    except PipectlError as exc:
        return f"nothing {space_of(framework).title} runs fits either ({exc.message})"
    c = nearest.chosen
    return (
        f"nearest it runs: {layout_words(c)}, {c.predicted_step_seconds:.4g} s/step against "
        f"{layout.predicted_step_seconds:.4g}, peak {format_bytes(max(c.peak_memory_bytes))}; write it with "
        f"`pipectl plan ... --emit {framework.value}`"
    )


def register(app: typer.Typer) -> None:
    """Add `pipectl export-plan` to the root app."""
    app.command("export-plan")(export_plan_command)

"""A plan as another framework's settings (`plan --emit`, `pipectl export-plan`).

    emitted_files(plan, plan_file, Framework.MEGATRON, devices=[...]) -> {relative path: text}

The chosen layout goes to the folder's top; each morph-table entry asked for to `devices-N/`.
A layout the framework cannot run is refused naming the feature (`plan.frameworks.not_expressible`):
a plan made with `--emit` keeps to the framework's layouts throughout, its morph table included.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from pathlib import Path

from pipectl.artifacts.model import ModelConfig
from pipectl.artifacts.plan import Candidate, Framework, Plan
from pipectl.artifacts.profile import ModelProfile
from pipectl.artifacts.run import is_run_file
from pipectl.cluster import plan_cluster_spec
from pipectl.emit.common import Origin, Target, short_label
from pipectl.emit.deepspeed import deepspeed_files
from pipectl.emit.megatron import megatron_files
from pipectl.emit.torchtitan import torchtitan_files
from pipectl.errors import UserInputError
from pipectl.io import load_model
from pipectl.paths import HF_PREFIX, resolve_config
from pipectl.plan.frameworks import not_expressible, space_of
from pipectl.planfile import load_plan_profile, morph_layout

EMITTERS: dict[Framework, Callable[[Target], dict[str, str]]] = {
    Framework.MEGATRON: megatron_files,
    Framework.TORCHTITAN: torchtitan_files,
    Framework.DEEPSPEED: deepspeed_files,
}


def model_config_of(plan: Plan) -> ModelConfig | None:
    """The model's config where its reference is a shipped name, a YAML or an `hf:` folder (its
    config.json read as derived profiles read it: a Llama's GQA, SwiGLU, RMSNorm and rotary
    positions, which the frameworks' files must name); None for a factory, or a folder gone."""
    reference = plan.model_reference or plan.model
    if reference.startswith(HF_PREFIX):
        from pipectl.models.hf import model_config  # transformers, read only for an hf: model

        try:
            return model_config(reference)
        except (UserInputError, OSError, ImportError):
            return None
    if ":" in reference:
        return None
    try:
        return load_model(ModelConfig, resolve_config(reference, "models"))
    except UserInputError:
        return None


def emitted_layouts(
    plan: Plan, framework: Framework, profile: ModelProfile, devices: Sequence[int] = (),
    *, hint: Callable[[int | None, Candidate], str] | None = None,
) -> list[tuple[int | None, Candidate]]:
    """The layouts to write: the chosen one (count None) and the morph table's for each of `devices`.
    One the framework cannot run is refused naming the feature (`plan.frameworks.not_expressible`);
    `hint(count, layout)` adds the line after it."""
    layouts: list[tuple[int | None, Candidate]] = [(None, plan.chosen)]
    layouts += [(devices_count, morph_layout(plan, devices_count)) for devices_count in devices]
    for devices_count, candidate in [*layouts[1:], layouts[0]]:  # the counts asked for by name first
        why = not_expressible(candidate, framework, profile)
        if why is not None:
            where = "the plan's chosen layout" if devices_count is None else f"the plan's layout for {devices_count} devices"
            raise UserInputError(
                f"{space_of(framework).title} cannot run {why} ({where}, {short_label(candidate)})",
                hint=hint(devices_count, candidate) if hint else None,
            )
    return layouts


def fewer_devices_notes(plan: Plan, layouts: Sequence[tuple[int | None, Candidate]]) -> list[str]:
    """A line for each `devices-N/` whose layout runs on fewer than N devices: the best layout that
    keeps the global batch need not use them all, and the folder's name alone would say it does."""
    return [
        f"note: devices-{count}/ holds {short_label(candidate)}, on {candidate.devices} of the {count} devices: the "
        f"best layout that keeps B = {plan.global_batch}"
        for count, candidate in layouts
        if count is not None and candidate.devices != count
    ]


def emitted_files(
    plan: Plan, plan_file: str | Path, framework: Framework, *, devices: Sequence[int] = (),
    profile: ModelProfile | None = None,
) -> dict[str, str]:
    """{path relative to the output folder: text} for the chosen layout and each count in `devices`."""
    plan_path = Path(plan_file)
    profile = profile or load_plan_profile(plan_path, plan)
    layouts = emitted_layouts(plan, framework, profile, devices)
    origin = Origin(
        plan_file=str(plan_file),
        plan_sha256=hashlib.sha256(plan_path.read_bytes()).hexdigest(),
        profile=plan.profile.file if plan.profile else profile.model,
        devices_per_node=_devices_per_node(plan),
    )
    model = model_config_of(plan)
    files: dict[str, str] = {}
    for devices_count, candidate in layouts:
        folder = "" if devices_count is None else f"devices-{devices_count}/"
        texts = EMITTERS[framework](Target(plan, candidate, profile, model, origin))
        files.update({folder + name: text for name, text in texts.items()})
    return files


def _devices_per_node(plan: Plan) -> int:
    cluster = plan_cluster_spec(plan)
    return max(node.devices_per_node for node in cluster.node_types)


def write_files(folder: Path, files: dict[str, str]) -> list[Path]:
    """Write each file under `folder` (made as needed); the paths written, in order. A run
    directory's own file (its ds_config.json) is never replaced: refused before anything is written."""
    own = next((name for name in files if is_run_file(folder / name)), None)
    if own is not None:
        raise UserInputError(f"{folder} is a run directory, and {own} is the run's own: write the files elsewhere",
                             hint="give another folder with -o")
    written = []
    for name, text in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written

"""What every emitted file shares: the layout it holds, where it came from, how far to trust it.

Each file starts with a comment naming the plan, the profile and the pipectl version it came from,
the layout and its prediction, and what the framework will do differently from what pipectl
priced (`differences`): the user reads there how far the predicted step time holds in that
framework.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipectl import __version__
from pipectl.artifacts.layout import layout_label
from pipectl.artifacts.model import ModelConfig
from pipectl.artifacts.plan import Candidate, Framework, Plan
from pipectl.artifacts.profile import ModelProfile
from pipectl.errors import UserInputError
from pipectl.plan.frameworks import not_expressible, space_of

GIB = 1024**3


@dataclass(frozen=True)
class Origin:
    """Where a plan came from, for the header of the files emitted from it."""

    plan_file: str  # as the user named it
    plan_sha256: str
    profile: str  # the profile copy beside plan.json (or the file planned from)
    devices_per_node: int


@dataclass(frozen=True)
class Target:
    """One layout of a plan to write for a framework."""

    plan: Plan
    candidate: Candidate
    profile: ModelProfile
    model: ModelConfig | None  # the model's shape where its reference is a shipped name or a YAML
    origin: Origin

    @property
    def nodes(self) -> int:
        return -(-self.candidate.devices // self.origin.devices_per_node)

    @property
    def label(self) -> str:
        c = self.candidate
        chunks = f" v{c.chunks}" if c.chunks > 1 else ""
        return f"{layout_label(c)}{chunks} ZeRO-{c.zero_stage}"


def check_expressible(target: Target, framework: Framework) -> None:
    """Refuse a layout the framework cannot run, naming the feature (`plan.frameworks.not_expressible`)."""
    why = not_expressible(target.candidate, framework, target.profile)
    if why is not None:
        raise UserInputError(
            f"{space_of(framework).title} cannot run {why}: the layout {target.label} "
            f"({target.candidate.devices} devices)",
        )


def header(target: Target, framework: Framework, differences: list[str], comment: str = "#") -> str:
    """The comment every emitted file starts with."""
    c, plan, origin = target.candidate, target.plan, target.origin
    peak = max(c.peak_memory_bytes) / GIB
    lines = [
        f"pipectl {__version__}: {space_of(framework).title} settings for plan {origin.plan_file} "
        f"(sha256 {origin.plan_sha256[:12]}), profile {origin.profile}",
        f"model {plan.model}, global batch {plan.global_batch}, cluster {plan.cluster}",
        f"layout {target.label} on {c.devices} x {c.device} ({target.nodes} node{'s' if target.nodes != 1 else ''} of "
        f"{origin.devices_per_node}): predicted {c.predicted_step_seconds:.4g} s/step, "
        f"peak {peak:.1f} GiB per device",
        "",
        "What this framework does that pipectl's prediction did not price (how far the step time holds here):",
        *[f"- {line}" for line in differences],
    ]
    return "".join(f"{comment} {line}".rstrip() + "\n" for line in lines)


def engine_differences(profile: ModelProfile, unpriced: list[str]) -> list[str]:
    """The framework's kernels and overlaps: priced where the profile was derived with that
    engine's features (`profile --derive --engine`), else named as not priced."""
    features = profile.engine
    if features is not None and features.named:
        return [f"priced with the profile's engine features ({features.name}): {', '.join(features.named)}"]
    return [f"not priced (the profile times pipectl's own layers): {what}" for what in unpriced]


def stage_summary(target: Target) -> str:
    """'embed + block.0-16 | block.17-33 | ... | block.90-95 + final_norm + head': the cut in layer names."""
    names = [layer.name for layer in target.profile.layers]
    parts = []
    for start, end in target.candidate.stage_layers:
        parts.append(names[start] if end - start == 1 else f"{names[start]}..{names[end - 1]}")
    return " | ".join(parts)

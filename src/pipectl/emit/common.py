"""What every emitted file shares: the layout it holds, where it came from, how far to trust it.

Each file starts with a comment naming the plan, the profile and the pipectl version it came from,
the layout and its prediction, and what the framework will do differently from what pipectl
priced (`differences`): the user reads there how far the predicted step time holds in that
framework.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipectl import __version__
from pipectl.artifacts.layout import Layout, layout_label
from pipectl.artifacts.model import ModelConfig
from pipectl.artifacts.plan import Candidate, Engine, Framework, Plan
from pipectl.artifacts.profile import ModelProfile
from pipectl.plan.frameworks import space_of

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
        return launch_shape(self.candidate.devices, self.origin.devices_per_node, self.candidate.tensor_parallel)[0]

    @property
    def ranks_per_node(self) -> int:
        return launch_shape(self.candidate.devices, self.origin.devices_per_node, self.candidate.tensor_parallel)[1]

    @property
    def label(self) -> str:
        return layout_words(self.candidate)


def launch_shape(devices: int, devices_per_node: int, tensor_parallel: int) -> tuple[int, int]:
    """(nodes, ranks per node) whose product is `devices`, as torchrun needs: whole nodes where the
    layout fills them, else the most ranks per node that divide `devices` and keep each tensor
    group inside a node (or whole nodes inside a group that spans several).

    >>> launch_shape(3072, 8, 4), launch_shape(6, 8, 2), launch_shape(60, 8, 1), launch_shape(60, 8, 4)
    ((384, 8), (1, 6), (10, 6), (15, 4))
    """
    if devices <= devices_per_node:
        return 1, devices
    for per_node in range(devices_per_node, 0, -1):
        if devices % per_node == 0 and (per_node % tensor_parallel == 0 or tensor_parallel % per_node == 0):
            return devices // per_node, per_node
    return devices, 1  # pragma: no cover - one rank per node always divides


def layout_words(candidate: Candidate) -> str:
    """'t4p16d48 interleaved b1 m32 v4 ZeRO-1': the label, its chunks and its ZeRO stage; not which
    of pipectl's engines the plan named (the label's ' v2 torch'), which runs none of these files."""
    chunks = f" v{candidate.chunks}" if candidate.chunks > 1 else ""
    label = replace(Layout.from_candidate(candidate), engine=Engine.DEEPSPEED).label()
    return f"{label}{chunks} ZeRO-{candidate.zero_stage}"


def short_label(candidate: Candidate) -> str:
    """The layout's label, uneven replicas as the most and fewest micro-batches ('m86/85')."""
    c = candidate
    if not c.replicas:
        return layout_label(c)
    counts = [r.micro_batches for r in c.replicas]
    return f"t{c.tensor_parallel}p{c.pipeline_parallel}d{c.data_parallel} {c.schedule.value} b{c.micro_batch_size} m{max(counts)}/{min(counts)}"


def header(target: Target, framework: Framework, differences: list[str], comment: str = "#") -> str:
    """The comment every emitted file starts with."""
    c, plan, origin = target.candidate, target.plan, target.origin
    peak = max(c.peak_memory_bytes) / GIB
    peak_words = f"{peak:.1f} GiB" if peak >= 1 else f"{peak * 1024:.1f} MiB"  # a CPU test model: MiB
    lines = [
        f"pipectl {__version__}: {space_of(framework).title} settings for plan {origin.plan_file} "
        f"(sha256 {origin.plan_sha256[:12]}), profile {origin.profile}",
        f"model {plan.model}, global batch {plan.global_batch}, cluster {plan.cluster}",
        f"layout {target.label} on {c.devices} x {c.device} ({target.nodes} node{'s' if target.nodes != 1 else ''} of "
        f"{target.ranks_per_node}): predicted {c.predicted_step_seconds:.4g} s/step, "
        f"peak {peak_words} per device",
        "",
        "What this framework does that pipectl's prediction did not price (how far the step time holds here):",
        *[f"- {line}" for line in differences],
        *([f"- {c.devices} devices fill no whole nodes of {origin.devices_per_node}: {target.nodes} nodes of "
           f"{target.ranks_per_node} ranks, where pipectl priced ranks filling each node in turn"]
          if target.nodes > 1 and target.ranks_per_node != origin.devices_per_node else []),
    ]
    return "".join(f"{comment} {line}".rstrip() + "\n" for line in lines)


def engine_differences(profile: ModelProfile, unpriced: list[str], framework: str = "",
                       lacks: frozenset[str] = frozenset()) -> list[str]:
    """The framework's kernels and overlaps: priced where the profile was derived with an engine's
    features (`EngineFeatures`, `profile.derive.derive_profile(engine=...)`), else named as not
    priced. Features of that engine which `framework` does not have (`lacks`, by field name) are
    named too: the prediction counted on them."""
    features = profile.engine
    if features is None or not features.named:
        return [f"not priced (the profile times pipectl's own layers): {what}" for what in unpriced]
    notes = [f"priced with the profile's engine features ({features.name}): {', '.join(features.named)}"]
    missing = [name.replace("_", " ") for name, value in features if value is True and name in lacks]
    if missing:
        notes.append(f"{framework} has none of {', '.join(missing)}, which the prediction counted on: expect a "
                     "different step and memory")
    return notes


# The head of a profile of pipectl's own layers is priced with pipectl's loss (`models.transformer.
# lm_loss`), which keeps a 16-bit logit gradient; the frameworks' cross-entropies keep fp32
# log-probabilities (2 bytes more a logit) and pass the fp32 logits whole (the derived peaks differ
# by 6 bytes a logit: tests/plan/test_memory_h100.py).
FP32_LOSS = ("its fp32 cross-entropy ({who}) needs up to 6 bytes more per logit on the last stage than the "
             "chunked loss pipectl priced")


def profile_is_pipectls(target: Target) -> bool:
    """Whether the profile prices pipectl's own layers and loss (measured, or derived without another
    engine's features)."""
    return target.profile.engine is None


def stage_summary(target: Target) -> str:
    """'embed + block.0-16 | block.17-33 | ... | block.90-95 + final_norm + head': the cut in layer names."""
    names = [layer.name for layer in target.profile.layers]
    parts = []
    for start, end in target.candidate.stage_layers:
        parts.append(names[start] if end - start == 1 else f"{names[start]}..{names[end - 1]}")
    return " | ".join(parts)

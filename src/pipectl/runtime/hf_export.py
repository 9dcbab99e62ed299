"""A checkpoint of an `hf:` model as a Hugging Face directory: `pipectl export RUN -o DIR`.

DIR gets the source directory's config.json and tokenizer files, copied, and `model.safetensors`
with every parameter whole in float32 under its Hugging Face name, so that
`AutoModelForCausalLM.from_pretrained(DIR)` loads the trained model. Checkpoint names are DeepSpeed's
pipeline names, `<layer index>.<local name>` and `tied_modules.<key>.<local name>` for the shared
token table; `models.hf.hf_layer_names` maps each layer's local names to the Hugging Face ones. A
tied head is stored once, as the token table, as `save_pretrained` stores it.

The checkpoint is the newest verified one, or the one of `step`; its files are checked against
their manifest before anything is written, and DIR is written whole or not at all.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from pipectl.artifacts.run import JOB_FILE, JobSpec, run_holding
from pipectl.errors import CheckpointError, UserInputError
from pipectl.rundir.run import check_run_given
from pipectl.io import load_model, nearest_existing_parent
from pipectl.paths import HF_CONFIG_FILE, HF_PREFIX, hf_model_dir

log = logging.getLogger(__name__)

# What a Hugging Face directory holds besides config and weights, copied when present.
COMPANION_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
TIED = "tied_modules."


def hf_state(folder: Path, reference: str) -> dict:
    """The checkpoint in `folder` as {Hugging Face name: float32 tensor} for model `reference`."""
    from pipectl.models import build_model
    from pipectl.models.hf import hf_layer_names
    from pipectl.runtime.checkpoint.shards import FP32, ShardReader

    model = build_model(reference)
    names = hf_layer_names(model)
    holders = {layer.tie_key: i for i, layer in enumerate(model.layers) if layer.tie_key and layer.tied_forward is None}
    reader = ShardReader(folder)
    state = {}
    for stored in reader.parameter_names():
        if stored.startswith(TIED):
            key, _, local = stored[len(TIED) :].partition(".")
            index = holders.get(key)
        else:
            head, _, local = stored.partition(".")
            index = int(head) if head.isdigit() else None
        hf_name = names[index].get(local) if index is not None and index < len(names) else None
        if hf_name is None:
            raise CheckpointError(f"{folder}: parameter {stored!r} is not a parameter of {reference}")
        state[hf_name] = reader.whole(stored, FP32).contiguous()
    missing = {n for layer in names for n in layer.values()} - set(state)
    if missing:
        raise CheckpointError(f"{folder}: holds no {sorted(missing)[0]!r} (and {len(missing) - 1} more) of {reference}")
    return state


def export_hf(run_dir: str | os.PathLike[str], output: str | os.PathLike[str], step: int | None = None) -> tuple[Path, int]:
    """Write the run's checkpoint (newest verified, or of `step`) to `output` as a Hugging Face
    directory; returns (output, step). `output` must not exist."""
    from safetensors.torch import save_file

    from pipectl.rundir.checkpoints import list_checkpoints

    job_file = check_run_given(run_dir) / JOB_FILE
    reference = load_model(JobSpec, job_file).model
    if not reference.startswith(HF_PREFIX):
        raise UserInputError(
            f"run {run_dir} trains {reference}, not a Hugging Face model: export writes Hugging Face directories",
            hint="export applies to runs of an hf:PATH model",
        )
    out = Path(output)
    if out.exists():
        raise UserInputError(f"{out} exists; export writes a new directory", hint="give a path that does not exist")
    inside = run_holding(out)
    if inside is not None:  # a folder in a run's checkpoints/ reads as a checkpoint that never committed
        raise UserInputError(f"{out} lies inside the run in {inside}; export writes elsewhere")
    above = nearest_existing_parent(out)
    if above is not None and not above.is_dir():
        raise UserInputError(f"cannot create {out}: {above} is not a folder")
    checkpoints = list_checkpoints(run_dir, hash_files=True)
    verified = [info for info in checkpoints if info.verified]
    chosen = [info for info in verified if step is None or info.step == step]
    if not chosen:
        have = f"verified checkpoints: steps {', '.join(str(info.step) for info in verified)}" if verified else (
            "it has none verified: train it to a checkpoint first (pipectl status --verify names what fails)")
        raise UserInputError(
            f"run {run_dir} has no verified checkpoint" + (f" of step {step}" if step is not None else ""), hint=have,
        )
    skipped = [info.step for info in checkpoints if info.step is not None and info.step > chosen[-1].step and step is None]
    if skipped:  # the newest did not verify: said, not passed over in silence
        log.warning("checkpoint step %s does not verify (pipectl status --verify says why): exporting step %d",
                    skipped[-1], chosen[-1].step)
    info = chosen[-1]
    source = hf_model_dir(reference)
    state = hf_state(Path(info.path), reference)
    staging = out.with_name(f".{out.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        # The weights are float32 whatever the source's dtype: say so, or transformers loads them in it.
        config = json.loads((source / HF_CONFIG_FILE).read_text())
        for key in ("torch_dtype", "dtype"):
            if key in config:
                config[key] = "float32"
        (staging / HF_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        for name in COMPANION_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, staging / name)
        save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt", "pipectl_step": str(info.step)})
        os.chmod(staging / "model.safetensors", 0o644)  # as readable as the files copied beside it
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out, info.step

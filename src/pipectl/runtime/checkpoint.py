"""Atomic, checksummed checkpoints that any later layout can load: weights AND optimizer state.

DeepSpeed's native pipeline checkpoint cannot re-cut optimizer state across a different pipeline
degree, cut or data-parallel degree; its *universal* checkpoint can (measured here, see
shared/DEEPSPEED-ON-CPU.md): ZeRO stage 1, `ds_to_universal --inject_missing_state`, then load
with `{"checkpoint": {"load_universal": true}}`. Weights and Adam moments are stored per
parameter name (one folder per parameter under `zero/`), independent of which stage held them.
The tensor-parallel degree re-cuts too: each save declares how the transformer-block parameters
are split over tensor ranks (`declare_tensor_parallel_parameters`), the converter joins the slices
into whole tensors, and a load at any t takes its rank's slice (a t=2 checkpoint resumes at t=1,
at t=2 x p=2, and a t=1 one at t=2, with the uninterrupted losses).
pipectl uses that converter and adds what it lacks: atomic commits and checksums.

Layout of RUN/checkpoints/:

    .staging/WRITER/TAG/      DeepSpeed's native save (all ranks write; removed after conversion)
    .staging/WRITER/TAG_universal/  converter output, hashed, then renamed to TAG/
                              (WRITER = w<rank 0's pid>-<random>: unique per save, so no two
                              writers share a temporary name; removed after the commit, or
                              after a failed save)
    TAG/                      the universal checkpoint (zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt,
                              mp_rank_XX_model_states.pt with client state) + manifest.json (LAST)
    latest, latest_universal  the newest committed tag (written after its manifest)

A save, collectively on every rank:

    >>> path = save_checkpoint(engine, run_dir, step=10, client_state={"samples": 80})  # doctest: +SKIP
    >>> path.name                                                                         # doctest: +SKIP
    'step00000010'

A load picks the newest tag whose manifest verifies and whose every file reads back as data; a
corrupted, truncated or foreign file is reported by name and the previous checkpoint is used (rank 0
decides, every rank loads the same tag):

    >>> loaded = load_latest(engine, run_dir)                                             # doctest: +SKIP
    >>> loaded.step, loaded.client_state["samples"], loaded.warnings                      # doctest: +SKIP
    (10, 80, [])

DeepSpeed asks to unpickle its own files (`weights_only=False`); pipectl reads them as data only
(`data_only_loads`), and only from a tag whose every file matches the sha256 recorded when this run
wrote it.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import random
import re
import secrets
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from pipectl.artifacts.layout import Layout
from pipectl.artifacts.run import CHECKPOINTS_DIR, LOGS_DIR, MANIFEST_FILE, CheckpointManifest
from pipectl.errors import CheckpointError
from pipectl.io import load_model, sha256_file, write_json_atomic

# torch, DeepSpeed and the tensor-parallel model code are imported inside the functions that use
# them: `pipectl status` and `resize` list and verify checkpoints without loading either.

log = logging.getLogger(__name__)

STAGING_DIR = ".staging"
LATEST_FILE = "latest"
# DeepSpeed's own pointer for `load_checkpoint(dir)` with load_universal (engine.load_checkpoint).
DEEPSPEED_LATEST_FILE = "latest_universal"
STOP_FILE = "stop_requested"  # RUN/stop_requested: stop at the next step boundary (resize)
PIPECTL_STATE_KEY = "pipectl"
DEFAULT_KEEP = 3


def tag_for_step(step: int) -> str:
    """`step00000010` for step 10: tags sort by name in step order."""
    return f"step{step:08d}"


def checkpoints_dir(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR


# --------------------------------------------------------------------------- verification (pure)


def hash_tree(root: Path) -> dict[str, str]:
    """sha256 of every file under `root` (except a manifest), keyed by relative POSIX path."""
    return {
        path.relative_to(root).as_posix(): sha256_file(path)
        for path in sorted(root.rglob("*"))
        if path.is_file() and path.name != MANIFEST_FILE
    }


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint directory and what verification found (`problems` empty = usable)."""

    tag: str
    path: Path
    step: int | None
    manifest: CheckpointManifest | None
    problems: tuple[str, ...] = ()

    @property
    def verified(self) -> bool:
        return not self.problems and self.manifest is not None


def verify_checkpoint(tag_dir: str | os.PathLike[str], *, hash_files: bool = True) -> CheckpointInfo:
    """Check a tag directory against its manifest: the manifest names this folder, every file it
    lists lies inside it (no links), is present and has its sha256, and no other file is there.
    What is verified is what `load_latest` loads: the folder, by its name.

    With `hash_files=False` only presence and sizes are checked (fast; for listings).
    """
    tag_dir = Path(tag_dir)
    manifest_path = tag_dir / MANIFEST_FILE
    if not manifest_path.is_file():
        return CheckpointInfo(tag_dir.name, tag_dir, None, None, (f"{manifest_path}: no manifest (incomplete save)",))
    try:
        manifest = load_model(CheckpointManifest, manifest_path)
    except Exception as exc:  # a torn or edited manifest is a corrupted checkpoint, not a crash
        return CheckpointInfo(tag_dir.name, tag_dir, None, None, (f"{manifest_path}: unreadable manifest ({exc})",))
    problems: list[str] = []
    if tag_dir.is_symlink():
        problems.append(f"{tag_dir}: a link (a checkpoint holds its own files)")
    if manifest.tag != tag_dir.name:
        # A copied folder (a backup) or an edited manifest: the load reads the folder by its tag,
        # so the two must name the same checkpoint.
        problems.append(f"{manifest_path}: names tag {manifest.tag!r}, but lies in folder {tag_dir.name!r}")
    for relative, expected in manifest.files.items():
        path = tag_dir / relative
        if path.resolve() != tag_dir.resolve() / relative:  # the file or a folder on its way is a link
            problems.append(f"{path}: a link (a checkpoint holds its own files)")
        elif not path.is_file():
            problems.append(f"{path}: missing")
        elif relative in manifest.file_bytes and path.stat().st_size != manifest.file_bytes[relative]:
            size = path.stat().st_size
            problems.append(f"{path}: {size:,} bytes, the manifest records {manifest.file_bytes[relative]:,} "
                            f"({'truncated' if size < manifest.file_bytes[relative] else 'grown'})")
        elif hash_files and sha256_file(path) != expected:
            problems.append(f"{path}: sha256 mismatch (file corrupted or modified)")
    on_disk = {p.relative_to(tag_dir).as_posix() for p in tag_dir.rglob("*") if p.is_file() or p.is_symlink()}
    for extra in sorted(on_disk - set(manifest.files) - {MANIFEST_FILE}):
        problems.append(f"{tag_dir / extra}: not in the manifest")
    return CheckpointInfo(tag_dir.name, tag_dir, manifest.step, manifest, tuple(problems))


def list_checkpoints(run_dir: str | os.PathLike[str], *, hash_files: bool = False) -> list[CheckpointInfo]:
    """Every tag directory under RUN/checkpoints, oldest first (staging excluded)."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    tags = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    return [verify_checkpoint(tag, hash_files=hash_files) for tag in tags]


def unloadable_problem(info: CheckpointInfo) -> str | None:
    """Why a verified checkpoint's files cannot be read back as data, or None when every one can.

    A file can match its manifest and still not load: a truncated or rewritten file whose hash
    was recomputed, a pickle that holds more than data. Each file is opened the way the load
    opens it (`torch.load`, data only), memory-mapped: the archive's structure and every object
    record are read, the tensor bytes are not. Needs torch.
    """
    import torch

    if info.manifest is None:
        return f"{info.path}: no manifest to say which files it holds"
    with data_only_loads():
        for relative in sorted(info.manifest.files):
            path = info.path / relative
            try:
                torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            except CheckpointError as exc:
                return exc.message
            except Exception as exc:  # whatever torch raises on a damaged file, named with the file
                reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                return f"{path}: {type(exc).__name__}" + (f": {reason}" if reason else "")
    return None


def skipped_message(info: CheckpointInfo, problems: Iterable[str]) -> str:
    """'checkpoint step 8 could not be loaded (FILE: why; ...)' (the tag when the step is unknown)."""
    name = f"step {info.step}" if info.step is not None else info.tag
    return f"checkpoint {name} could not be loaded ({'; '.join(problems)})"


def find_latest_verified(
    run_dir: str | os.PathLike[str], *, load_check: bool = False
) -> tuple[CheckpointInfo | None, list[str]]:
    """The newest checkpoint whose every file matches its manifest, and a message for each newer
    one skipped (`skipped_message`). With `load_check`, every file must also load as data
    (`unloadable_problem`; needs torch).

    >>> find_latest_verified("/nonexistent/run")
    (None, [])
    """
    warnings: list[str] = []
    for info in reversed(list_checkpoints(run_dir, hash_files=False)):
        checked = verify_checkpoint(info.path, hash_files=True)
        problems = list(checked.problems)
        if not problems and checked.manifest is None:
            problems.append(f"{checked.path}: no manifest")
        if not problems and load_check:
            unloadable = unloadable_problem(checked)
            problems += [unloadable] if unloadable else []
        if not problems:
            return checked, warnings
        warnings.append(skipped_message(checked, problems))
    return None, warnings


def resume_point(
    run_dir: str | os.PathLike[str], *, load_check: bool = False
) -> tuple[CheckpointInfo | None, list[str]]:
    """The verified checkpoint a resume starts from (None when the run has none at all), and
    messages for the newer ones skipped (`find_latest_verified`).

    A folder without a manifest is a save that never committed and does not count. When the run
    has committed checkpoints and none of them verifies, starting from step 0 would repeat the
    steps they hold: that is refused, with every checkpoint's problems, never done silently.
    """
    info, warnings = find_latest_verified(run_dir, load_check=load_check)
    if info is None and any((c.path / MANIFEST_FILE).is_file() for c in list_checkpoints(run_dir)):
        raise CheckpointError(
            f"no checkpoint of {Path(run_dir)} can be loaded: " + "; ".join(warnings),
            hint="restore a good checkpoint, or start over deliberately with pipectl launch --force",
        )
    return info, warnings


# --------------------------------------------------------------------------- RNG state


def capture_rng_state() -> dict[str, Any]:
    """Python, NumPy and torch RNG states as plain data (stored in the checkpoint's client state,
    which is read back with `weights_only=True`: numbers, strings, tuples, lists and tensors only)."""
    import numpy as np
    import torch

    name, keys, position, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    numpy_state = (name, [int(k) for k in keys], int(position), int(has_gauss), float(cached_gaussian))
    return {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}


def restore_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    random.setstate(state["python"])
    name, keys, position, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), position, has_gauss, cached_gaussian))
    torch.set_rng_state(state["torch"])


# --------------------------------------------------------------------------- data-only loading


@contextlib.contextmanager
def data_only_loads() -> Iterator[None]:
    """Every `torch.load` inside reads data only (`weights_only=True`), whatever its caller asks.

    DeepSpeed's own loads of checkpoint files ask for `weights_only=False`, which runs any code a
    pickle names. A checkpoint is data: pipectl's loads go through this, and a file that needs
    more than tensors, numbers, strings and containers is refused with a `CheckpointError` naming
    it. (DeepSpeed calls `torch.load` through the module attribute, so swapping it covers them.)
    """
    import pickle

    import torch
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    original = torch.load

    def load(f: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs["weights_only"] = True
        try:
            return original(f, *args, **kwargs)
        except pickle.UnpicklingError as exc:
            lines = [line.strip() for line in str(exc).splitlines() if "GLOBAL" in line]
            reason = lines[0].split(" was not")[0] if lines else type(exc).__name__
            raise CheckpointError(
                f"{f}: refused to load: it holds more than data ({reason})",
                hint="a checkpoint is data; this file was written by something else or tampered with",
            ) from None

    torch.load = load
    try:
        # DeepSpeed's optimizer state names three classes of its own, all plain data (an IntEnum,
        # a loss scale, a fragment's offset and size), allowed by name; nothing else is.
        with torch.serialization.safe_globals([LossScaler, ZeroStageEnum, fragment_address]):
            yield
    finally:
        torch.load = original


# --------------------------------------------------------------------------- collective helpers


def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _broadcast_from_rank0(value: Any) -> Any:
    """Rank 0's `value` on every rank (identity without a process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# --------------------------------------------------------------------------- save


def convert_to_universal(native_dir: Path, universal_dir: Path, log_path: Path | None = None) -> None:
    """Run DeepSpeed's `ds_to_universal` in this process (one worker: no process pool).

    Its progress output goes to `log_path` (library code does not print).
    """
    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(
        input_folder=str(native_dir),
        output_folder=str(universal_dir),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        # ZeRO-1 pipeline checkpoints lack some state the converter requires; DeepSpeed's flag
        # fills it in (without it the conversion fails: shared/DEEPSPEED-ON-CPU.md).
        inject_missing_state=True,
    )
    sink = open(log_path, "a") if log_path else open(os.devnull, "w")
    with sink, contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink), data_only_loads():
        ds_to_universal.main(args)


def declare_pipeline_replicated_parameters(module: Any) -> list[str]:
    """Tell DeepSpeed's converter that tied modules held by stage 0 are authoritative there.

    A tied module (GPT's embedding, reused by the head on the last stage) is built on every stage
    that holds it, but DeepSpeed keeps only its `tied_weight_attr` in sync: the other parameters
    (the position table) stay at their initial values on the head's stage. The converter merges
    parameters by name, so without this the stale copy of the last stage overwrote the trained
    one (measured: step-5 loss 4.99759 instead of 4.99844 after resuming gpt-tiny at p=2).
    DeepSpeed's own remedy is `pipeline_replicated_parameter_patterns` in the module's
    `universal_checkpoint_info` (used by Megatron-DeepSpeed): matching parameters are taken from
    stage 0 only. Returns the patterns set (empty when the module has no tied module on stage 0).
    """
    from deepspeed.checkpoint.constants import (
        PIPELINE_REPLICATED_PARAMETER_PATTERNS,
        UNIVERSAL_CHECKPOINT_INFO,
        UNIVERSAL_CHECKPOINT_VERSION_KEY,
        UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    )
    from deepspeed.pipe import TiedLayerSpec

    specs = getattr(module, "_layer_specs", None)
    parts = getattr(module, "parts", None)
    if not specs or not parts or len(parts) < 2:
        return []
    first_stage_end = parts[1]
    keys = sorted(
        {spec.key for index, spec in enumerate(specs[:first_stage_end]) if isinstance(spec, TiedLayerSpec)}
    )
    patterns = [rf"^tied_modules\.{re.escape(key)}\." for key in keys]
    info = dict(getattr(module, UNIVERSAL_CHECKPOINT_INFO, None) or {})
    info.setdefault(UNIVERSAL_CHECKPOINT_VERSION_KEY, UNIVERSAL_CHECKPOINT_VERSION_VALUE)
    if patterns:
        info[PIPELINE_REPLICATED_PARAMETER_PATTERNS] = patterns
    setattr(module, UNIVERSAL_CHECKPOINT_INFO, info)
    return patterns


def declare_tensor_parallel_parameters(module: Any) -> dict[str, Any]:
    """Tell DeepSpeed's converter how each transformer-block parameter is split over tensor ranks.

    A universal checkpoint holds every parameter whole (one folder per name); the converter joins
    the t slices of a checkpoint written at t ranks, and a load at another t cuts this rank's slice
    again, both by the patterns in the module's `universal_checkpoint_info`
    (`pipectl.models.tensor_parallel.universal_checkpoint_patterns`). Declared at every t, t=1
    included: the merged files record how to cut them (`cat_dim`), which is what lets a t=1
    checkpoint load into t=2. Returns the entries set (empty for a model without transformer
    blocks, which never runs with t > 1).
    """
    from deepspeed.checkpoint.constants import (
        UNIVERSAL_CHECKPOINT_INFO,
        UNIVERSAL_CHECKPOINT_VERSION_KEY,
        UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    )

    from pipectl.models.tensor_parallel import block_layer_indices, universal_checkpoint_patterns

    entries = universal_checkpoint_patterns(block_layer_indices(getattr(module, "_layer_specs", None) or []))
    if entries:
        info = dict(getattr(module, UNIVERSAL_CHECKPOINT_INFO, None) or {})
        info.setdefault(UNIVERSAL_CHECKPOINT_VERSION_KEY, UNIVERSAL_CHECKPOINT_VERSION_VALUE)
        info.update(entries)
        setattr(module, UNIVERSAL_CHECKPOINT_INFO, info)
    return entries


def tensor_parallel_degree(module: Any) -> int:
    """t of a PipelineModule: the size of its topology's 'model' axis (1 without one)."""
    topology = getattr(module, "_topo", None)
    if topology is None or "model" not in topology.get_axis_names():
        return 1
    return topology.get_dim("model")


def regroup_fused_qkv(zero_dir: Path, parameter_names: list[str], tensor_parallel: int) -> list[Path]:
    """Rewrite the converter's fused-QKV files in [q; k; v] order, marked as 3 sub-parameters.

    Run once on each fresh conversion of a checkpoint written at `tensor_parallel` ranks (see
    `pipectl.models.tensor_parallel.regroup_rank_slices` for why). The marks are DeepSpeed's own
    (`param_n_sub_params` = 3, `cat_dim` = 0): its loader then gives rank r of any t its
    [q_r; k_r; v_r]. Weights and both Adam moments alike; returns the files rewritten.
    """
    import torch
    from deepspeed.checkpoint.constants import CAT_DIM, PARAM, PARAM_N_SUB_PARAMS

    from pipectl.models.tensor_parallel import QKV_SUB_PARAMETERS, regroup_rank_slices

    rewritten = []
    for name in parameter_names:
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            path = zero_dir / name / f"{state}.pt"
            if not path.is_file():  # the converter writes no moments for a parameter never updated
                continue
            stored = torch.load(path, map_location="cpu", weights_only=True)
            stored[PARAM] = regroup_rank_slices(stored[PARAM], tensor_parallel)
            stored[CAT_DIM] = 0
            stored[PARAM_N_SUB_PARAMS] = QKV_SUB_PARAMETERS
            torch.save(stored, path)
            rewritten.append(path)
    return rewritten


def tensor_slicing_problem(tag_dir: str | os.PathLike[str], module: Any) -> str | None:
    """Why the checkpoint in `tag_dir` cannot be cut for `module`'s tensor-parallel ranks, or None.

    DeepSpeed cuts a rank's slice by the marks each merged file carries (`cat_dim`,
    `param_n_sub_params`); a file without them is cut on dim 0 into equal blocks, which for a
    row-parallel weight or the fused QKV silently gives wrong weights. Checkpoints written before
    `declare_tensor_parallel_parameters` lack them, and those written by older tensor-parallel
    blocks used other names (`qkv_weight`). Every block is converted alike, so the first block's
    two special parameters stand for all of them. With t=1 every parameter loads whole and nothing
    is cut: only the names are checked.
    """
    import torch
    from deepspeed.checkpoint.constants import CAT_DIM, PARAM_N_SUB_PARAMS

    from pipectl.models.tensor_parallel import QKV_SUB_PARAMETERS, block_layer_indices

    blocks = block_layer_indices(getattr(module, "_layer_specs", None) or [])
    if not blocks:
        return None
    tensor_parallel = tensor_parallel_degree(module)
    expected = (
        (f"{blocks[0]}.proj.weight", CAT_DIM, 1),
        (f"{blocks[0]}.qkv.weight", PARAM_N_SUB_PARAMS, QKV_SUB_PARAMETERS),
    )
    for name, key, wanted in expected:
        path = Path(tag_dir) / "zero" / name / "fp32.pt"
        if not path.is_file():
            return f"{path.parent}: missing (checkpoint {Path(tag_dir).name} names the block parameters otherwise)"
        if tensor_parallel == 1:
            continue
        if torch.load(path, map_location="cpu", weights_only=True).get(key) != wanted:
            return (
                f"{path}: no record of how {name} is split over tensor-parallel ranks; checkpoint "
                f"{Path(tag_dir).name} cannot be re-cut for {tensor_parallel} tensor ranks"
            )
    return None


def commit_tag(root: Path, staged: Path, tag: str, manifest: CheckpointManifest) -> Path:
    """Rename the staged tag into place, then write its manifest, then move the pointers. A step
    already committed with the same files (hashes) is kept as it is and the staged copy dropped."""
    final = root / tag
    if final.is_dir() and not final.is_symlink():
        committed = verify_checkpoint(final)
        if committed.verified and committed.manifest.files == manifest.files:
            # The same files are committed already (a stop right after a checkpoint saves the step
            # again): keep them. Replacing them would leave no complete copy of this step between
            # moving the old one aside and writing the new one's manifest.
            shutil.rmtree(staged, ignore_errors=True)
            for pointer in (LATEST_FILE, DEEPSPEED_LATEST_FILE):
                write_text_atomic(root / pointer, tag)
            return final
    if final.exists():  # re-saving a step (e.g. after a resume): move the old one aside first
        retired = staged.with_name(f"{tag}_retired")  # beside the staged copy: this writer's own
        shutil.rmtree(retired, ignore_errors=True)
        os.replace(final, retired)
        shutil.rmtree(retired, ignore_errors=True)
    os.replace(staged, final)
    write_json_atomic(final / MANIFEST_FILE, manifest)
    for pointer in (LATEST_FILE, DEEPSPEED_LATEST_FILE):
        write_text_atomic(root / pointer, tag)
    return final


def write_text_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write `text` to a sibling named uniquely for this writer, fsync, rename over `path`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with tmp.open("w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def staging_leftovers(run_dir: str | os.PathLike[str]) -> list[Path]:
    """What lies in RUN/checkpoints/.staging: saves in progress, or left by saves that died."""
    staging = checkpoints_dir(run_dir) / STAGING_DIR
    return sorted(staging.iterdir()) if staging.is_dir() else []


def _remove_dead_writers(staging: Path) -> None:
    """Remove staging folders whose writer (w<pid>-...) is no longer a live process on this host,
    and folders of the older fixed-name layout (a run is written by one job at a time)."""
    for entry in staging.iterdir() if staging.is_dir() else []:
        match = re.fullmatch(r"w(\d+)-[0-9a-f]+", entry.name)
        if match:
            try:
                os.kill(int(match.group(1)), 0)
                continue  # alive (or not ours to signal): its save may be running
            except ProcessLookupError:
                pass
            except PermissionError:
                continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def prune_checkpoints(run_dir: str | os.PathLike[str], keep: int) -> list[Path]:
    """Remove all but the newest `keep` verified tags, and incomplete tags older than the newest one."""
    infos = list_checkpoints(run_dir, hash_files=False)
    good = [i for i in infos if i.verified]
    keep_paths = {i.path for i in good[-keep:]} if keep > 0 else set()
    newest_good_step = good[-1].step if good else None
    removed = []
    for info in infos:
        stale_incomplete = not info.verified and newest_good_step is not None and info.path.name < good[-1].tag
        if (info.verified and info.path not in keep_paths) or stale_incomplete:
            shutil.rmtree(info.path, ignore_errors=True)
            removed.append(info.path)
    return removed


def save_checkpoint(
    engine: Any,
    run_dir: str | os.PathLike[str],
    step: int,
    client_state: dict[str, Any] | None = None,
    *,
    keep: int = DEFAULT_KEEP,
    layout: Layout | None = None,
    data_position: dict[str, int] | None = None,
) -> Path:
    """Save a checkpoint of `engine` after `step` optimizer steps. Call on EVERY rank, at a step boundary.

    1. every rank: DeepSpeed `save_checkpoint` into `.staging/WRITER/TAG` (native ZeRO-1 layout;
       WRITER named by rank 0, unique to this save);
    2. rank 0: convert to a universal checkpoint, drop the native one, hash every file;
    3. rank 0: rename into `checkpoints/TAG`, write `manifest.json` LAST, then `latest`;
    4. rank 0: keep the newest `keep`; every rank waits for rank 0's verdict, so a failure on rank 0
       raises `CheckpointError` everywhere instead of hanging the others.

    `client_state` must hold plain values (numbers, strings, lists, tensors): it is stored in every
    stage's `mp_rank_XX_model_states.pt` and returned by `load_latest`. pipectl adds its own entry
    (step, RNG states, data position) under the key "pipectl".
    """
    started = time.perf_counter()
    rank, _ = _rank_and_world()
    root = checkpoints_dir(run_dir)
    tag = tag_for_step(step)
    writer = None
    if rank == 0:
        _remove_dead_writers(root / STAGING_DIR)  # left by saves that died
        writer = root / STAGING_DIR / f"w{os.getpid()}-{secrets.token_hex(4)}"
        writer.mkdir(parents=True)
    staging = Path(_broadcast_from_rank0(str(writer)))
    native = staging / tag
    universal = staging / f"{tag}_universal"
    state = dict(client_state or {})
    state[PIPECTL_STATE_KEY] = {
        "step": step,
        "rng": capture_rng_state(),
        "data_position": dict(data_position or {}),
    }
    declare_pipeline_replicated_parameters(engine.module)
    declare_tensor_parallel_parameters(engine.module)
    # The broadcast above orders rank 0's clean-up before every rank's writes.
    try:
        engine.save_checkpoint(str(staging), tag=tag, client_state=state, save_latest=False)
    except Exception as exc:  # a full disk, a size limit, a folder made read-only: said plainly
        shutil.rmtree(staging, ignore_errors=True)  # this save's own temporary folder, every rank alike
        log.debug("DeepSpeed's save failed", exc_info=True)
        raise CheckpointError(save_failure_message(exc, run_dir, step), hint=_SAVE_HINT) from exc

    verdict: str | None = None
    if rank == 0:
        try:
            logs = Path(run_dir) / LOGS_DIR
            logs.mkdir(parents=True, exist_ok=True)
            convert_to_universal(native, universal, logs / "checkpoint_convert.log")
            from pipectl.models.tensor_parallel import block_layer_indices, qkv_parameter_names

            specs = getattr(engine.module, "_layer_specs", None) or []
            regroup_fused_qkv(
                universal / "zero",
                qkv_parameter_names(block_layer_indices(specs)),
                tensor_parallel_degree(engine.module),
            )
            shutil.rmtree(native, ignore_errors=True)
            (staging / DEEPSPEED_LATEST_FILE).unlink(missing_ok=True)  # the converter's own pointer
            files = hash_tree(universal)
            sizes = {relative: (universal / relative).stat().st_size for relative in files}
            manifest = CheckpointManifest(
                tag=tag,
                step=step,
                layout=layout,
                data_position=dict(data_position or {}),
                files=files,
                file_bytes=sizes,
                bytes=sum(sizes.values()),
                time_unix=time.time(),
                save_seconds=time.perf_counter() - started,
            )
            commit_tag(root, universal, tag, manifest)
            shutil.rmtree(staging, ignore_errors=True)
            prune_checkpoints(run_dir, keep)
        except Exception as exc:  # reported on every rank below
            shutil.rmtree(staging, ignore_errors=True)
            log.exception(f"checkpoint {tag} failed on rank 0")
            verdict = f"checkpoint {tag} failed on rank 0: " + save_failure_message(exc, run_dir, step)
    verdict = _broadcast_from_rank0(verdict)
    if verdict is not None:
        raise CheckpointError(verdict, hint=_SAVE_HINT)
    return root / tag


_SAVE_HINT = "free space or fix the folder's permissions, then continue with pipectl launch --resume"
_DISK_ERRNOS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file size limit reached",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "read-only file system",
}
_LOW_SPACE_BYTES = 64 << 20  # less than this free after a failed write: the disk is full


def _write_failure_cause(exc: BaseException, folder: Path) -> str | None:
    """Why writing under `folder` failed, when the file system says so; None when it does not.

    An `OSError` names its errno. torch's own writer (`torch.save` to a path) reports only
    "file write failed" or "unexpected pos", so the folder is examined instead: free space
    (`statvfs`), the process's file-size limit (`ulimit -f`; Python ignores SIGXFSZ, so the write
    fails with EFBIG instead of killing the rank), and write permission.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _DISK_ERRNOS:
            cause = _DISK_ERRNOS[current.errno]
            return cause + (f" ({_size_limit_text()})" if current.errno == errno.EFBIG else "")
        current = current.__cause__ or current.__context__
    existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if existing is None:
        return None
    try:
        stats = os.statvfs(existing)
    except OSError:
        return None
    free = stats.f_bavail * stats.f_frsize
    if free < _LOW_SPACE_BYTES:
        return f"no space left on device ({free / 2**20:.1f} MiB free under {existing})"
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if soft != resource.RLIM_INFINITY:
        return f"file size limit reached ({_size_limit_text()})"
    if not os.access(existing, os.W_OK):
        return f"permission denied ({existing} is not writable)"
    return None


def _size_limit_text() -> str:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return "no file size limit" if soft == resource.RLIM_INFINITY else f"ulimit -f: files up to {soft:,} bytes"


def save_failure_message(exc: BaseException, run_dir: str | os.PathLike[str], step: int) -> str:
    """'no space left on device (…) while writing checkpoint step N in RUN/checkpoints; checkpoint
    step M is intact', or the exception itself when the file system gives no cause."""
    root = checkpoints_dir(run_dir)
    intact = [info.step for info in list_checkpoints(run_dir) if info.verified and info.step is not None]
    tail = f"checkpoint step {intact[-1]} is intact" if intact else "the run has no earlier checkpoint"
    cause = _write_failure_cause(exc, root)
    if cause is not None:
        return f"{cause} while writing checkpoint step {step} in {root}; {tail}"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"writing checkpoint step {step} failed ({type(exc).__name__}" + (f": {first}" if first else "") + f"); {tail}"


# --------------------------------------------------------------------------- load


@dataclass
class LoadedCheckpoint:
    """What `load_latest` restored."""

    tag: str
    step: int
    path: Path
    client_state: dict[str, Any]
    data_position: dict[str, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def load_latest(
    engine: Any, run_dir: str | os.PathLike[str], *, restore_rng: bool = True
) -> LoadedCheckpoint | None:
    """Load the newest verified checkpoint into `engine` (weights, optimizer state, RNG). EVERY rank.

    Returns None when the run has no checkpoint (a fresh start). Corrupted newer checkpoints are
    skipped with a warning naming the bad file (in `.warnings`, also logged); when every committed
    checkpoint is bad, `CheckpointError` lists them (`resume_point`): never a silent restart. The engine must
    have been created with `{"checkpoint": {"load_universal": true}}` (pipectl's ds_config has it):
    this is what lets a checkpoint written by another layout load here.
    """
    if not engine.load_universal_checkpoint():
        raise CheckpointError(
            "the DeepSpeed config lacks checkpoint.load_universal = true; pipectl checkpoints are universal",
            hint="regenerate the run's ds_config.json with pipectl launch",
        )
    rank, _ = _rank_and_world()
    choice: tuple[str | None, int | None, list[str], str | None] = (None, None, [], None)
    if rank == 0:  # one rank hashes; all load the same tag
        info, warnings, problem = None, [], None
        try:
            info, warnings = resume_point(run_dir, load_check=True)
        except CheckpointError as exc:
            problem = exc.message
        for warning in warnings:
            log.warning(warning)
        if info is not None:
            problem = tensor_slicing_problem(info.path, engine.module)
        choice = (info.tag if info else None, info.step if info else None, warnings, problem)
    tag, step, warnings, problem = _broadcast_from_rank0(choice)
    if problem is not None:  # raised on every rank, before any of them enters DeepSpeed's load
        raise CheckpointError(problem, hint="restore a good checkpoint, start over with --force, or resume "
                              "with the tensor-parallel degree it was written with")
    if tag is None:
        return None
    root = checkpoints_dir(run_dir)
    with data_only_loads():
        load_path, client_state = engine.load_checkpoint(
            str(root), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
        )
    if load_path is None:
        raise CheckpointError(f"DeepSpeed could not load checkpoint {root / tag}")
    client_state = dict(client_state or {})
    ours = client_state.pop(PIPECTL_STATE_KEY, {})
    if restore_rng and "rng" in ours:
        restore_rng_state(ours["rng"])
    return LoadedCheckpoint(
        tag=tag,
        step=int(ours.get("step", step)),
        path=root / tag,
        client_state=client_state,
        data_position=dict(ours.get("data_position", {})),
        warnings=list(warnings),
    )


# --------------------------------------------------------------------------- stopping


class StopFlag:
    """Set by SIGTERM/SIGINT (or a RUN/stop_requested file): stop at the next step boundary."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason = ""

    def set(self, reason: str) -> None:
        self.reason = self.reason or reason
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()


def install_sigterm_handler(signals: tuple[int, ...] = (signal.SIGTERM,)) -> StopFlag:
    """Turn SIGTERM (a spot VM's pre-emption warning) into a flag the training loop polls.

    The worker finishes the current step, checkpoints, and exits 0 (see `should_stop`).
    Must be called from the main thread.
    """
    flag = StopFlag()

    def _handler(signum: int, _frame: Any) -> None:
        flag.set(signal.Signals(signum).name)

    for signum in signals:
        signal.signal(signum, _handler)
    return flag


def should_stop(flag: StopFlag, run_dir: str | os.PathLike[str] | None = None) -> bool:
    """Collective: True on every rank if ANY rank was signalled or RUN/stop_requested exists.

    Call once per step boundary on every rank: one rank stopping alone would deadlock the others.
    """
    import torch
    import torch.distributed as dist

    if run_dir is not None and (Path(run_dir) / STOP_FILE).exists():
        flag.set(STOP_FILE)
    local = 1.0 if flag.is_set() else 0.0
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return bool(local)
    votes = torch.tensor([local])
    dist.all_reduce(votes, op=dist.ReduceOp.MAX)
    if votes.item() and not flag.is_set():
        flag.set("another rank")
    return bool(votes.item())

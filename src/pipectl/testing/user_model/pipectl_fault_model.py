"""gpt-tiny with fault points: a rank SIGKILLs (or SIGTERMs) itself at a named point of a named step.

`pipectl_fault_model:build` (`pipectl launch` run from this folder) is gpt-tiny, layer for layer
and weight for weight (the same classes, subclassed only to attach hooks, so parameter names and
checkpoints are gpt-tiny's). In a rank whose environment names a trigger file
(`PIPECTL_FAULT_TRIGGER`, JSON `{"rank", "step", "point", "nth", "action"}`, or a list of
such), the rank counts
events of each point per step and, at the `nth` (0-based) event of `point` in `step` on `rank`,
acts:

    forward     a fault layer's forward is about to run (pre-hook)
    backward    autograd reaches a fault layer's output (tensor hook): inside the stage's backward
    allreduce   a collective entered after the step's backward and before its optimizer step:
                tied-weight and data-parallel gradient reductions, the gradient norm (the peers
                are inside it or on their way)
    optimizer   an optimizer's `step` is about to run (torch's global pre-hook)
    save        a rank's background writer is about to write its checkpoint file
    written     a rank's checkpoint file is written and fsynced, its report not yet (a kill
                here is a kill during a background write: the main thread is training on)
    commit      rank 0 is about to write the manifest of a tag already renamed into place
    metrics     rank 0 is about to append the step's line to metrics.jsonl

    save, written and commit happen in the checkpoint's background thread; they are counted at
    the step the checkpoint holds (the step whose end it was taken at), whatever step the main
    thread has reached meanwhile.

    action      kill: SIGKILL (nothing runs after it); term: SIGTERM (the rank's handler stops
                it at the next step boundary); enospc: the write raises OSError(ENOSPC) (save,
                commit and metrics only: a full disk); sleep: pause `seconds` (a slow rank: the job
                stays busy, its results unchanged); stop: SIGSTOP (a hung rank: alive, silent,
                its peers waiting in their collectives until the collective timeout)

Steps are counted as the worker counts them, 1-based, from the start of this process: a step
begins with the first forward after an optimizer step. (Triggers are meant for a fresh run; a
resumed rank would count from its checkpoint's step + 1 only if it started at step 0.)

With `PIPECTL_FAULT_DISK_FREE` (bytes) a rank's disk reports at most that much free: a disk too
small for any checkpoint.

Before acting, the rank lists the triggers it fired in `fired-rank{R}.json` in `PIPECTL_FAULT_RECORDS` (a folder), so
a driver knows the fault happened where it was asked. With `PIPECTL_FAULT_CENSUS=1` every event
is counted into `census-rank{R}.json` there instead (a fault-free run: how many events of each
point each step has, from which random points are drawn). Without these variables, or in a
process that is not a rank (the launching CLI imports this module to check the model), nothing
is installed.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch

from pipectl.models import ModelLayers, build_model

TRIGGER_VARIABLE = "PIPECTL_FAULT_TRIGGER"
RECORDS_VARIABLE = "PIPECTL_FAULT_RECORDS"
CENSUS_VARIABLE = "PIPECTL_FAULT_CENSUS"
DISK_FREE_VARIABLE = "PIPECTL_FAULT_DISK_FREE"  # bytes a rank's disk reports free (`_small_disk`)
POINTS = ("forward", "backward", "allreduce", "optimizer", "save", "written", "commit", "metrics")
ACTIONS = ("kill", "term", "enospc", "sleep", "stop")
# Gradient collectives, at the level DeepSpeed calls them (deepspeed.comm) and below (torch).
_COLLECTIVES = {
    "deepspeed.comm": ("all_reduce", "all_reduce_coalesced", "inference_all_reduce", "reduce", "reduce_scatter_fn",
                       "reduce_scatter_tensor", "reduce_scatter"),
    "torch.distributed": ("all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor"),
}  # fmt: skip


class Probe:
    """This rank's event counter and trigger (one per process)."""

    def __init__(self, rank: int, triggers: list[dict], records: Path, census: bool) -> None:
        self.rank = rank
        self.triggers = list(triggers)
        self.fired: list[dict] = []
        self.records = records
        self.census = census
        self.step = 1
        self.after_optimizer = False
        self.after_backward = False
        self.counts: dict[int, dict[str, int]] = {}
        self.depth = threading.local()  # a collective inside a collective counts once
        # The checkpoint's writer thread counts its events beside the training thread.
        self.lock = threading.RLock()

    def begin_forward(self) -> None:
        if self.after_optimizer:
            self.step += 1
            self.after_optimizer = False
        self.after_backward = False

    def event(self, point: str, path: object = None, step: int | None = None) -> None:
        with self.lock:
            step = self.step if step is None else step
            counts = self.counts.setdefault(step, {})
            nth = counts.get(point, 0)
            counts[point] = nth + 1
            if self.census:
                self._write(f"census-rank{self.rank}.json", {"rank": self.rank, "events": self.counts}, sync=False)
            due = next((t for t in self.triggers
                        if (t["rank"], t["step"], t["point"], t["nth"]) == (self.rank, step, point, nth)), None)  # fmt: skip
            if due is not None:
                self.triggers.remove(due)  # each fires once
                self.fired.append({**due, "pid": os.getpid(), "time_unix": time.time()})
                self._write(f"fired-rank{self.rank}.json", {"fired": self.fired})
        if due is not None:
            self._act(due, path)  # outside the lock: a pause or a stop must not hold the other thread

    def _act(self, t: dict, path: object) -> None:
        if t["action"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif t["action"] == "term":
            os.kill(os.getpid(), signal.SIGTERM)
        elif t["action"] == "sleep":
            time.sleep(float(t.get("seconds", 10)))
        elif t["action"] == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)  # alive and silent until someone kills it
        else:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    def _write(self, name: str, payload: dict, *, sync: bool = True) -> None:
        target = self.records / name
        tmp = target.with_name(f".{name}.tmp")
        with tmp.open("w") as handle:
            json.dump(payload, handle)
            if sync:  # on disk before the kill
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(tmp, target)


PROBE: Probe | None = None


def _install(probe: Probe) -> None:
    """Global hooks: optimizer steps, the rank file's write, the manifest write, gradient collectives."""
    import importlib

    from pipectl.rundir import checkpoints as checkpoint
    from pipectl.runtime.checkpoint import checkpointer

    def before_step(_optimizer, _args, _kwargs):
        probe.event("optimizer")

    def after_step(_optimizer, _args, _kwargs):
        probe.after_optimizer = True
        probe.after_backward = False

    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    register_optimizer_step_pre_hook(before_step)  # global: every optimizer of the process
    register_optimizer_step_post_hook(after_step)

    original_save = checkpointer.write_rank_file

    def write_rank_file(path, tensors, header):
        probe.event("save", path, step=header.step)
        size = original_save(path, tensors, header)
        probe.event("written", path, step=header.step)
        return size

    checkpointer.write_rank_file = write_rank_file

    original_write = checkpoint.write_json_atomic

    def write_json_atomic(path, payload, *args, **kwargs):
        if Path(path).name == checkpoint.MANIFEST_FILE:
            probe.event("commit", path, step=payload.step)
        return original_write(path, payload, *args, **kwargs)

    checkpoint.write_json_atomic = write_json_atomic

    from pipectl.rundir.metrics import MetricsWriter

    original_append = MetricsWriter._append

    def append(fd, data):
        probe.event("metrics", "metrics.jsonl")
        return original_append(fd, data)

    MetricsWriter._append = staticmethod(append)

    for module_name, names in _COLLECTIVES.items():
        module = importlib.import_module(module_name)
        for name in names:
            if callable(getattr(module, name, None)):
                setattr(module, name, _counted(probe, getattr(module, name)))


def _counted(probe: Probe, function):
    def collective(*args, **kwargs):
        depth = getattr(probe.depth, "value", 0)
        if depth == 0 and probe.after_backward:
            probe.event("allreduce")
        probe.depth.value = depth + 1
        try:
            return function(*args, **kwargs)
        finally:
            probe.depth.value = depth

    return collective


def _on_forward(_module, _inputs):
    PROBE.begin_forward()
    PROBE.event("forward")


def _on_output(_module, _inputs, output):
    tensors = output if isinstance(output, (tuple, list)) else (output,)
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
            tensor.register_hook(_on_gradient)
            break


def _on_gradient(_gradient):
    PROBE.after_backward = True
    PROBE.event("backward")


def _probed(cls: type) -> type:
    """`cls` with the probe's hooks on each instance (the same name, parameters and state)."""

    def __init__(self, *args, **kwargs):
        cls.__init__(self, *args, **kwargs)
        if PROBE is not None:
            self.register_forward_pre_hook(_on_forward)
            self.register_forward_hook(_on_output)

    return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__, "__qualname__": cls.__qualname__})


def _small_disk() -> None:
    """In a rank whose environment names `DISK_FREE_VARIABLE` (bytes): the disk reports at most that
    much free (`shutil.disk_usage`, what the checkpointer asks before a save), a disk too small for
    a checkpoint without filling one."""
    free = os.environ.get(DISK_FREE_VARIABLE)
    if "RANK" not in os.environ or not free:
        return
    import shutil

    real = shutil.disk_usage

    def disk_usage(path):
        usage = real(path)
        return type(usage)(usage.total, usage.used, min(usage.free, int(free)))

    shutil.disk_usage = disk_usage


def _start() -> None:
    """Install the probe in a rank (RANK set) whose environment asks for one."""
    global PROBE
    _small_disk()
    trigger_path = os.environ.get(TRIGGER_VARIABLE)
    census = os.environ.get(CENSUS_VARIABLE) == "1"
    records = os.environ.get(RECORDS_VARIABLE)
    if "RANK" not in os.environ or not records or not (trigger_path or census):
        return
    triggers = json.loads(Path(trigger_path).read_text()) if trigger_path else []
    triggers = [triggers] if isinstance(triggers, dict) else triggers
    for trigger in triggers:
        if trigger["point"] not in POINTS or trigger["action"] not in ACTIONS:
            raise ValueError(f"fault trigger {trigger} names an unknown point or action")
    PROBE = Probe(int(os.environ["RANK"]), triggers, Path(records), census)
    _install(PROBE)


_start()


def build() -> ModelLayers:
    """gpt-tiny, each layer's class subclassed to carry the probe's hooks."""
    model = build_model("gpt-tiny")
    layers = [replace(layer, module_cls=_probed(layer.module_cls)) for layer in model.layers]
    return replace(model, name="gpt-tiny-faults", layers=layers)

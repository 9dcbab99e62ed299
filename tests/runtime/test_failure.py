"""A rank's failure record: out of memory recognised, the phase and layer read from the traceback,
the record written and read back (the launching terminal's side is in tests/cli/test_cli_launch.py)."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from pipectl.artifacts.layout import Layout
from pipectl.rundir.failures import RankContext, failure_path, failure_record, is_out_of_memory, locate, read_failures, write_failure
from pipectl.schedule.ir import Action, ScheduleKind

IMPOSSIBLE = 2**60  # bytes no machine has


def allocator_error() -> RuntimeError:
    """What torch's CPU allocator raises when memory runs out (a RuntimeError, not MemoryError)."""
    with pytest.raises(RuntimeError) as caught:
        torch.empty(IMPOSSIBLE, dtype=torch.uint8)
    return caught.value


def test_out_of_memory_is_the_allocators_error_memoryerror_or_cudas_type_and_nothing_else():
    assert is_out_of_memory(allocator_error())
    assert is_out_of_memory(MemoryError())
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    try:
        try:
            torch.empty(IMPOSSIBLE, dtype=torch.uint8)
        except RuntimeError as exc:
            raise ValueError("the layer failed") from exc
    except ValueError as wrapped:
        assert is_out_of_memory(wrapped)
    assert not is_out_of_memory(RuntimeError("Connection closed by peer [127.0.0.1]:1973"))
    assert not is_out_of_memory(ValueError("shape mismatch"))


class Hungry(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + x.new_empty(IMPOSSIBLE // x.element_size())[:1]


class HungryGradient(torch.autograd.Function):
    """Identity forward; its backward asks for the impossible (a backward OOM, inside autograd)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad + grad.new_empty(IMPOSSIBLE // grad.element_size())[:1]


class StageModule(nn.Module):
    """Runs its layers as DeepSpeed's PipelineModule.forward does: `curr_layer` (the model's layer
    index) is set right before each layer is called."""

    def __init__(self, layers: list[nn.Module], start: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self._local_start = start
        self.curr_layer = None

    def forward(self, x):
        for index, layer in enumerate(self.layers):
            self.curr_layer = index + self._local_start
            x = layer(x)
        return x


class Engine:
    """The frames a failure passes through in PlannedPipelineEngine: `_exec_*` methods of the engine,
    with the planned `action` a local of the compute handlers."""

    def __init__(self, module: StageModule, loss=lambda out: out.sum()) -> None:
        self.module = module
        self.loss = loss

    def _exec_schedule(self, handler: str, **kwargs):
        return getattr(self, handler)(**kwargs)

    def _exec_forward_pass(self, buffer_id: int):
        return self.loss(self.module(torch.ones(2, 4, requires_grad=True)))

    def _exec_planned_forward(self, buffer_id: int, action: Action):
        return self._exec_forward_pass(buffer_id)

    def _exec_planned_backward(self, buffer_id: int, action: Action):
        HungryGradient.apply(torch.ones(2, 4, requires_grad=True)).sum().backward()

    def _exec_optimizer_step(self):
        torch.empty(IMPOSSIBLE, dtype=torch.uint8)


def failure_of(engine: Engine, handler: str, **kwargs) -> BaseException:
    with pytest.raises(RuntimeError) as caught:
        engine._exec_schedule(handler, **kwargs)
    return caught.value


def test_a_forward_names_the_layer_that_was_running_and_the_micro_batch():
    engine = Engine(StageModule([nn.Identity(), Hungry(), nn.Identity()], start=5))
    exc = failure_of(engine, "_exec_planned_forward", buffer_id=0, action=Action.parse("1F3"))
    assert locate(exc, engine) == ("forward of micro-batch 3", 6)


def test_a_failure_outside_the_layers_names_no_layer():
    engine = Engine(StageModule([nn.Identity()], start=5), loss=lambda out: Hungry()(out))
    exc = failure_of(engine, "_exec_planned_forward", buffer_id=0, action=Action.parse("1F0"))
    assert locate(exc, engine) == ("forward of micro-batch 0", None)  # the loss, after the last layer
    backward = failure_of(engine, "_exec_planned_backward", buffer_id=1, action=Action.parse("1B2"))
    assert is_out_of_memory(backward) and locate(backward, engine) == ("backward of micro-batch 2", None)
    step = failure_of(engine, "_exec_optimizer_step")
    assert locate(step, engine) == ("optimizer step", None)


def test_the_record_holds_stage_layer_layout_and_the_plans_figure_and_reads_back(tmp_path):
    engine = Engine(StageModule([nn.Identity(), Hungry()], start=2))
    layout = Layout(
        pipeline_parallel=2, data_parallel=1, micro_batch_size=4, micro_batches=2,
        stage_layers=((0, 2), (2, 4)), schedule=ScheduleKind.ONE_F_ONE_B, recompute=False,
    )  # fmt: skip
    context = RankContext(
        rank=1, stage=1, step=2, phase="step", layout=layout, layer_names=["in", "a", "b", "hungry"],
        predicted_peak_memory_bytes=(1000, 2000), engine=engine,
    )  # fmt: skip
    exc = failure_of(engine, "_exec_planned_forward", buffer_id=0, action=Action.parse("1F1"))
    record = failure_record(exc, context)
    assert (record.rank, record.stage, record.step, record.phase) == (1, 1, 2, "forward of micro-batch 1")
    assert (record.layer_index, record.layer_name, record.stage_layers) == (3, "hungry", (2, 4))
    assert record.out_of_memory and record.exception == "RuntimeError" and "can't allocate memory" in record.message
    assert record.predicted_peak_memory_bytes == 2000 and record.micro_batch_size == 4 and record.recompute is False
    assert record.peak_rss_bytes > 0 and record.peak_allocated_bytes is None

    started = time.time()
    write_failure(tmp_path, record)
    peer = failure_record(RuntimeError("Connection closed by peer"), RankContext(rank=0))  # before its engine
    write_failure(tmp_path, peer.model_copy(update={"time_unix": record.time_unix - 1}))  # recorded first
    failure_path(tmp_path, 7).write_text("{not json")  # a record cut short is skipped
    found = read_failures(tmp_path)
    assert [(r.rank, r.out_of_memory) for r in found] == [(1, True), (0, False)]  # the memory first
    assert found[1].phase == "start-up" and found[1].stage is None
    assert read_failures(tmp_path, since_unix=started + 3600) == []

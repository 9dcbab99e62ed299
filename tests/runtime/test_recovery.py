"""In-memory recovery, the pure parts: how a rank of one replica's torchrun numbers itself, which
errors mean a lost peer, what a recovery request must say, and when the agent refuses. The real
kill -9 runs are tests/resize/test_replica_recovery.py."""

from __future__ import annotations

import doctest

import pytest
from pydantic import ValidationError

import pipectl.resize.replicas
import pipectl.runtime.elastic.recovery
from pipectl.artifacts.morph import LiveResizeRequest, MorphRecord, MorphTrigger
from pipectl.io import write_json_atomic
from pipectl.resize.replicas import recovery_blocker
from pipectl.runtime.elastic import recovery
from pipectl.rundir.live_requests import pending_generation, request_path


def test_doctests():
    for module in (pipectl.runtime.elastic.recovery, pipectl.resize.replicas):
        assert doctest.testmod(module).failed == 0


def test_a_rank_of_one_replicas_torchrun_takes_the_jobs_numbering(monkeypatch):
    for name in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):  # restored after the test
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "1")  # torchrun's, within the replica
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv(recovery.RANK_OFFSET_VARIABLE, "4")
    monkeypatch.setenv(recovery.WORLD_SIZE_VARIABLE, "6")
    monkeypatch.setenv(recovery.MASTER_ADDR_VARIABLE, "127.0.0.1")
    monkeypatch.setenv(recovery.MASTER_PORT_VARIABLE, "29777")
    assert recovery.adopt_replica_environment() and recovery.under_agent()
    import os

    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_PORT"]) == ("5", "6", "29777")
    assert "TORCHELASTIC_USE_AGENT_STORE" not in os.environ


def test_a_rank_under_plain_torchrun_is_left_as_it_is(monkeypatch):
    monkeypatch.delenv(recovery.RANK_OFFSET_VARIABLE, raising=False)
    assert not recovery.adopt_replica_environment() and not recovery.under_agent()


def test_a_lost_peer_is_told_from_the_errors_chain():
    try:
        try:
            raise RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer")
        except RuntimeError as inner:
            raise ValueError("DeepSpeed step failed") from inner
    except ValueError as outer:
        assert recovery.is_peer_loss(outer)
    assert not recovery.is_peer_loss(RuntimeError("CUDA out of memory"))


def record() -> MorphRecord:
    return MorphRecord(
        trigger=MorphTrigger.FAILURE, requested_unix=1.0, requested_devices=2, from_devices=4, from_layout="a",
        to_devices=2, to_layout="b", global_batch=8, resume_step=0, target_steps=10, stopped_running_job=False,
        plan_source="morph-table", path="live",
    )  # fmt: skip


def request(**fields) -> LiveResizeRequest:
    values = dict(generation=1, from_devices=4, to_devices=2, master_addr="127.0.0.1", master_port=29500,
                  record=record(), survivors=[2, 3], meeting_port=29501)  # fmt: skip
    return LiveResizeRequest(**{**values, **fields})


def test_a_recovery_request_names_distinct_survivors_a_meeting_port_and_no_more_ranks_than_survive():
    assert request().recovery and not request(survivors=[], meeting_port=None).recovery
    for bad in ({"meeting_port": None}, {"survivors": [2, 2]}, {"survivors": [4]}, {"to_devices": 3}):
        with pytest.raises(ValidationError):
            request(**bad)


def test_a_recovery_request_is_not_taken_as_a_planned_resize_at_a_step_boundary(tmp_path):
    write_json_atomic(request_path(tmp_path), request())
    assert pending_generation(tmp_path, 0) == 0
    write_json_atomic(request_path(tmp_path), request(survivors=[], meeting_port=None))
    assert pending_generation(tmp_path, 0) == 1


def test_the_agent_refuses_when_the_copy_of_a_lost_replica_was_lost_too_or_a_rank_failed_by_itself():
    assert recovery_blocker({1}, 4, {}, 2, False) is None
    assert "held the only copy" in recovery_blocker({2, 3}, 4, {}, 2, False)
    assert recovery_blocker({0, 2}, 4, {}, 2, False) is None  # each lost replica's neighbour survives
    assert "failed on its own" in recovery_blocker({1}, 2, {3: "ZeroDivisionError: division by zero"}, 2, False)
    assert recovery_blocker({1}, 2, {3: "Connection closed by peer"}, 2, False) is None
    assert "per launch" in recovery_blocker({1}, 2, {}, 1, True)

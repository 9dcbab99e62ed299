"""Elastic restarts: the morph table's layout for the new world size, and its DeepSpeed config."""

from __future__ import annotations

import json

import pytest

from pipectl.artifacts.plan import MorphEntry, Plan
from pipectl.errors import UserInputError
from pipectl.runtime.engines.dsconfig import DeepSpeedConfigRejected, parse_with_deepspeed, validated_config
from pipectl.runtime.elastic.world_size import ds_config_for_candidate, plan_for_world_size

from builders import gpt_tiny_candidate as candidate, plan_of


def table_plan() -> Plan:
    """B = 8: 1 -> p1 m4, 2 -> p2 m4, 3 -> the 2-device plan (8 cannot be split over 3), 4 -> p2 d2 m2."""
    table = {1: candidate(1, m=4, b=2), 2: candidate(2), 3: candidate(2), 4: candidate(2, 2, m=2)}
    entries = [MorphEntry(devices=n, candidate=c) for n, c in table.items()]
    return plan_of(candidate(), global_batch=8, morph_table=entries)


def test_plan_for_world_size_uses_the_table():
    plan = table_plan()
    assert plan_for_world_size(plan, 2) == candidate()
    assert plan_for_world_size(plan, 4) == candidate(2, 2, m=2)
    with pytest.raises(UserInputError, match="uses only 2"):
        plan_for_world_size(plan, 3)
    with pytest.raises(UserInputError, match="no layout for 6 ranks"):
        plan_for_world_size(plan, 6)


def test_ds_config_for_candidate_changes_only_batch_and_pipeline():
    before = validated_config(table_plan())
    after = ds_config_for_candidate(before, candidate(2, 2, m=2), global_batch=8)
    changed = {k for k in before if before[k] != after[k]}
    assert changed == {"gradient_accumulation_steps"}  # p stays 2; B and b unchanged
    after_p1 = ds_config_for_candidate(before, candidate(1, m=4), global_batch=8)
    assert after_p1["pipeline"]["partition"] == [0, 9] and after_p1["optimizer"] == before["optimizer"]
    assert json.dumps(after_p1)  # still plain JSON


def test_ds_config_for_another_data_parallel_degree_passes_deepspeeds_parser():
    before = validated_config(table_plan())  # p=2, d=1: accumulation 4
    with pytest.raises(DeepSpeedConfigRejected):  # what an elastic group of 4 would hit unchanged
        parse_with_deepspeed(before, 2)
    parsed = parse_with_deepspeed(ds_config_for_candidate(before, candidate(2, 2, m=2), global_batch=8), 2)
    assert (parsed.train_batch_size, parsed.gradient_accumulation_steps) == (8, 2)

"""Pinned degrees on a cluster of several device kinds: a pinned d that only a split over the kinds
holds is found whatever `--all` and `--top` say, and pins no kind can hold say why in one line."""

from __future__ import annotations

import json

import pytest

from pipectl.artifacts.plan import PlanRequest
from pipectl.cluster import load_cluster
from pipectl.models.registry import load_model_config
from pipectl.catalog import get_device
from pipectl.errors import UserInputError
from pipectl.plan.search import plan
from pipectl.profile.derive import derive_profile
from pipectl.testing.profiles import synthetic_profile

from tests.e2e.test_first_hour import pipectl, said, succeeded


@pytest.fixture(scope="module")
def gpt_small_kinds():
    """gpt-small derived for each kind of mixed-v100-p100 (V100 first, the profile `plan` prices with)."""
    config = load_model_config("gpt-small")
    return [derive_profile(config, get_device(kind), [1, 2, 4, 8]) for kind in ("v100-16gb", "p100")]


def pinned_d(profiles, **extra):
    request = PlanRequest(global_batch=256, devices=16, data_parallel=16, morph=False, **extra)
    return plan(profiles[0], load_cluster("mixed-v100-p100"), request, kind_profiles=profiles[1:]).chosen


def test_a_pinned_d_only_a_split_holds_is_found_without_all(gpt_small_kinds):
    # 16 replicas on 8 V100s and 8 P100s: t = p = 1 on every device. The split's pipelines used to be
    # drawn from the best kind's ten fastest layouts (all p > 1): found with --all only.
    everything = pinned_d(gpt_small_kinds, include_all=True)
    for extra in ({}, {"top": 1}):
        chosen = pinned_d(gpt_small_kinds, **extra)
        assert chosen.device == "mixed" and chosen.data_parallel == 16
        assert chosen == everything, extra


def test_pinned_degrees_no_kind_holds_name_what_each_kind_has():
    profile = synthetic_profile(blocks=4, micro_batch_sizes=[1, 2, 4], device="cpu")
    cluster = load_cluster("local-mixed")  # 1 CPU rank and 1 emulated twice as slow
    with pytest.raises(UserInputError) as caught:
        plan(profile, cluster, PlanRequest(global_batch=16, devices=2, pipeline_parallel=2))
    message = caught.value.message
    assert "t x p = 2" in message and "one device kind" in message
    assert "1 cpu" in message and "1 cpu-slowed-2x" in message, message
    with pytest.raises(UserInputError, match=r"t x p x d = 3 needs 3 devices, more than the 2 available \(local-mixed holds 1 cpu, 1 cpu-slowed-2x\)"):
        plan(profile, cluster, PlanRequest(global_batch=16, data_parallel=3))


def test_a_kind_too_small_for_the_pinned_pipeline_is_left_out_not_fatal(tmp_path):
    # 4 fast + 2 slow devices, p = 4 pinned: the slow kind cannot hold a replica; the fast one plans it.
    from tests.plan.test_hetero import _cluster

    cluster = _cluster(tmp_path, "v100-32gb", "v100-16gb", nodes=(1, 1))
    small = cluster.model_copy(update={"node_types": [cluster.node_types[0],
                                                      cluster.node_types[1].model_copy(update={"devices_per_node": 2})]})
    chosen = plan(synthetic_profile(blocks=4, micro_batch_sizes=[1, 2, 4], device="v100-16gb"), small,
                  PlanRequest(global_batch=64, pipeline_parallel=4, morph=False)).chosen
    assert chosen.pipeline_parallel == 4 and chosen.device == "v100-32gb"


def test_the_user_walk_plans_the_same_with_and_without_all(tmp_path):
    for kind, name in (("v100-16gb", "sv.json"), ("p100", "sp.json")):
        assert succeeded(pipectl("profile", "gpt-small", "--derive", "--device", kind, "-o", name, cwd=tmp_path))
    args = ["--profile", "sv.json", "--profile", "sp.json", "--cluster", "mixed-v100-p100", "--global-batch", 256,
            "--devices", 16, "--data-parallel", 16]
    plain = pipectl("plan", *args, "-o", "m.json", cwd=tmp_path)
    assert succeeded(plain), said(plain)
    listed = pipectl("plan", *args, "--all", "-o", "all.json", cwd=tmp_path)
    assert succeeded(listed), said(listed)
    chosen = [json.loads((tmp_path / name).read_text())["chosen"] for name in ("m.json", "all.json")]
    assert chosen[0] == chosen[1] and chosen[0]["data_parallel"] == 16


def test_the_user_walk_says_why_a_pinned_pipeline_does_not_fit_local_mixed(tmp_path):
    assert succeeded(pipectl("profile", "gpt-tiny", "--derive", "--device", "cpu", "-o", "profile.json", cwd=tmp_path))
    done = pipectl("plan", "--profile", "profile.json", "--cluster", "local-mixed", "--global-batch", 16, "--devices", 2,
                   "--pipeline-parallel", 2, "-o", "q.json", cwd=tmp_path)  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr, said(done)
    error = " ".join(done.stderr.split())
    assert "t x p = 2" in error and "one device kind" in error and "1 cpu" in error, said(done)

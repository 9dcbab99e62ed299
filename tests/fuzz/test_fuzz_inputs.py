"""Property-based fuzzing of every file pipectl reads and of its command-line arguments.

Each file kind starts from a valid file made by pipectl itself (or shipped in configs/), is
damaged by `mutations.mutated` / `mutations.damaged_text`, and is handed to the real command that
reads it, in-process through Typer's CliRunner (`pipectl.cli.main.app`), or to the loader the
command calls. The property: exit 0, or exit 2 with an `error:` line naming what is wrong; never a
traceback; a non-finite number never accepted. Nothing is started: launch runs with --dry-run only.

Each test has a short CI subset (derandomized, the same cases every run) and a `slow` sweep that
scripts/slow-tests.sh runs with fresh cases.
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from mutations import check_clean, check_refused, ci, dump, mutated, sweep
from typer.testing import CliRunner

from pipectl.artifacts.profile import LinkClass, LinkClassFit, LinksProfile
from pipectl.artifacts.run import CheckpointManifest
from pipectl.cli.main import app
from pipectl.errors import PipectlError
from pipectl.io import sha256_file, write_json_atomic
from pipectl.paths import configs_dir

runner = CliRunner()
CONFIGS = configs_dir()
_counter = itertools.count()


def cli(*args: str, env: dict[str, str] | None = None):
    return runner.invoke(app, list(args), env=env)


class Valid:
    """Valid files made once per session by pipectl's own commands."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.profile = root / "profile.json"
        check_clean(cli("profile", "gpt-tiny", "--derive", "--device", "cpu", "-b", "1,2", "-o", str(self.profile)))
        self.plan = root / "plan.json"
        result = cli("plan", "--profile", str(self.profile), "--cluster", "local", "--devices", "2",
                     "--global-batch", "8", "-o", str(self.plan))  # fmt: skip
        assert result.exit_code == 0, result.output
        self.links = root / "links.json"
        fit = LinkClassFit(link_class=LinkClass.INTRA_NODE, p2p_latency_seconds=2e-5, p2p_bandwidth_bytes_per_second=5e9,
                           allreduce_latency_seconds=3e-5, allreduce_bandwidth_bytes_per_second=4e9)  # fmt: skip
        write_json_atomic(self.links, LinksProfile(backend="gloo", device="cpu", fits=[fit]))
        # A run directory written but not started (the slurm engine only writes its script).
        self.run = root / "run"
        result = cli("launch", str(self.plan), "--run-dir", str(self.run), "--engine", "slurm", "--steps", "4")
        assert result.exit_code == 0, result.output
        tag = self.run / "checkpoints" / "step2"
        tag.mkdir(parents=True)
        (tag / "model_states.pt").write_bytes(b"weights")
        manifest = CheckpointManifest(tag="step2", step=2, files={"model_states.pt": sha256_file(tag / "model_states.pt")},
                                      bytes=7, data_position={"samples": 16})  # fmt: skip
        write_json_atomic(tag / "manifest.json", manifest)
        (self.run / "checkpoints" / "latest").write_text("step2")

    def scratch(self, name: str) -> Path:
        folder = self.root / f"case{next(_counter)}"
        folder.mkdir()
        return folder / name


@pytest.fixture(scope="session")
def valid(tmp_path_factory) -> Valid:
    return Valid(tmp_path_factory.mktemp("fuzz"))


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def _yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


# --- model YAML (configs/models/*.yaml; pipectl.models.registry) ------------------------------------


def _model_case(valid: Valid, case) -> None:
    from pipectl.models import build_model

    doc, mutations = case
    path = dump(doc, valid.scratch("model.yaml"))
    try:
        build_model(str(path))  # what profile, launch and the ranks call
    except PipectlError:
        pass
    check_refused(cli("profile", str(path), "--derive", "--device", "a100-80gb", "-b", "1", "-o",
                      str(path.with_suffix(".json"))), doc, mutations, what=f"model {mutations}")  # fmt: skip


MODEL_DOCS = [_yaml(CONFIGS / "models" / f"{name}.yaml") for name in ("gpt-tiny", "mlp-tiny", "gpt3-175b")]
model_cases = st.sampled_from(MODEL_DOCS).flatmap(mutated)


@ci(40)
@given(case=model_cases)
def test_model_yaml(valid, case):
    _model_case(valid, case)


@pytest.mark.slow
@sweep(400)
@given(case=model_cases)
def test_model_yaml_sweep(valid, case):
    _model_case(valid, case)


# --- cluster YAML (configs/clusters; pipectl.cluster) ------------------------------------------------


def _cluster_case(valid: Valid, case) -> None:
    doc, mutations = case
    path = dump(doc, valid.scratch("cluster.yaml"))
    result = cli("plan", "--profile", str(valid.profile), "--cluster", str(path), "--global-batch", "8",
                 "--no-morph", "-o", str(path.with_suffix(".json")))  # fmt: skip
    check_refused(result, doc, mutations, what=f"cluster {mutations}")


CLUSTER_DOCS = [_yaml(CONFIGS / "clusters" / f"{name}.yaml") for name in ("local", "a100-8x8")]
cluster_cases = st.sampled_from(CLUSTER_DOCS).flatmap(mutated)


@ci(30)
@given(case=cluster_cases)
def test_cluster_yaml(valid, case):
    _cluster_case(valid, case)


@pytest.mark.slow
@sweep(300)
@given(case=cluster_cases)
def test_cluster_yaml_sweep(valid, case):
    _cluster_case(valid, case)


# --- device catalog (configs/devices.yaml via PIPECTL_CONFIGS; pipectl.catalog) ------------------


def _catalog_case(valid: Valid, case) -> None:
    doc, mutations = case
    configs = valid.scratch("configs")
    shutil.copytree(CONFIGS, configs, ignore=shutil.ignore_patterns("devices.yaml"))
    dump(doc, configs / "devices.yaml")
    env = {"PIPECTL_CONFIGS": str(configs)}
    out = configs / "out.json"
    check_refused(cli("plan", "--profile", str(valid.profile), "--cluster", "local", "--devices", "2",
                      "--global-batch", "8", "--no-morph", "-o", str(out), env=env), doc, mutations,
                  what=f"catalog {mutations}")  # fmt: skip
    check_refused(cli("profile", "gpt-tiny", "--derive", "--device", "a100-80gb", "-b", "2", "-o", str(out), env=env),
                  doc, mutations, what=f"catalog {mutations}")  # fmt: skip


catalog_cases = mutated(_yaml(CONFIGS / "devices.yaml"))


@ci(30)
@given(case=catalog_cases)
def test_device_catalog(valid, case):
    _catalog_case(valid, case)


@pytest.mark.slow
@sweep(300)
@given(case=catalog_cases)
def test_device_catalog_sweep(valid, case):
    _catalog_case(valid, case)


# --- profile JSON (pipectl.artifacts.profile) ---------------------------------------------------------


def _profile_case(valid: Valid, case) -> None:
    doc, mutations = case
    path = dump(doc, valid.scratch("profile.json"))
    check_refused(cli("profile", "show", str(path)), doc, mutations, what=f"profile show {mutations}")
    check_refused(cli("plan", "--profile", str(path), "--cluster", "local", "--devices", "2", "--global-batch", "8",
                      "-o", str(path.with_name("plan.json"))), doc, mutations, what=f"plan {mutations}")  # fmt: skip


# The valid documents below are made by the session fixture; strategies read them when first drawn.
_PROFILE_DOC: list[dict] = []


def _profile_cases():
    return st.deferred(lambda: mutated(_PROFILE_DOC[0]))


@pytest.fixture(scope="session", autouse=True)
def _documents(valid):
    _PROFILE_DOC.append(_json(valid.profile))
    _PLAN_DOC.append(_json(valid.plan))
    _LINKS_DOC.append(_json(valid.links))
    _JOB_DOC.append(_json(valid.run / "job.json"))
    _MANIFEST_DOC.append(_json(valid.run / "checkpoints" / "step2" / "manifest.json"))


@ci(50)
@given(case=_profile_cases())
def test_profile_json(valid, case):
    _profile_case(valid, case)


@pytest.mark.slow
@sweep(500)
@given(case=_profile_cases())
def test_profile_json_sweep(valid, case):
    _profile_case(valid, case)


# --- links JSON (profile links; a cluster's links_file) -----------------------------------------------

_LINKS_DOC: list[dict] = []


def _links_case(valid: Valid, case) -> None:
    doc, mutations = case
    path = dump(doc, valid.scratch("links.json"))
    check_refused(cli("profile", "show", str(path)), doc, mutations, what=f"links show {mutations}")
    cluster = _yaml(CONFIGS / "clusters" / "local.yaml")
    cluster["node_types"][0]["links"] = {"links_file": str(path)}
    cluster_path = dump(cluster, path.with_name("cluster.yaml"))
    result = cli("plan", "--profile", str(valid.profile), "--cluster", str(cluster_path), "--devices", "2",
                 "--global-batch", "8", "--no-morph", "-o", str(path.with_name("plan.json")))  # fmt: skip
    check_refused(result, doc, mutations, what=f"links plan {mutations}")


def _links_cases():
    return st.deferred(lambda: mutated(_LINKS_DOC[0]))


@ci(30)
@given(case=_links_cases())
def test_links_json(valid, case):
    _links_case(valid, case)


@pytest.mark.slow
@sweep(300)
@given(case=_links_cases())
def test_links_json_sweep(valid, case):
    _links_case(valid, case)


# --- plan JSON (pipectl.artifacts.plan, pipectl.planfile) ---------------------------------------------

_PLAN_DOC: list[dict] = []


def _plan_case(valid: Valid, case, *, launch: bool) -> None:
    doc, mutations = case
    # Beside the valid plan, so that its profile copy (profile-<sha>.json) is found.
    path = dump(doc, valid.plan.with_name(f"plan-{next(_counter)}.json"))
    check_refused(cli("simulate", str(path), "--json"), doc, mutations, what=f"simulate {mutations}")
    if launch:
        run_dir = valid.scratch("run")
        check_refused(cli("launch", str(path), "--run-dir", str(run_dir), "--dry-run"), doc, mutations,
                      what=f"launch {mutations}")  # fmt: skip
        assert not run_dir.exists(), "a dry run wrote the run directory"


def _plan_cases():
    return st.deferred(lambda: mutated(_PLAN_DOC[0]))


@ci(50)
@given(case=_plan_cases(), launch=st.booleans())
def test_plan_json(valid, case, launch):
    _plan_case(valid, case, launch=launch)


@pytest.mark.slow
@sweep(500)
@given(case=_plan_cases())
def test_plan_json_sweep(valid, case):
    _plan_case(valid, case, launch=True)


# --- job.json and the checkpoint manifest (pipectl.artifacts.run) --------------------------------------

_JOB_DOC: list[dict] = []
_MANIFEST_DOC: list[dict] = []


def _run_case(valid: Valid, case, relative: str) -> None:
    doc, mutations = case
    run_dir = valid.scratch("run")
    shutil.copytree(valid.run, run_dir)
    dump(doc, run_dir / relative)
    for args in (["status", str(run_dir)], ["status", str(run_dir), "--verify", "--json"],
                 ["launch", str(run_dir / "plan.json"), "--run-dir", str(run_dir), "--resume", "--dry-run"]):  # fmt: skip
        check_clean(cli(*args), what=f"{' '.join(args[:1])} {relative} {mutations}")
    if relative == "job.json":
        check_refused(cli("status", str(run_dir)), doc, mutations, what=f"status {mutations}")


def _job_cases():
    return st.deferred(lambda: mutated(_JOB_DOC[0]))


def _manifest_cases():
    return st.deferred(lambda: mutated(_MANIFEST_DOC[0]))


@ci(25)
@given(case=_job_cases())
def test_job_json(valid, case):
    _run_case(valid, case, "job.json")


@ci(25)
@given(case=_manifest_cases())
def test_checkpoint_manifest(valid, case):
    _run_case(valid, case, "checkpoints/step2/manifest.json")


@pytest.mark.slow
@sweep(250)
@given(case=_job_cases())
def test_job_json_sweep(valid, case):
    _run_case(valid, case, "job.json")


@pytest.mark.slow
@sweep(250)
@given(case=_manifest_cases())
def test_checkpoint_manifest_sweep(valid, case):
    _run_case(valid, case, "checkpoints/step2/manifest.json")


# --- text-level damage of every file kind --------------------------------------------------------------

KINDS = ["profile", "plan", "links", "model", "cluster", "catalog", "job"]


def _text_case(valid: Valid, kind: str, damage) -> None:
    folder = valid.scratch("text")
    folder.mkdir()
    out = str(folder / "out.json")
    if kind == "catalog":
        configs = folder / "configs"
        shutil.copytree(CONFIGS, configs)
        (configs / "devices.yaml").write_bytes(damage((configs / "devices.yaml").read_text()))
        result = cli("plan", "--profile", str(valid.profile), "--cluster", "local", "--devices", "2",
                     "--global-batch", "8", "-o", out, env={"PIPECTL_CONFIGS": str(configs)})  # fmt: skip
    elif kind == "job":
        run_dir = folder / "run"
        shutil.copytree(valid.run, run_dir)
        (run_dir / "job.json").write_bytes(damage((run_dir / "job.json").read_text()))
        result = cli("status", str(run_dir))
    else:
        source = {"profile": valid.profile, "plan": valid.plan, "links": valid.links,
                  "model": CONFIGS / "models" / "gpt-tiny.yaml", "cluster": CONFIGS / "clusters" / "local.yaml"}[kind]  # fmt: skip
        path = (valid.plan.parent if kind == "plan" else folder) / f"{kind}-{next(_counter)}{source.suffix}"
        path.write_bytes(damage(source.read_text()))
        args = {
            "profile": ["profile", "show", str(path)],
            "links": ["profile", "show", str(path)],
            "plan": ["simulate", str(path)],
            "model": ["profile", str(path), "--derive", "--device", "a100-80gb", "-b", "1", "-o", out],
            "cluster": ["plan", "--profile", str(valid.profile), "--cluster", str(path), "--global-batch", "8", "-o", out],
        }[kind]
        result = cli(*args)
    check_clean(result, what=f"damaged {kind}")


@st.composite
def text_cases(draw):
    """A file kind and a damage to its text: truncated, a byte that is not UTF-8, nesting past the
    parser's recursion limit, empty, or a top level that is not a mapping."""
    kind = draw(st.sampled_from(KINDS))
    how = draw(st.sampled_from(["truncate", "byte", "deep", "empty", "scalar"]))
    where = draw(st.floats(0, 1))
    byte = draw(st.sampled_from([b"\xff", b"\xc3", b"\x00", b"\x80\x80"]))
    depth = draw(st.sampled_from([1000, 100_000]))
    scalar = draw(st.sampled_from([b"42", b"[]", b"null", b'"text"', b"- a\n- b\n"]))

    def damage(text: str) -> bytes:
        raw = text.encode()
        at = int(where * (len(raw) - 1))
        return {
            "truncate": lambda: raw[:at],
            "byte": lambda: raw[:at] + byte + raw[at:],
            "deep": lambda: b'{"a": ' + b"[" * depth + b"]" * depth + b"}",
            "empty": lambda: b"",
            "scalar": lambda: scalar,
        }[how]()

    return kind, damage


@ci(30)
@given(case=text_cases())
def test_damaged_text(valid, case):
    _text_case(valid, *case)


@pytest.mark.slow
@sweep(300)
@given(case=text_cases())
def test_damaged_text_sweep(valid, case):
    _text_case(valid, *case)


# --- command-line arguments ------------------------------------------------------------------------

numbers = st.one_of(
    st.sampled_from(["0", "-1", "1", "2", "3", "8", "16", "99999", "4294967296", "1e3", "1.5", "nan", "inf", "-inf",
                     "", " ", "abc", "٣", "１", "0x10", "9" * 40]),  # fmt: skip
    st.integers(-10, 64).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
)
texts = st.one_of(st.text(max_size=12), st.sampled_from(["1f1b", "gpipe", "interleaved", "varuna", "2bw", "1f1b,gpipe",
                                                          "1,2", "0,1", "1:2", "2:1", ",", "a,b", "1KiB,4m", "-1"]))  # fmt: skip
PLAN_OPTIONS = {
    "--global-batch": numbers, "--devices": numbers, "--pipeline-parallel": numbers, "--tensor-parallel": numbers,
    "--data-parallel": numbers, "--micro-batch-size": numbers, "--max-tensor-parallel": numbers,
    "--schedules": texts, "--schedule": texts, "--zero-stages": texts, "--memory-headroom": numbers,
    "--objective": st.sampled_from(["time", "cost", "cost-deadline", "fast"]), "--deadline-hours": numbers,
    "--samples": numbers, "--tokens": numbers, "--top": numbers, "--workers": st.sampled_from(["-1", "0", "1", "2", "x"]),
}  # fmt: skip
SIMULATE_OPTIONS = {
    "--schedule": texts, "--pipeline-parallel": numbers, "--micro-batches": numbers, "--chunks": numbers,
    "--forward-ms": numbers, "--backward-ms": numbers, "--send-ms": numbers, "--allreduce-ms": numbers,
    "--optimizer-ms": numbers, "--jitter-ms": numbers, "--seed": numbers, "--width": numbers,
}  # fmt: skip
LAUNCH_OPTIONS = {
    "--steps": numbers, "--checkpoint-every": numbers, "--keep-checkpoints": numbers, "--seed": numbers,
    "--lr": numbers, "--precision": st.sampled_from(["fp32", "bf16", "fp8", ""]), "--elastic": texts,
    "--nodes": numbers, "--hosts": texts, "--master-addr": texts, "--master-port": numbers, "--timeout": numbers,
    "--engine": st.sampled_from(["local", "torchrun", "deepspeed", "slurm", "mpi"]),
    "--data": st.sampled_from(["builtin", "synthetic", "missing.bin", "", "/dev/null", "/"]),
    "--model": st.sampled_from(["gpt-tiny", "mlp-tiny", "sys:exit", "os:system", "nope:x", "a b", ":", "",
                                "pipectl.cli.main:run", "gpt-1t"]),
}  # fmt: skip
PROFILE_OPTIONS = {"--micro-batch-sizes": st.one_of(texts, numbers), "--dtype": texts, "--attention": texts}


@st.composite
def argument_cases(draw):
    command = draw(st.sampled_from(["plan", "simulate", "launch", "profile"]))
    options = {"plan": PLAN_OPTIONS, "simulate": SIMULATE_OPTIONS, "launch": LAUNCH_OPTIONS, "profile": PROFILE_OPTIONS}[command]
    names = draw(st.lists(st.sampled_from(sorted(options)), min_size=1, max_size=5, unique=True))
    return command, [(name, draw(options[name])) for name in names]


def _arguments_case(valid: Valid, command: str, options: list[tuple[str, str]]) -> None:
    folder = valid.scratch("args")
    folder.mkdir()
    given_args = [part for name, value in options for part in (name, value)]
    base = {
        "plan": ["plan", "--profile", str(valid.profile), "--cluster", "local", "--global-batch", "8", "--no-morph",
                 "-o", str(folder / "plan.json")],
        "simulate": ["simulate", "--schedule", "1f1b", "--pipeline-parallel", "2", "--micro-batches", "4", "--json"],
        "launch": ["launch", str(valid.plan), "--run-dir", str(folder / "run"), "--dry-run"],
        "profile": ["profile", "gpt-tiny", "--derive", "--device", "a100-80gb", "-o", str(folder / "p.json")],
    }[command]  # fmt: skip
    # Later options win in click: the drawn ones come after the base ones.
    result = cli(*base, *given_args)
    check_clean(result, what=f"{command} {given_args}")
    if command == "launch":
        assert not (folder / "run").exists(), "a dry run wrote the run directory"


@ci(60)
@given(case=argument_cases())
def test_arguments(valid, case):
    _arguments_case(valid, *case)


@pytest.mark.slow
@sweep(600)
@given(case=argument_cases())
def test_arguments_sweep(valid, case):
    _arguments_case(valid, *case)

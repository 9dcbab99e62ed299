"""An installed wheel works away from the source tree: it carries the device catalog and the shipped
models and clusters (`configs/`), which an offline GPU host installing from a wheelhouse relies on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_carries_configs_and_an_installed_pipectl_finds_them(tmp_path):
    wheels, site, work = tmp_path / "wheels", tmp_path / "site", tmp_path / "work"
    work.mkdir()
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", wheels, ROOT], check=True)
    (wheel,) = wheels.glob("pipectl-*.whl")
    shipped = {p.relative_to(ROOT / "configs").as_posix() for p in (ROOT / "configs").rglob("*.yaml")}
    with zipfile.ZipFile(wheel) as archive:
        packaged = {name.removeprefix("pipectl/_configs/") for name in archive.namelist() if "/_configs/" in name}
    assert shipped <= packaged

    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", site, wheel], check=True)
    env = {k: v for k, v in os.environ.items() if k != "PIPECTL_CONFIGS"} | {"PYTHONPATH": str(site)}
    where = subprocess.run([sys.executable, "-c", "import pipectl.paths as p; print(p.__file__); print(p.configs_dir())"],
                           cwd=work, env=env, capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    assert Path(where[0]).is_relative_to(site) and Path(where[1]) == site / "pipectl" / "_configs"
    # A shipped model and the device catalog, as a user on that host would name them.
    result = subprocess.run(
        [sys.executable, "-m", "pipectl.cli.main", "profile", "gpt-tiny", "--derive", "--device", "a100-80gb",
         "-o", "profile.json"], cwd=work, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads((work / "profile.json").read_text())["device"] == "a100-80gb"


def test_the_projects_own_scripts_pass_shellcheck():
    import shutil

    scripts = sorted(str(path) for path in (ROOT / "scripts").glob("*.sh")) + [str(ROOT / ".ci" / "run")]
    shellcheck = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    found = subprocess.run([shellcheck, "--severity=warning", *scripts], capture_output=True, text=True)
    assert found.returncode == 0, found.stdout + found.stderr


@pytest.mark.slow
def test_a_wheelhouse_holds_pipectl_deepspeed_and_the_packages_named(tmp_path):
    """scripts/wheelhouse.sh (needs the package index): pipectl and DeepSpeed built here, each named
    package at this environment's version for the Python asked for; a name not installed is refused."""
    script = ROOT / "scripts" / "wheelhouse.sh"
    env = {**os.environ, "PYTHON": sys.executable}
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    built = subprocess.run(["bash", script, "--python-version", version, "--dir", tmp_path / "w", "hjson"],
                           env=env, capture_output=True, text=True)  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    from importlib.metadata import version as installed

    names = sorted(path.name for path in (tmp_path / "w").glob("*.whl"))
    assert [name.split("-")[0] for name in names] == ["deepspeed", "hjson", "pipectl"]
    assert f"deepspeed-{installed('deepspeed')}-" in names[0] and f"hjson-{installed('hjson')}-" in names[1]
    refused = subprocess.run(["bash", script, "--dir", tmp_path / "x", "no-such-package"], env=env,
                             capture_output=True, text=True)  # fmt: skip
    assert refused.returncode != 0 and "no-such-package is not installed" in refused.stderr

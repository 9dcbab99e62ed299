"""The wheel carries `configs/` (the device catalog, shipped models and clusters) as `pipectl/_configs`,
so that an installed pipectl finds them; everything else is in pyproject.toml."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithConfigs(build_py):
    def run(self) -> None:
        super().run()
        source = Path(__file__).resolve().parent / "configs"
        shutil.copytree(source, Path(self.build_lib) / "pipectl" / "_configs", dirs_exist_ok=True)


setup(cmdclass={"build_py": BuildWithConfigs})

"""The build's one addition to pyproject.toml: the wheel carries copies of the run-time data the
checkout keeps outside the package (vfio_cxl/paths.py: DATA, read here as data, not imported), at
vfio_cxl/_data/NAME, where vfio_cxl.paths.data_dir() looks in an installed package."""

import runpy
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
DATA = runpy.run_path(str(HERE / "vfio_cxl" / "paths.py"))["DATA"]


class BuildPyWithData(build_py):
    def run(self):
        super().run()
        for name, source in DATA.items():
            dest = Path(self.build_lib) / "vfio_cxl" / "_data" / name
            shutil.rmtree(dest, ignore_errors=True)
            shutil.copytree(HERE / source, dest)


setup(cmdclass={"build_py": BuildPyWithData})

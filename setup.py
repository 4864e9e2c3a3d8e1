"""Ships ``dtrain-profile.pth`` into site-packages beside the package (pyproject.toml holds everything else).

``DTRAIN_PROFILE=DIR`` must reach every Python process of a job, the children a script spawns itself included:
a ``.pth`` file at the root of site-packages is the one place Python reads at every start (coverage.py and
pytest-cov start their subprocess measurement the same way). Its one line costs an environment lookup where
the variable is unset. Setuptools installs only packages' files, so the wheel's root gets it here: from
``build_py`` (wheels, ``pip install .``) and from ``editable_wheel`` (``pip install -e .``).
"""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = Path(__file__).parent / "src" / "dtrain-profile.pth"


class BuildPyWithPth(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(str(PTH), str(Path(self.build_lib) / PTH.name))


class EditableWheelWithPth(editable_wheel):
    def _run_build_commands(self, dist_name, unpacked_wheel, build_lib, tmp_dir):  # type: ignore[no-untyped-def]
        # What is written into the unpacked wheel is installed at site-packages' root, as in a wheel.
        result = super()._run_build_commands(dist_name, unpacked_wheel, build_lib, tmp_dir)
        self.copy_file(str(PTH), str(Path(unpacked_wheel) / PTH.name))
        return result


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})

"""Packaging a newcomer relies on: one version, minimal core dependencies, extras that cover
what examples and tests import, and ``python -m torch_popxl`` describing the environment."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import torch_popxl

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_version_is_written_once_in_the_package():
    project = PYPROJECT["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "torch_popxl.__version__"
    }
    assert isinstance(torch_popxl.__version__, str) and torch_popxl.__version__.count(".") == 2


def test_core_dependencies_are_torch_and_numpy_and_extras_cover_imports():
    project = PYPROJECT["project"]
    assert [d.split(">")[0] for d in project["dependencies"]] == ["torch", "numpy"]
    extras = project["optional-dependencies"]
    assert {"tqdm", "matplotlib", "torchvision"} <= set(extras["examples"])
    assert {"pytest", "hypothesis", "ruff", "tqdm", "matplotlib"} <= set(extras["test"])
    assert "ninja" in PYPROJECT["build-system"]["requires"]  # setup.py builds with ninja


def test_python_m_torch_popxl_prints_the_environment():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "torch_popxl"], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(None, 1) for line in out.stdout.splitlines() if line.strip())
    assert lines["torch_popxl"].startswith(torch_popxl.__version__)
    assert "C++ extension" in out.stdout and "built (" in out.stdout
    assert "torch " in out.stdout and "CUDA devices" in out.stdout

"""The code base stays lint-clean and formatted (ruff, configured in pyproject.toml)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


PATHS = ["torch_popxl", "tests", "examples", "benchmarks"]


def _ruff() -> str:
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if not Path(ruff).exists():
        pytest.fail("ruff is not installed; scripts/setup.sh installs it")
    return ruff


def test_ruff_check_is_clean():
    out = subprocess.run([_ruff(), "check", *PATHS], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff_format_check_is_clean():
    out = subprocess.run([_ruff(), "format", "--check", *PATHS], cwd=ROOT, capture_output=True,
                         text=True)  # fmt: skip
    assert out.returncode == 0, (
        "These files are not formatted; run `ruff format` on them:\n" + out.stdout + out.stderr
    )

"""The package type-checks: ``mypy`` (configured in pyproject.toml) reports no errors."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_mypy_reports_no_errors():
    probe = subprocess.run([sys.executable, "-m", "mypy", "--version"], capture_output=True,
                           text=True)  # fmt: skip
    if probe.returncode != 0:
        pytest.fail("mypy is not installed; scripts/setup.sh installs it")
    # The files, settings and per-module overrides come from [tool.mypy] in pyproject.toml.
    out = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, "mypy found type errors:\n" + out.stdout + out.stderr
    assert "Success: no issues found" in out.stdout, out.stdout + out.stderr

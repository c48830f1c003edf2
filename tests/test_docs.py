"""Every code block of the README and of docs/*.md runs and prints what the page says.

Note [documentation blocks]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
The ```python blocks of a page run in order in one namespace (a page reads top to bottom, so
a block may use what an earlier one defined), in a temporary working directory, and their
output is checked against ``EXPECTED``. A ```text block is output or a diagram, never run.
Any other block (```bash commands) runs only elsewhere, and says so: the line before it is
``<!-- not run: REASON -->``, naming where it is checked or why it cannot be. A block in no
language, or of another language without that line, fails the test.
"""

from __future__ import annotations

import contextlib
import io
import re
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```$", re.S | re.M)
NOT_RUN = re.compile(r"<!-- not run: \S.*\S -->\n$")

# What a page's blocks print (substrings of their output, in any order).
EXPECTED: dict[str, list[str]] = {
    "README.md": [
        "[[5. 7. 9.]\n [5. 7. 9.]]",
        "[1.5 1.7 1.9]",
        "modeled device: Mk2 GC200 IPU (IPU-M2000)",
        "fits one device: True",
        "frozen: True | head grad: (10, 512) | outputs: (256, 10)",
        "summed loss: float",
    ],
    "docs/porting.md": [
        "aten.gelu.default",
        "[[0.5 0.5 0.5 0.5]\n [0.5 0.5 0.5 0.5]\n [0.5 0.5 0.5 0.5]]",
        "sharded variables (RTS, 1/4 on each replica)          12 B",
        "matmul kernel: aten",
    ],
    "docs/cost_model.md": [
        "Mk2 GC200 IPU (IPU-M2000)\nMk2 GC200 IPU (IPU-M2000) with op_overhead_s changed\nTrue\n",
    ],
    "docs/memory_report.md": [
        "[(None, 153680), (512, 77904)]",
        "Per replica on one Mk2 GC200 IPU (IPU-M2000); memory in MiB",
    ],
    "docs/compile_reference.md": [
        "['exp_avg', 'exp_avg_sq', 'step'] torch.bfloat16",  # bf16 state as torch keeps it
    ],
    "docs/addons.md": [
        "[True, True]\n[True, True]\n",  # tensor parallel: every replica holds the layer's output
        "[[2. 2. 2.]\n [2. 2. 2.]]",
        "['bias', 'weight']",
        "[[4. 4. 4.]] [[3. 3. 3. 3.]]",  # the tensor-parallel addons block
        "True 320 84",  # batch serialisation: same numbers, lower peak
        "[0. 1. 4.] [0. 4. 8.]",  # build_grad through call_module
        "[ 2.  4.  6.  8. 10. 12. 14. 16.] 4 32",  # pipelining: values and copies
    ],
}


def blocks(page: Path) -> list[tuple[str, str, bool]]:
    """(language, code, marked not run) of each fenced block of ``page``."""
    text = page.read_text()
    return [
        (m.group(2), textwrap.dedent(m.group(3)), bool(NOT_RUN.search(text[: m.start()])))
        for m in FENCE.finditer(text)
    ]


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_block_runs_or_says_why_not(page):
    for language, code, marked in blocks(page):
        if language in ("python", "text"):
            continue
        first = code.splitlines()[0] if code.strip() else ""
        assert language and marked, (
            f"{_name(page)}: the block starting {first!r} is ```{language} without a "
            "'<!-- not run: REASON -->' line before it; make it ```python (run), ```text "
            "(output) or say where it is checked (Note [documentation blocks])."
        )


# Pages whose blocks a test of their own runs with stricter checks (line by line).
OWN_TEST = {"docs/compile.md": "tests/test_docs_compile.py"}


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_python_blocks_run_and_print_documented_values(page, tmp_path, monkeypatch):
    if _name(page) in OWN_TEST:
        pytest.skip(f"{_name(page)} runs in {OWN_TEST[_name(page)]}")
    code = [c for language, c, _ in blocks(page) if language == "python"]
    expected = EXPECTED.get(_name(page), [])
    if not code:
        assert not expected, f"{_name(page)} has no python block to print {expected}"
        pytest.skip(f"{_name(page)} has no python block")
    monkeypatch.chdir(tmp_path)  # a block that saves a file (a chart) writes here
    scope: dict = {"__name__": "__docs__"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for block in code:
            exec(compile(block, str(page), "exec"), scope)
    text = out.getvalue()
    for want in expected:
        assert want in text, f"{_name(page)} should print {want!r}; it printed:\n{text}"


def test_expectations_name_pages_that_exist():
    assert set(EXPECTED) <= {_name(p) for p in PAGES}

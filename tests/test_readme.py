"""The README's Python examples run and print what the README says."""

import contextlib
import io
import re
import textwrap
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_python_blocks_run_and_print_documented_values():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 2
    scope: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for block in blocks[1:]:  # the first block only shows the import lines
            exec(compile(textwrap.dedent(block), str(README), "exec"), scope)  # list items indent
    text = out.getvalue()
    assert "[[5. 7. 9.]\n [5. 7. 9.]]" in text
    assert "[1.5 1.7 1.9]" in text
    assert "aten.gelu.default" in text
    assert "matmul kernel: aten" in text
    assert "True (3, 32) (64, 3)\n2\n" in text  # compile: fine-tuning, p.grad, outputs
    assert "float True" in text  # compile: a model that returns its loss
    assert "[[0.5 0.5 0.5 0.5]\n [0.5 0.5 0.5 0.5]\n [0.5 0.5 0.5 0.5]]" in text
    assert (
        "['exp_avg', 'exp_avg_sq', 'step'] torch.bfloat16" in text
    )  # compile: bf16 state as torch
    assert "sharded variables (RTS, 1/4 on each replica)          12 B" in text
    assert "[[2. 2. 2.]\n [2. 2. 2.]]" in text and "['bias', 'weight']" in text
    assert "[[4. 4. 4.]] [[3. 3. 3. 3.]]" in text  # the tensor-parallel addons block
    assert "True 320 84" in text  # batch serialisation: same numbers, lower peak
    assert "[0. 1. 4.] [0. 4. 8.]" in text  # addons: build_grad through call_module
    assert "[ 2.  4.  6.  8. 10. 12. 14. 16.] 4 32" in text  # pipelining: values and copies


ADDONS_PAGE = README.parent / "docs" / "addons.md"


def test_addons_page_tensor_parallel_block_matches_the_unsharded_layer():
    blocks = re.findall(r"```python\n(.*?)```", ADDONS_PAGE.read_text(), re.S)
    assert len(blocks) == 1
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(blocks[0], str(ADDONS_PAGE), "exec"), {})
    # every replica holds the unsharded layer's output, then its input gradient
    assert out.getvalue() == "[True, True]\n[True, True]\n"

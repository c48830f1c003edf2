"""docs/compile.md's Python examples run and print what the page says they do."""

import contextlib
import io
import re
import textwrap
from pathlib import Path

PAGE = Path(__file__).resolve().parent.parent / "docs" / "compile.md"


def test_compile_guide_python_blocks_run_and_print_documented_values():
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)
    assert len(blocks) == 13
    scope: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for block in blocks:
            exec(compile(textwrap.dedent(block), str(PAGE), "exec"), scope)
    lines = out.getvalue().splitlines()
    assert lines[0] == "float torch.Size([32, 20])"  # the step's loss and p.grad
    assert lines[1] == "True True 2"  # fine-tuning: frozen, no grad; state for the head only
    assert lines[2] == "[1.0, 1.0, 2.0, 2.0]"  # unfrozen after a step: its own step count
    assert lines[3] == "(64, 3) True"  # the outputs of the global batch
    assert lines[4] == "float True"  # a model that returns its loss
    assert lines[5:7] == ["3 8", "padded: True"]  # a program per signature; a padded batch
    assert lines[7] == "(5, 3)"  # inference of any batch size
    assert lines[8] == "True"  # a summed loss is eager's global sum
    assert lines[9] == "True"  # a counted mean plus a mean in the forward: eager's loss
    assert lines[10] == "LossDecompositionError"  # sqrt of a mean is refused
    for line in lines[11:14]:  # the clipped norm is clip_grad_norm_'s, bit for bit
        assert re.fullmatch(r"grad norm \d+\.\d{4} True", line), line
    assert lines[14] == "True"  # and so are the weights
    assert lines[15] == "True True 2 True"  # batch norm: the per-replica reference
    # a custom Function's backward reaches the first layer; the unused layer has no gradient
    # and no optimizer state (4 entries: a and b)
    assert lines[16] == "True True 4"
    assert lines[17] == "AssertionError: inputs out of range"  # a Python read of a value
    assert len(lines) == 18

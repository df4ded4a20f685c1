"""docs/llm.md's examples are executed, so they cannot drift from the code."""

import re
from pathlib import Path

PAGE = Path(__file__).resolve().parents[3] / "docs" / "llm.md"


def test_lm_page_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)
    assert len(blocks) == 3
    for block in blocks:
        exec(compile(block, str(PAGE), "exec"), {})

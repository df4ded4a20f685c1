"""docs/training.md's Hugging Face ``Trainer`` example is executed, so it cannot drift from the code."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[2] / "docs" / "training.md"
HEADING = "## Training with Hugging Face's `Trainer`"


def section() -> str:
    text = PAGE.read_text()
    start = text.index(HEADING)
    end = text.find("\n## ", start + len(HEADING))
    return text[start:] if end < 0 else text[start:end]


def test_the_hf_trainer_example_runs(tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers.Trainer needs it
    blocks = re.findall(r"```python\n(.*?)```", section(), flags=re.S)
    assert len(blocks) == 1
    monkeypatch.chdir(tmp_path)  # the example writes hf-run/
    exec(compile(blocks[0], str(PAGE), "exec"), {})
    printed = capsys.readouterr().out
    assert "(6, 'late_stage')" in printed and "'prune')" in printed
    assert (tmp_path / "hf-run" / "model" / "comera_config.json").is_file()


def test_import_comera_and_the_integrations_package_do_not_import_transformers():
    code = (
        "import sys, comera, comera.integrations\n"
        "print(sorted(name for name in ('transformers', 'accelerate') if name in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"

"""The README's Python API example runs as written."""

from __future__ import annotations

import os
import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_api_example_runs(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "README has no python example"
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        exec(compile(blocks[0], "README.md", "exec"), {"__name__": "readme"})
    finally:
        os.chdir(cwd)

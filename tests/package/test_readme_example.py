"""The README's Python API example runs as written, restores what it saved, and leaves
nothing behind in the working directory."""

from __future__ import annotations

import os
import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def _example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "README has no python example"
    return blocks[0]


def test_readme_api_example_runs(tmp_path):
    cwd = os.getcwd()
    os.chdir(tmp_path)
    names: dict[str, object] = {"__name__": "readme"}
    try:
        exec(compile(_example(), "README.md", "exec"), names)
    finally:
        os.chdir(cwd)
    # The example's own run: a hit, restored whole and byte-equal to what was saved.
    plan, result, kv, dest = (names[k] for k in ("plan", "result", "kv", "dest"))
    assert plan.hit_tokens > 0  # type: ignore[attr-defined]
    assert result.outcome == "complete"  # type: ignore[attr-defined]
    assert result.committed_tokens == plan.hit_tokens  # type: ignore[attr-defined]
    for i in range(plan.hit_chunks):  # type: ignore[attr-defined]
        assert dest.chunk_bytes(i) == kv.chunk_bytes(i)  # type: ignore[attr-defined]
    assert not list(tmp_path.iterdir()), "the example left files in the working directory"


def test_readme_api_example_handles_a_miss(tmp_path):
    """With nothing saved the example takes its miss branch instead of allocating an
    empty destination."""
    code = _example().replace("restorer.save(tokens, kv)", "pass")
    assert code != _example(), "the example no longer calls restorer.save(tokens, kv)"
    cwd = os.getcwd()
    os.chdir(tmp_path)
    names: dict[str, object] = {"__name__": "readme"}
    try:
        exec(compile(code, "README.md", "exec"), names)
    finally:
        os.chdir(cwd)
    assert names["plan"].hit_tokens == 0  # type: ignore[attr-defined]
    assert "result" not in names and "dest" not in names

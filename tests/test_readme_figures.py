"""Every figure in the README's results comes from a JSON file under docs/results/.

Each number in the "Results on this machine" section (outside code spans, where the
commands and their parameters are) must be, at the precision the README prints it,
a value in one of those files: a number there, that number in GiB or MiB, or the
ratio of two numbers of the same object (the speedups and ratios the benches print).
Small integers (below 100: W, ranks, rounds, cores) are parameters, not figures.
The files must not carry absolute temporary paths.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
NUMBER = re.compile(r"(?<![\w.,])(\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d+))?(?![\w])")


def _section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("## Results on this machine")
    end = text.index("\n## ", start + 1)
    body = text[start:end]
    body = re.sub(r"`[^`]*`", " ", body)  # commands and file names
    body = re.sub(r"!\[[^\]]*\]\([^)]*\)", " ", body)  # images
    return body


def _numbers(obj, out: set[float]) -> None:
    if isinstance(obj, bool) or obj is None:
        return
    if isinstance(obj, (int, float)):
        out.update((float(obj), obj / (1 << 30), obj / (1 << 20)))
    elif isinstance(obj, dict):
        vals = [v for v in obj.values() if isinstance(v, (int, float)) and not isinstance(v, bool)]
        for a in vals:
            for b in vals:
                if b:
                    out.add(a / b)
        for v in obj.values():
            _numbers(v, out)
    elif isinstance(obj, list):
        for v in obj:
            _numbers(v, out)


def _json_values() -> set[float]:
    out: set[float] = set()
    for f in sorted(RESULTS.glob("*.json")):
        _numbers(json.loads(f.read_text()), out)
    return out


def _matches(value: float, decimals: int, pool: set[float]) -> bool:
    tol = 0.5 * 10**-decimals + 1e-9
    return any(abs(v - value) <= tol for v in pool)


def test_every_results_figure_is_in_a_json():
    pool = _json_values()
    missing = []
    for m in NUMBER.finditer(_section()):
        whole, frac = m.group(1), m.group(2)
        value = float(whole.replace(",", "") + ("." + frac if frac else ""))
        if frac is None and value < 100:
            continue
        if not _matches(value, len(frac or ""), pool):
            missing.append(m.group(0))
    assert not missing, f"README figures found in no docs/results JSON: {missing}"


def test_the_check_can_fail():
    # Control: a figure no JSON holds is caught.
    assert not _matches(12345.678, 3, _json_values())
    assert _matches(525074432, 0, _json_values())


def test_results_json_carry_no_temporary_paths():
    for f in RESULTS.glob("*.json"):
        text = f.read_text()
        for bad in ("/tmp/", "/dev/shm/", "/var/tmp/"):
            assert bad not in text, f"{f.name} holds an absolute temporary path ({bad})"


def test_named_json_files_exist():
    for name in re.findall(r"`([\w-]+\.json)`", (ROOT / "README.md").read_text()):
        assert (RESULTS / name).is_file(), f"README cites {name}, not in docs/results"

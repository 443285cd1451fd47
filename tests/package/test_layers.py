"""The package's layers, in the order data flows (docs/architecture.md):

    model      keys, layouts, records, sizes; errors; the engine's wrappers; settings
    tiers      where records live (L1, L2 on the engine, L3, striping, Mooncake), the
               store over them, and the fault double production loads by BSR_IO_FAULTS
    load/save  discovery, the window, reads, install, destinations; the save path
    restore    the Restorer, the rank agreement and its commit, metrics
    integrations, then the CLI

A module imports only from its own layer or the ones below it; nothing in the package
imports the lab (lab/bsr_lab: test support and lab-only benchmarks), and only the CLI
may import tqdm or matplotlib.

Imports are read from the source (ast), including those inside functions, so a lazy
import of a forbidden module is caught as well as a top-level one.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import bsr_io

PKG = Path(bsr_io.__file__).parent

# Each layer by its rank, and the module prefixes (under bsr_io) that belong to it.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("model", ("_core", "model", "errors", "engine", "settings")),
    ("tiers", ("tiers", "store", "faults")),
    ("load/save", ("load", "save")),
    ("restore", ("restore", "commit", "metrics")),
    ("integrations", ("integrations",)),
    ("cli", ("cli",)),
)
TOP = len(LAYERS)  # the package's __init__: the public API over every layer
CLI_ONLY = ("tqdm", "matplotlib")
NEVER = ("bsr_lab",)


def rank_of(name: str) -> int | None:
    """The layer rank of bsr_io module `name` (None: not a bsr_io module)."""
    parts = name.split(".")
    if parts[0] != "bsr_io":
        return None
    if len(parts) == 1:
        return TOP
    for rank, (_, prefixes) in enumerate(LAYERS):
        if parts[1] in prefixes:
            return rank
    raise AssertionError(f"{name} is in no layer: name it in LAYERS")


def _module_name(pkg: Path, path: Path) -> list[str]:
    parts = [pkg.name, *path.relative_to(pkg).with_suffix("").parts]
    return parts[:-1] if parts[-1] == "__init__" else parts


def imports_of(pkg: Path, path: Path) -> set[str]:
    """Absolute names of every module `path` imports (relative imports resolved)."""
    here = _module_name(pkg, path)
    package = here if path.name == "__init__.py" else here[:-1]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            names.add(mod)
            # `from bsr_io import cli` imports the submodule bsr_io.cli.
            names.update(f"{mod}.{a.name}" for a in node.names)
    return names


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def violations(pkg: Path) -> list[str]:
    out = []
    for path in sorted(pkg.rglob("*.py")):
        me = ".".join(_module_name(pkg, path))
        mine = rank_of(me)
        assert mine is not None
        for name in sorted(imports_of(pkg, path)):
            theirs = rank_of(name) if name.startswith("bsr_io") else None
            if (
                _under(name, NEVER)
                or (_under(name, CLI_ONLY) and mine < rank_of("bsr_io.cli"))
                or (theirs is not None and theirs > mine and name != "bsr_io")
            ):
                out.append(f"{path.relative_to(pkg.parent)} imports {name}")
    return out


def test_every_module_imports_only_its_layer_and_below():
    assert violations(PKG) == []


def test_the_check_catches_imports_upward_and_of_the_lab(tmp_path):
    """Control: the same check on a package that breaks every rule."""
    pkg = tmp_path / "bsr_io"
    for sub in ("model", "tiers", "load", "integrations", "cli"):
        (pkg / sub).mkdir(parents=True)
    (pkg / "__init__.py").write_text("from bsr_io.restore import Restorer\n")
    (pkg / "restore.py").write_text("from bsr_io.load.window import Window\nimport numpy\n")
    (pkg / "model" / "keys.py").write_text("def f():\n    from bsr_io.tiers import base\n")
    (pkg / "tiers" / "rel.py").write_text("from ..load import window\n")
    (pkg / "tiers" / "bar.py").write_text("import tqdm\n")
    (pkg / "load" / "up.py").write_text("from bsr_io import restore\n")
    (pkg / "integrations" / "x.py").write_text("from bsr_io.cli.sizes import parse_size\n")
    (pkg / "integrations" / "ok.py").write_text("from bsr_io.faults import FaultPlan\n")
    lazy = "def f():\n    from {} import {}\n"
    (pkg / "cli" / "h.py").write_text(lazy.format("bsr_lab.vllm", "harness"))
    (pkg / "cli" / "plots.py").write_text("import matplotlib\nfrom bsr_io.restore import R\n")
    found = violations(pkg)
    assert found == [
        "bsr_io/cli/h.py imports bsr_lab.vllm",
        "bsr_io/cli/h.py imports bsr_lab.vllm.harness",
        "bsr_io/integrations/x.py imports bsr_io.cli.sizes",
        "bsr_io/integrations/x.py imports bsr_io.cli.sizes.parse_size",
        "bsr_io/load/up.py imports bsr_io.restore",
        "bsr_io/model/keys.py imports bsr_io.tiers",
        "bsr_io/model/keys.py imports bsr_io.tiers.base",
        "bsr_io/tiers/bar.py imports tqdm",
        "bsr_io/tiers/rel.py imports bsr_io.load",
        "bsr_io/tiers/rel.py imports bsr_io.load.window",
    ]


# Made unimportable in the probe below, as on a machine without the extras.
BLOCK = "import sys\nsys.modules['tqdm'] = None\nsys.modules['matplotlib'] = None\n"


def _probe(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BLOCK + code], capture_output=True, text=True)


def test_the_restore_api_needs_no_tqdm_matplotlib_cli_or_lab():
    """`import bsr_io` (the whole restore API) works with tqdm and matplotlib unimportable
    and loads neither the CLI nor the lab; the control shows the block holds
    (the lab's plots cannot get matplotlib) and that its progress bars degrade to none."""
    ok = _probe(
        "import bsr_io\n"
        "assert bsr_io.Restorer and bsr_io.open_store\n"
        "print(sorted(m for m in sys.modules if m.startswith(('bsr_io.cli', 'bsr_lab'))))"
    )
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == "[]"
    plots = _probe("from bsr_lab import plots\nplots._pyplot()")
    assert plots.returncode != 0 and "matplotlib" in plots.stderr
    bars = _probe("from bsr_io.cli.progress import bar\nb = bar(3)\nb.update(2)\nprint(b.n)")
    assert bars.returncode == 0, bars.stderr
    assert bars.stdout.strip() == "2"

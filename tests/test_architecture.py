"""The package's layering: the core imports nothing from testing, the CLI (benchmarks,
fio, plots, progress bars) or the integrations; integrations and testing never import
the CLI; integrations import nothing from testing but the fault double (test harnesses,
such as the vLLM one, stay out of the production package).

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

# Layer of a module (by its first component under bsr_io) -> module prefixes it may
# not import. Everything not named here is the core.
FORBIDDEN = {
    "core": ("bsr_io.testing", "bsr_io.cli", "bsr_io.integrations", "tqdm", "matplotlib"),
    "integrations": ("bsr_io.cli", "bsr_io.testing", "tqdm", "matplotlib"),
    # What tests, demos and benches share (faults, ranks, synthetic data, scratch dirs)
    # stands below the CLI: the CLI uses it, never the other way round.
    "testing": ("bsr_io.cli", "tqdm", "matplotlib"),
}
# Exceptions to FORBIDDEN: the vLLM worker loads the documented fault double, lazily and
# only when BSR_IO_FAULTS is set (as every integration attaches it).
ALLOWED = {"integrations": ("bsr_io.testing.faults",)}
LAYERS = {"testing": "testing", "cli": "cli", "integrations": "integrations"}


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
            # `from bsr_io import testing` imports the submodule bsr_io.testing.
            names.update(f"{mod}.{a.name}" for a in node.names)
    return names


def layer_of(pkg: Path, path: Path) -> str:
    rel = path.relative_to(pkg).parts
    return LAYERS.get(rel[0], "core") if len(rel) > 1 else "core"


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def violations(pkg: Path) -> list[str]:
    out = []
    for path in sorted(pkg.rglob("*.py")):
        layer = layer_of(pkg, path)
        banned, allowed = FORBIDDEN.get(layer, ()), ALLOWED.get(layer, ())
        for name in sorted(imports_of(pkg, path)):
            if _under(name, banned) and not _under(name, allowed):
                out.append(f"{path.relative_to(pkg.parent)} imports {name}")
    return out


def test_core_and_integrations_keep_their_layers():
    assert violations(PKG) == []


def test_the_check_catches_forbidden_imports(tmp_path):
    """Control: the same check on a package whose core breaks every rule."""
    pkg = tmp_path / "bsr_io"
    (pkg / "tiers").mkdir(parents=True)
    (pkg / "integrations").mkdir()
    (pkg / "testing").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "fine.py").write_text("from bsr_io.keys import ChunkKey\nimport numpy\n")
    (pkg / "lazy.py").write_text("def f():\n    from bsr_io.cli.progress import bar\n")
    (pkg / "tiers" / "rel.py").write_text("from ..testing import faults\n")
    (pkg / "tiers" / "sub.py").write_text("from bsr_io import cli\nimport tqdm\n")
    (pkg / "integrations" / "x.py").write_text("from bsr_io.cli.sizes import parse_size\n")
    lazy = "def f():\n    from {} import {}\n"
    (pkg / "integrations" / "h.py").write_text(lazy.format("..testing", "vllm_harness"))
    (pkg / "integrations" / "f.py").write_text(lazy.format("bsr_io.testing.faults", "F"))
    (pkg / "testing" / "ok.py").write_text("from bsr_io.tiers import files\n")
    (pkg / "testing" / "up.py").write_text("def f():\n    from ..cli import host\n")
    found = violations(pkg)
    assert found == [
        "bsr_io/integrations/h.py imports bsr_io.testing",
        "bsr_io/integrations/h.py imports bsr_io.testing.vllm_harness",
        "bsr_io/integrations/x.py imports bsr_io.cli.sizes",
        "bsr_io/integrations/x.py imports bsr_io.cli.sizes.parse_size",
        "bsr_io/lazy.py imports bsr_io.cli.progress",
        "bsr_io/lazy.py imports bsr_io.cli.progress.bar",
        "bsr_io/testing/up.py imports bsr_io.cli",
        "bsr_io/testing/up.py imports bsr_io.cli.host",
        "bsr_io/tiers/rel.py imports bsr_io.testing",
        "bsr_io/tiers/rel.py imports bsr_io.testing.faults",
        "bsr_io/tiers/sub.py imports bsr_io.cli",
        "bsr_io/tiers/sub.py imports tqdm",
    ]


# Made unimportable in the probe below, as on a machine without the extras.
BLOCK = "import sys\nsys.modules['tqdm'] = None\nsys.modules['matplotlib'] = None\n"


def _probe(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BLOCK + code], capture_output=True, text=True)


def test_the_restore_api_needs_no_tqdm_matplotlib_cli_or_testing():
    """`import bsr_io` (the whole restore API) works with tqdm and matplotlib unimportable
    and loads neither the CLI nor the testing package; the control shows the block holds
    (the CLI's plots cannot get matplotlib) and that its progress bars degrade to none."""
    ok = _probe(
        "import bsr_io\n"
        "assert bsr_io.Restorer and bsr_io.open_store\n"
        "print(sorted(m for m in sys.modules if m.startswith(('bsr_io.cli', 'bsr_io.testing'))))"
    )
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == "[]"
    plots = _probe("from bsr_io.cli import plots\nplots._pyplot()")
    assert plots.returncode != 0 and "matplotlib" in plots.stderr
    bars = _probe("from bsr_io.cli.progress import bar\nb = bar(3)\nb.update(2)\nprint(b.n)")
    assert bars.returncode == 0, bars.stderr
    assert bars.stdout.strip() == "2"

"""Writing a command's figures as JSON (`--json PATH`)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_json(path: str | os.PathLike[str] | None, doc: Any) -> None:
    """Write `doc` to `path` (parents created) and say so; nothing when `path` is None."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {path}")

"""Atomic JSON files: a reader sees the old file or the whole new one, never a part.

Used where another process polls for a file (a worker's ready file, the network's state files, a
fidelity record) or where an interrupted write would lose a result (a reproduction's document). The data
goes to ``NAME.tmp`` beside the file, then `Path.replace` renames it over the file (atomic on POSIX
within one file system).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path: str | Path, data: Any, indent: int | None = None) -> Path:
    """Write `data` as JSON to `path` atomically (creating its directory); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=indent))
    tmp.replace(path)
    return path

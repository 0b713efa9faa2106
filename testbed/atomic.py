"""Atomic JSON files: a reader sees the old file or the whole new one, never a part.

Used where another process polls for a file (a worker's ready file, the network's state files, the
timing probe's record that `testbed.fidelity` reads back) or where an interrupted write would lose a
result (a reproduction's document). The data goes to ``NAME.tmp`` beside the file, then `Path.replace`
renames it over the file (atomic on POSIX within one file system). A write that fails removes its
temporary file and leaves the old file as it was.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path: str | Path, data: Any, indent: int | None = None) -> Path:
    """Write `data` as JSON to `path` atomically (creating its directory); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, indent=indent)  # fails here, before any file, on data that is not JSON
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path

"""Atomic files: a reader sees the old file or the whole new one, never a part.

Used where another process polls for a file (a worker's ready file, the network's state files, the
timing probe's record that `testbed.fidelity` reads back), where an interrupted write would lose a
result (a reproduction's document; an experiment's, a sweep's and a capacity search's result files),
and for every result file of a run directory (`testbed.rundir`'s writer, the WAN telemetry, the
router's records, the cross traffic; not the scratch files under ``work/``): a file rewritten by a run or a command killed while it writes keeps its
old contents. (A file half-written for the first time was already refused by the loader, and a resumed
experiment reruns such a run.) The data goes to a new ``NAME.<random>.tmp`` beside the file, then
`Path.replace` renames it over the file (atomic on POSIX within one file system). A write that fails
removes its temporary file and leaves the old file as it was; one the file system refuses (a folder in the file's
place, a read-only or full disk) is one `UserError` naming the file, as `make_dirs` names a folder.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any, Callable, TypeVar

from testbed.errors import UserError
from testbed.validation import not_a_folder

T = TypeVar("T")


def make_dirs(path: str | Path) -> Path:
    """Create folder `path` and its parents, as ``mkdir -p`` (nothing if it exists). A path that cannot be a
    folder -- a file in its place or on the way, no permission, a read-only file system -- is one `UserError`
    naming it: output paths come from users (``--out``, ``--plots``)."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        why = f"{p}: cannot create this folder ({exc.strerror or exc})"
        blocker = not_a_folder(p)
        if blocker is not None:  # which: ".../rate=4.234: Not a directory" did not say that the file in the way was probes/
            why += f"; {'it' if blocker[0] == p else blocker[0]} is {blocker[1]} where a folder goes: move it aside (or use another folder)"
        raise UserError(why) from None
    return p


def make_output_dir(path: str | Path | Callable[[T], str | Path], check: Callable[[], T]) -> T:
    """A command's output folder `path`, made (`make_dirs`) only once `check` -- every check of the command's input,
    raising `UserError` on a refusal -- has passed; returns what `check` returned (the checked plan). Every command
    that makes its output folder before its runs (`prfaas capacity`, `reproduce`, `quickstart`, `sweep`, `experiment`,
    `wall`, `lab start`) makes it here, so a refused invocation leaves no folder behind
    (`prfaas run`'s run directory is made by the runner, after `plan_run`): `prfaas capacity quick --set seed=-1` left
    an empty runs/capacity-quick-<time> (2026-12-07). `path` may be a function of the checked plan: a default folder
    named after what the checks read (`prfaas capacity`'s runs/capacity-<the scenario's name>-<time>)."""
    checked = check()
    make_dirs(path(checked) if callable(path) else path)
    return checked


def replace_with(path: str | Path, write: Callable[[Path], Any]) -> Path:
    """Call `write(tmp)` to write the new file beside `path`, then rename it over `path` (creating its
    directory); returns the path."""
    path = Path(path)
    make_dirs(path.parent)
    try:
        tmp = _new_temporary(path)
    except OSError as exc:  # a read-only file system: an OSError traceback after an experiment's last run
        raise _cannot_write(path, exc) from None
    try:
        write(tmp)
        tmp.replace(path)
    except OSError as exc:  # a folder where the file goes (IsADirectoryError), a full disk
        tmp.unlink(missing_ok=True)
        raise _cannot_write(path, exc) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _cannot_write(path: Path, exc: OSError) -> UserError:
    return UserError(f"{path}: cannot write this file ({exc.strerror or exc})")


def writable_dir(path: str | Path) -> Path:
    """`make_dirs`, then a check that a file can be written there (a read-only file system lets an existing folder
    be "made"): for a command that must not start minutes of work whose results it could not keep."""
    p = make_dirs(path)
    try:
        _new_temporary(p / ".write-check").unlink()
    except OSError as exc:
        raise UserError(f"{p}: cannot write in this folder ({exc.strerror or exc})") from None
    return p


def _new_temporary(path: Path) -> Path:
    """A new empty ``NAME.<random>.tmp`` beside `path`, one per write (writers never share it), created with the
    mode a plain write gives (0666 less the umask, applied by the kernel)."""
    while True:
        tmp = path.with_name(f"{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
            return tmp
        except FileExistsError:
            continue


def write_text(path: str | Path, text: str) -> Path:
    """Write `text` to `path` atomically; returns the path."""
    return replace_with(path, lambda tmp: tmp.write_text(text))


def write_parquet(path: str | Path, frame: Any) -> Path:
    """Write a pandas DataFrame to `path` as parquet (no index) atomically; returns the path."""
    return replace_with(path, lambda tmp: frame.to_parquet(tmp, index=False))


def write_json(path: str | Path, data: Any, indent: int | None = None, default: Callable[[Any], Any] | None = None) -> Path:
    """Write `data` as JSON to `path` atomically; returns the path."""
    return write_text(path, json.dumps(data, indent=indent, default=default))  # not JSON: fails before any file

"""Rich consoles for the tables that commands and benchmarks print."""

from __future__ import annotations

from typing import Any

from rich.console import Console

TABLE_WIDTH = 140  # columns at least: redirected to a file or a pipe, rich uses 80 and cuts arm and metric names


def wide_console(**kwargs: Any) -> Console:
    """A Console at least `TABLE_WIDTH` columns wide (wider on a wider terminal)."""
    return Console(width=max(TABLE_WIDTH, Console().width), **kwargs)

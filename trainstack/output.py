"""How results reach the user: rich tables for people, plain JSON for scripts, one-line errors."""

from __future__ import annotations

import json
import sys
from datetime import datetime, timezone
from typing import Any

from rich.console import Console


def console() -> Console:
    """A console bound to the current stdout (tests swap it), without auto-highlighting numbers."""
    return Console(file=sys.stdout, highlight=False, soft_wrap=False)


def print_json(document: Any) -> None:
    """Machine-readable output: plain JSON, nothing else on stdout."""
    sys.stdout.write(json.dumps(document, indent=2, sort_keys=True, default=str) + "\n")


def print_error(message: str) -> None:
    """A user-facing error: one line on stderr, newlines folded so it stays one line."""
    sys.stderr.write(f"trainstack: error: {' '.join(message.split())}\n")


def parse_time(value: Any) -> datetime | None:
    """An ISO-8601 timestamp as written by the agent and trainer (naive means UTC), or None."""
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)


def format_duration(seconds: float | None) -> str:
    """`1h 05m`, `4m 10s`, `12s`; `-` when unknown."""
    if seconds is None:
        return "-"
    total = max(0, round(seconds))
    days, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours:02d}h"
    if hours:
        return f"{hours}h {minutes:02d}m"
    if minutes:
        return f"{minutes}m {secs:02d}s"
    return f"{secs}s"


def format_usd(amount: float | None, digits: int = 2) -> str:
    """`$1.23`; `-` when unknown."""
    return "-" if amount is None else f"${amount:,.{digits}f}"

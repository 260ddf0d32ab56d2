"""The one exception a user sees: a single line naming what went wrong and the fix."""

from __future__ import annotations


class CliError(Exception):
    """A problem the user can fix; `str()` is the whole message, printed on one line without a traceback."""
